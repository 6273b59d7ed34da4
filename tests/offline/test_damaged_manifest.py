"""Damaged manifest files (empty, truncated, not JSON, of another shape): one line naming the
file, what is wrong and what to do; a damaged marker only makes its shard be redone."""

import json
import shutil

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.offline.manifest import MARKER_FIELDS, RUN_FIELDS, parse_record
from tests.conftest import write_shards

DAMAGES = {
    "empty": (b"", "it is empty"),
    "truncated": (b'{"fingerprint": {"job": "embed"}, "conf', "it is truncated or not JSON: "),
    "not JSON": (b"\x00\xff garbage", "it is truncated or not JSON: "),
    "a list": (b"[1, 2]\n", "it holds a JSON list, not an object"),
    "no fingerprint": (b'{"config": {}}\n', "it has no 'fingerprint'"),
    "a fingerprint of another type": (b'{"fingerprint": "x", "config": {}}', "its 'fingerprint' is a JSON str"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_parse_record_says_what_is_wrong(damage):
    data, problem = DAMAGES[damage]
    with pytest.raises(ValueError) as raised:
        parse_record(data, RUN_FIELDS)
    assert str(raised.value).startswith(problem)


def test_parse_record_returns_a_well_formed_record():
    assert parse_record(b'{"shard": "part-00000", "status": "done", "rows": 3}', MARKER_FIELDS) == {
        "shard": "part-00000", "status": "done", "rows": 3}


def run_args(inputs, output, model, *extra):
    return ["run", "--input", str(inputs), "--output", str(output), "--model", model, "--max-length", "64",
            "--no-progress", "--tokenize-workers", "0", *extra]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, sample_table, tiny_encoder_path):
    """An input of three shards (30, 40, 20 rows) and the output of a run over it."""
    root = tmp_path_factory.mktemp("finished")
    write_shards(root / "in", sample_table.slice(0, 90), [30, 40, 20])
    result = CliRunner().invoke(cli, run_args(root / "in", root / "out", tiny_encoder_path))
    assert result.exit_code == 0, result.output
    return root


@pytest.fixture
def output(tmp_path, finished_run):
    """A copy of the finished run's output, to damage."""
    shutil.copytree(finished_run / "out", tmp_path / "out")
    return tmp_path / "out"


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_run_json_is_one_line_exit_2_for_run_status_and_verify(output, finished_run, tiny_encoder_path,
                                                                         damage):
    data, problem = DAMAGES[damage]
    run_json = output / ".lengthwise" / "run.json"
    run_json.write_bytes(data)
    outputs_before = {p.name: p.read_bytes() for p in output.glob("*.parquet")}
    for args in (run_args(finished_run / "in", output, tiny_encoder_path), ["status", "--output", str(output)],
                 ["verify", "--output", str(output)]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2, result.output
        lines = result.output.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {run_json} is damaged ({problem}")
        assert lines[0].endswith("delete it and rerun the job with those settings (shards marked done are kept) "
                                 "or with --overwrite (every shard is redone)")
    assert run_json.read_bytes() == data
    assert {p.name: p.read_bytes() for p in output.glob("*.parquet")} == outputs_before


def test_after_deleting_a_damaged_run_json_the_rerun_keeps_the_done_shards(output, finished_run, tiny_encoder_path):
    (output / ".lengthwise" / "run.json").unlink()
    result = CliRunner().invoke(cli, run_args(finished_run / "in", output, tiny_encoder_path))
    assert result.exit_code == 0, result.output
    assert "nothing to do: 3 of 3 shards done" in result.output
    assert json.loads((output / ".lengthwise" / "run.json").read_text())["fingerprint"]["job"] == "embed"


@pytest.mark.parametrize("damage", ["empty", "truncated", "no shard"])
def test_a_damaged_marker_is_a_warning_and_its_shard_is_redone(output, finished_run, tiny_encoder_path,
                                                               sample_table, damage):
    marker = output / ".lengthwise" / "shards" / "part-00001.json"
    marker.write_bytes({"empty": b"", "truncated": b'{"shard": "part-00001", "sta',
                        "no shard": b'{"status": "done"}'}[damage])
    status = CliRunner().invoke(cli, ["status", "--output", str(output), "--json"])
    assert status.exit_code == 1, status.output  # not complete until the rerun
    warning, report = status.output.split("\n", 1)
    assert warning.startswith(f"{marker} is damaged (")
    assert warning.endswith("); its shard counts as not done: a run redoes it and writes the marker anew")
    assert (json.loads(report)["done"], json.loads(report)["pending"]) == (2, 1)

    result = CliRunner().invoke(cli, run_args(finished_run / "in", output, tiny_encoder_path))
    assert result.exit_code == 0, result.output
    assert "2 of 3 shards already done, resuming" in result.output
    assert json.loads(marker.read_text())["status"] == "done"
    ids = [row for name in ("part-00000", "part-00001", "part-00002")
           for row in pq.read_table(output / f"{name}.parquet")["id"].to_pylist()]
    assert ids == sample_table["id"].to_pylist()[:90]
    verify = CliRunner().invoke(cli, ["verify", "--output", str(output)])
    assert verify.exit_code == 0, verify.output


def test_verify_reports_a_shard_with_a_damaged_marker_as_not_done(output):
    marker = output / ".lengthwise" / "shards" / "part-00002.json"
    marker.write_text("{")
    result = CliRunner().invoke(cli, ["verify", "--output", str(output)])
    assert result.exit_code == 1
    assert result.output.splitlines()[0].startswith(f"{marker} is damaged (it is truncated or not JSON: ")
    assert "shard     part-00002: not recorded as done (no marker); rerun the job" in result.output


def test_a_damaged_worker_summary_is_a_warning_in_status(output):
    summary = output / ".lengthwise" / "workers" / "0-of-1.json"
    assert summary.exists()
    summary.write_text('{"index": 0, "count": 1}')
    result = CliRunner().invoke(cli, ["status", "--output", str(output)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == (f"{summary} is damaged (it has no 'at'); that worker's last speed is "
                                            "not shown; its next run writes the file anew")
    assert f"{output}: 3 of 3 shards done, 0 failed, 0 pending; 90 of 90 rows done" in result.output


def test_a_damaged_run_json_of_the_reuse_source_is_one_line_exit_2(tmp_path, output, finished_run,
                                                                   tiny_encoder_path):
    run_json = output / ".lengthwise" / "run.json"
    run_json.write_text("")
    result = CliRunner().invoke(cli, run_args(finished_run / "in", tmp_path / "today", tiny_encoder_path,
                                              "--reuse", str(output)))
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [
        f"error: {run_json} is damaged (it is empty); it says which settings the --reuse output was made with: "
        "name another --reuse, or drop --reuse"]
    assert not (tmp_path / "today").exists()


def garbage(path):
    path.write_bytes(b"\x00\xff not a Parquet file " * 8)


def cut_in_half(path):
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def emptied(path):
    path.write_bytes(b"")


def a_folder(path):
    path.unlink()
    path.mkdir()
    (path / "notes.txt").write_text("a folder took the output's name")


NOT_PARQUET = "is not readable Parquet (ArrowInvalid: Parquet magic bytes not found in footer. Either the file is " \
              "corrupted or this is not a parquet file.)"
UNREADABLE_OUTPUTS = {  # damage → (how, what status, verify and the rerun say of it)
    "garbage": (garbage, NOT_PARQUET),
    "truncated": (cut_in_half, NOT_PARQUET),
    "zero bytes": (emptied, "is not readable Parquet (ArrowInvalid: Parquet file size is 0 bytes)"),
    "a folder": (a_folder, "is a folder, not a Parquet file"),
}


def shard_lines(output: str, prefix: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(prefix)]


def assert_status_says_the_middle_shard_is_not_done(output, finished_run, why: str) -> str:
    """`status` of the 3-shard run whose second shard's output no longer backs its marker: exit 1, 2 of 3
    done, that shard not done for `why`. Returns the shard's URL."""
    shard_url = f"file://{finished_run / 'in' / 'part-00001.parquet'}"
    status = CliRunner().invoke(cli, ["status", "--output", str(output)])
    assert status.exit_code == 1, status.output
    assert status.output.splitlines()[0] == f"{output}: 2 of 3 shards done, 0 failed, 1 pending; 50 of 90 rows done"
    assert shard_lines(status.output, "not done") == [f"not done  {shard_url}: marked done but {why}; a run redoes it"]
    return shard_url


@pytest.mark.parametrize("damage", UNREADABLE_OUTPUTS)
def test_an_unreadable_done_output_is_pending_in_status_reported_by_verify_and_redone(output, finished_run,
                                                                                      tiny_encoder_path,
                                                                                      sample_table, damage):
    damage_it, problem = UNREADABLE_OUTPUTS[damage]
    damaged = output / "part-00001.parquet"
    damage_it(damaged)
    reason = f"its output file {damaged} {problem}"
    shard_url = assert_status_says_the_middle_shard_is_not_done(output, finished_run, reason)
    report = json.loads(CliRunner().invoke(cli, ["status", "--output", str(output), "--json"]).output)
    assert (report["done"], report["pending"], report["rows_done"]) == (2, 1, 50)
    assert report["untrusted_shards"] == [{"shard": shard_url, "reason": reason}]
    assert report["totals"]["rows"] == 50  # the output's totals count the shards whose files back them

    verify = CliRunner().invoke(cli, ["verify", "--output", str(output)])
    assert verify.exit_code == 1 and "Traceback" not in verify.output
    [line] = shard_lines(verify.output, "shard")
    assert line.startswith(f"shard     part-00001: cannot read file://{damaged} (") and line.endswith(
        "); rerun the job: it redoes the shard")

    result = CliRunner().invoke(cli, run_args(finished_run / "in", output, tiny_encoder_path))
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert [line for line in result.output.splitlines() if "marked done" in line] == [
        f"{shard_url} is marked done but {reason}; redoing it"]
    assert "2 of 3 shards already done, resuming" in result.output
    ids = [row for name in ("part-00000", "part-00001", "part-00002")
           for row in pq.read_table(output / f"{name}.parquet")["id"].to_pylist()]
    assert ids == sample_table["id"].to_pylist()[:90]
    assert damaged.is_file() and pq.ParquetFile(damaged).metadata.num_rows == 40
    for command in ("status", "verify"):
        after = CliRunner().invoke(cli, [command, "--output", str(output)])
        assert after.exit_code == 0, after.output


def test_status_says_a_committed_shard_that_lost_a_row_is_not_done(output, finished_run):
    shrunk = output / "part-00001.parquet"
    pq.write_table(pq.read_table(shrunk).slice(0, 39), shrunk)  # rewritten with one row fewer
    assert_status_says_the_middle_shard_is_not_done(output, finished_run,
                                                    "its output file has 39 rows and the input shard 40")
    verify = CliRunner().invoke(cli, ["verify", "--output", str(output)])
    assert verify.exit_code == 1 and "shard     part-00001: 1 row(s) missing: ids " in verify.output


def test_status_counts_an_output_rewritten_with_the_same_rows_done_and_says_it_changed(output, finished_run,
                                                                                      tiny_encoder_path):
    rewritten = output / "part-00001.parquet"
    marker = json.loads((output / ".lengthwise" / "shards" / "part-00001.json").read_text())
    pq.write_table(pq.read_table(rewritten), rewritten, compression="gzip")  # recompressed: same rows, other bytes
    size = rewritten.stat().st_size
    assert size != marker["bytes"]
    status = CliRunner().invoke(cli, ["status", "--output", str(output)])
    assert status.exit_code == 0, status.output
    assert status.output.splitlines()[0] == f"{output}: 3 of 3 shards done, 0 failed, 0 pending; 90 of 90 rows done"
    assert shard_lines(status.output, "changed") == [
        f"changed   {rewritten}: rewritten since its commit ({size:,} bytes, its marker records {marker['bytes']:,}) "
        "with the same 40 rows; counted done, `lengthwise verify` audits its ids"]
    report = json.loads(CliRunner().invoke(cli, ["status", "--output", str(output), "--json"]).output)
    assert report["changed_shards"] == [{"output": str(rewritten), "bytes": size, "recorded_bytes": marker["bytes"],
                                        "rows": 40}]
    assert CliRunner().invoke(cli, ["verify", "--output", str(output)]).exit_code == 0
    again = CliRunner().invoke(cli, run_args(finished_run / "in", output, tiny_encoder_path))
    assert again.exit_code == 0 and "nothing to do: 3 of 3 shards done" in again.output
