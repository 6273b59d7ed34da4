"""`lengthwise verify` on real outputs: passes on a good one, fails naming the shard and ids on
a removed row, a duplicated row, a missing shard, a leftover partial file and settings that differ."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.offline.verify import compare_id_counts, first_difference, verify_output
from tests.conftest import run_to_table


def test_compare_id_counts_names_missing_extra_and_duplicated_ids():
    found = compare_id_counts(Counter(["a", "b", "c", "d"]), Counter(["a", "c", "c", "c", "z"]), listed=1)
    assert (found.missing, found.missing_ids) == (2, ["b"])
    assert (found.duplicated, found.duplicated_ids) == (2, ["c"])
    assert (found.extra, found.extra_ids) == (1, ["z"])
    assert compare_id_counts(Counter([1, 1]), Counter([1, 1])).agrees


def test_first_difference_is_chunking_independent():
    chunks = lambda values, size: [pa.array(values[i:i + size]) for i in range(0, len(values), size)]  # noqa: E731
    values = list(range(10))
    assert first_difference(chunks(values, 3), chunks(values, 4)) is None
    assert first_difference(chunks(values, 3), chunks(values[:7] + [99, 8, 9], 5)) == 7
    assert first_difference(chunks(values, 3), chunks(values[:6], 2)) == 6
    assert first_difference([pa.array([1, None])], [pa.array([1, None])]) is None
    assert first_difference([pa.array([1, None])], [pa.array([1, 2])]) == 1


def test_nan_ids_equal_nan_ids_in_order_and_in_counts():
    """NaN != NaN, so a correct output with a NaN float id was reported both missing and extra."""
    from pipeline.offline.verify import _counts

    nan = float("nan")
    ids = [pa.array([1.5, nan, None, nan]), pa.array([2.5], pa.float32())]
    assert first_difference(ids, [pa.array([1.5, float("nan")]), pa.array([None, float("nan")]),
                                  pa.array([2.5], pa.float32())]) is None
    assert first_difference([pa.array([nan, 2.0])], [pa.array([nan, 3.0])]) == 1
    assert first_difference([pa.array([nan, 2.0])], [pa.array([1.0, 2.0])]) == 0
    assert first_difference([pa.array([None, 2.0])], [pa.array([nan, 2.0])]) == 0  # a null is not a NaN
    counts = _counts([pa.array([nan, 1.0]), pa.array([float("nan"), None])])
    assert compare_id_counts(counts, _counts([pa.array([float("nan"), float("nan"), None, 1.0])])).agrees
    found = compare_id_counts(counts, _counts([pa.array([nan, 1.0, None])]))
    assert (found.missing, found.extra, found.duplicated) == (1, 0, 0) and repr(found.missing_ids) == "[nan]"


@pytest.mark.slow
def test_an_output_with_nan_float_ids_verifies(tmp_path, tiny_encoder_path):
    rows = pa.table({"id": [0.5, float("nan"), 2.5, float("nan"), 4.5], "text": ["a", "b", "c", "d", "e"]})
    run_to_table(tmp_path, "nan", rows, [3, 2], model=tiny_encoder_path)
    result = CliRunner().invoke(cli, ["verify", "--input", str(tmp_path / "nan-in"), "--output",
                                      str(tmp_path / "nan-out")])
    assert result.exit_code == 0, result.output
    assert "complete: 2 of 2 shards agree" in result.output
    rewrite(tmp_path / "nan-out" / "part-00000.parquet", lambda table: table.slice(0, 1))  # drops 1 NaN row
    result = CliRunner().invoke(cli, ["verify", "--input", str(tmp_path / "nan-in"), "--output",
                                      str(tmp_path / "nan-out")])
    assert result.exit_code == 1 and "2 row(s) missing: ids nan, 2.5" in result.output
    assert "extra" not in result.output


@pytest.fixture(scope="module")
def good_output(tmp_path_factory, rows_with_bad_ones, tiny_encoder_path):
    directory = tmp_path_factory.mktemp("verify")
    run_to_table(directory, "night", rows_with_bad_ones, [80, 70, 50], model=tiny_encoder_path, max_length=128)
    return directory


@pytest.fixture
def output(tmp_path, good_output):
    shutil.copytree(good_output / "night-out", tmp_path / "out")
    return tmp_path / "out"


def verify(good_output, output, *flags):
    return CliRunner().invoke(cli, ["verify", "--input", str(good_output / "night-in"), "--output", str(output),
                                    *flags])


def test_a_good_output_verifies(good_output, output):
    result = verify(good_output, output, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["complete"] and report["rows"] == 200 and len(report["shards"]) == 3
    assert report["error_rows"] == 4  # the two null and two blank texts of rows_with_bad_ones
    assert sum(report["error_reasons"].values()) == 4
    assert "complete: 3 of 3 shards agree" in verify(good_output, output).output


def rewrite(path, transform):
    table = pq.read_table(path)
    pq.write_table(transform(table), path)
    return table


def test_a_removed_row_is_named(good_output, output):
    table = rewrite(output / "part-00001.parquet", lambda t: pa.concat_tables([t.slice(0, 10), t.slice(11)]))
    result = verify(good_output, output)
    assert result.exit_code == 1
    assert f"shard     part-00001: 1 row(s) missing: ids {table['id'][10].as_py()!r}" in result.output
    report = verify_output([str(good_output / "night-in")], str(output))
    bad = [s for s in report.shards if s.problems]
    assert [s.shard for s in bad] == ["part-00001"] and bad[0].ids.missing_ids == [table["id"][10].as_py()]


def test_a_duplicated_row_is_named(good_output, output):
    table = rewrite(output / "part-00002.parquet", lambda t: pa.concat_tables([t, t.slice(5, 1)]))
    result = verify(good_output, output, "--json")
    assert result.exit_code == 1
    shard = [s for s in json.loads(result.output)["shards"] if s["problems"]]
    assert [s["shard"] for s in shard] == ["part-00002"]
    assert shard[0]["ids"]["duplicated"] == 1 and shard[0]["ids"]["duplicated_ids"] == [table["id"][5].as_py()]


def test_a_reordered_shard_is_named(good_output, output):
    rewrite(output / "part-00000.parquet", lambda t: t.take(list(range(1, 80)) + [0]))
    result = verify(good_output, output)
    assert result.exit_code == 1
    assert "part-00000: the ids are all there once but out of input order from row 0" in result.output


def test_a_missing_shard_and_a_partial_file_are_named(good_output, output):
    (output / "part-00001.parquet").rename(output / ".part-00001.parquet.0123abcd.tmp")
    result = verify(good_output, output)
    assert result.exit_code == 1
    assert "shard     part-00001: no output file" in result.output
    assert "partial" in result.output and ".part-00001.parquet.0123abcd.tmp" in result.output


def test_an_extra_output_file_and_a_shard_of_other_settings_are_named(good_output, output):
    shutil.copy(output / "part-00000.parquet", output / "part-00099.parquet")
    marker_path = output / ".lengthwise" / "shards" / "part-00002.json"
    marker = json.loads(marker_path.read_text())
    marker_path.write_text(json.dumps({**marker, "fingerprint": "0000000000000000"}))
    result = verify(good_output, output)
    assert result.exit_code == 1
    assert "no input shard makes this output file" in result.output and "part-00099.parquet" in result.output
    assert "shard     part-00002: committed under other settings" in result.output


def test_verify_without_a_run_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(cli, ["verify", "--output", str(tmp_path)])
    assert result.exit_code == 2 and "no lengthwise run" in result.output
