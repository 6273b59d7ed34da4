"""A done marker is trusted only with its output: a missing output file, or one that does not hold
the input shard's rows, is redone by the next run, which says so."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.engines.local import run_job
from pipeline.offline.done_markers import done_marker_problem, output_file_problem
from tests.offline.test_reliability import config_for, read_outputs, three_shards  # noqa: F401 (a fixture)


def never_read():
    raise AssertionError("the footer is read only when the file's size is not the recorded one")


def listed(size: int, kind: str = "file") -> dict:
    """A listing's entry for an output file, as fsspec gives it."""
    return {"name": "/out/part-00001.parquet", "type": kind, "size": size}


def test_a_marker_with_its_file_of_the_recorded_size_is_trusted_without_a_read():
    assert done_marker_problem({"rows": 30, "bytes": 1234}, 30, listed(1234), never_read) is None


def test_a_missing_file_or_rows_that_differ_untrust_the_marker():
    assert done_marker_problem({"rows": 30, "bytes": 1234}, 30, None, never_read) == "its output file is missing"
    assert done_marker_problem({"rows": 30, "bytes": 1234}, 31, listed(1234), never_read) == \
        "it records 30 rows and the input shard now has 31"
    assert done_marker_problem({"rows": 30, "bytes": 1234}, 30, listed(999), lambda: 12) == \
        "its output file has 12 rows and the input shard 30"
    assert done_marker_problem({"rows": 30, "bytes": 1234}, 30, listed(999), lambda: 30) is None  # same rows
    assert done_marker_problem({"rows": 30}, 30, listed(999), lambda: 30) is None  # a marker from before sizes


def test_an_unreadable_output_or_a_folder_in_its_place_untrusts_the_marker_without_raising():
    def not_parquet():
        raise pa.ArrowInvalid("Parquet file size is 0 bytes")

    assert done_marker_problem({"rows": 30, "bytes": 1234}, 30, listed(0), not_parquet) == \
        "its output file /out/part-00001.parquet is not readable Parquet (ArrowInvalid: Parquet file size is 0 bytes)"
    assert done_marker_problem({"rows": 30, "bytes": 1234}, 30, listed(4096, "directory"), never_read) == \
        "its output file /out/part-00001.parquet is a folder, not a Parquet file"


def test_output_file_problem_checks_a_file_against_its_markers_rows_and_bytes():
    assert output_file_problem({"rows": 30, "bytes": 1234}, listed(1234), never_read) is None
    assert output_file_problem({"rows": 30, "bytes": 1234}, listed(999), lambda: 29) == \
        "its output file has 29 rows and the input shard 30"
    assert output_file_problem({"rows": 30, "bytes": 1234}, listed(999), lambda: 30) is None
    assert output_file_problem({"rows": 30, "bytes": 1234}, None, never_read) == "its output file is missing"
    assert output_file_problem({}, listed(999), lambda: 29) is None  # a marker that records nothing to check


@pytest.mark.slow
def test_a_deleted_or_replaced_output_is_redone_by_the_next_run(tmp_path, three_shards, tiny_encoder_path, caplog):
    run_job(config_for(tmp_path, tiny_encoder_path))
    out = tmp_path / "out"
    clean = read_outputs(out)
    marker = json.loads((out / ".lengthwise" / "shards" / "part-00000.json").read_text())
    assert marker["bytes"] == (out / "part-00000.parquet").stat().st_size
    (out / "part-00001.parquet").unlink()  # the marker stays: status said done, verify said rerun
    pq.write_table(clean["part-00002"].slice(0, 5), out / "part-00002.parquet")  # replaced by hand, 5 rows
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        second = run_job(config_for(tmp_path, tiny_encoder_path))
    assert second.shards_done_before == 1 and second.rows == 60
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"file://{three_shards}/part-00001.parquet is marked done but its output file is missing; redoing it" in warnings
    assert (f"file://{three_shards}/part-00002.parquet is marked done but its output file has 5 rows and the input shard "
            "30; redoing it") in warnings
    again = read_outputs(out)
    assert again.keys() == clean.keys()
    for stem in clean:
        assert again[stem]["id"].equals(clean[stem]["id"])
    third = run_job(config_for(tmp_path, tiny_encoder_path))
    assert third.shards_done_before == 3 and third.rows == 0


@pytest.mark.slow
def test_half_written_markers_a_kill_left_are_removed_by_the_next_run_with_work(tmp_path, three_shards,
                                                                                tiny_encoder_path):
    run_job(config_for(tmp_path, tiny_encoder_path))
    shards = tmp_path / "out" / ".lengthwise" / "shards"
    (shards / "part-00001.json.0badc0de.tmp").write_text('{"shard": "part-00')  # killed mid-write
    (tmp_path / "out" / "part-00001.parquet").unlink()
    run_job(config_for(tmp_path, tiny_encoder_path))
    assert sorted(p.name for p in shards.iterdir()) == ["part-00000.json", "part-00001.json", "part-00002.json"]
