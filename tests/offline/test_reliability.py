"""Nightly-run reliability: resume, fingerprints, bad rows, bad shards, locks, status."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.offline.config import RunConfig
from pipeline.core.errors import UsageError
from pipeline.engines.local import run_job
from pipeline.offline.manifest import fingerprint_differences, pending
from tests.conftest import write_shards


@pytest.fixture
def three_shards(tmp_path, sample_table):
    write_shards(tmp_path / "in", sample_table.slice(0, 90), [30, 30, 30])
    return tmp_path / "in"


def config_for(tmp_path, model, **settings) -> RunConfig:
    settings.setdefault("input", (str(tmp_path / "in"),))
    return RunConfig.of(output=str(tmp_path / "out"), model=model, max_length=64, progress=False, tokenize_workers=0,
                        **settings)


def read_outputs(directory) -> dict[str, pa.Table]:
    return {p.stem: pq.read_table(p) for p in sorted(directory.glob("*.parquet"))}


def test_pending_is_a_pure_difference_in_input_order():
    assert pending(["a", "b", "c", "d"], {"c", "a", "x"}) == ["b", "d"]


def test_fingerprint_differences_name_each_changed_setting():
    assert fingerprint_differences({"max_length": 128, "job": "embed"}, {"max_length": 64, "job": "embed"}) == [
        "max_length: 128 → 64"]


@pytest.mark.slow
def test_rerun_skips_done_shards_and_redoes_a_missing_one(tmp_path, three_shards, tiny_encoder_path):
    first = run_job(config_for(tmp_path, tiny_encoder_path))
    clean = read_outputs(tmp_path / "out")
    assert first.rows == 90 and first.shards_done_before == 0
    (tmp_path / "out" / "part-00001.parquet").unlink()
    (tmp_path / "out" / ".lengthwise" / "shards" / "part-00001.json").unlink()
    second = run_job(config_for(tmp_path, tiny_encoder_path, max_batch_tokens=512, max_batch_rows=3))
    assert second.shards_done_before == 2 and second.rows == 30
    again = read_outputs(tmp_path / "out")
    assert again.keys() == clean.keys()
    assert again["part-00001"]["id"].equals(clean["part-00001"]["id"])
    third = run_job(config_for(tmp_path, tiny_encoder_path))
    assert third.shards_done_before == 3 and third.rows == 0


@pytest.mark.slow
def test_rerun_under_other_settings_is_refused_unless_overwrite(tmp_path, three_shards, tiny_encoder_path):
    run_job(config_for(tmp_path, tiny_encoder_path))
    shorter = config_for(tmp_path, tiny_encoder_path).with_settings(max_length=32)
    with pytest.raises(UsageError, match=r"other settings \(max_length: 64 → 32\).*--overwrite"):
        run_job(shorter)
    redone = run_job(shorter.with_settings(overwrite=True))
    assert redone.shards_done_before == 0 and redone.rows == 90
    run_json = json.loads((tmp_path / "out" / ".lengthwise" / "run.json").read_text())
    assert run_json["fingerprint"]["max_length"] == 32


@pytest.mark.slow
def test_bad_rows_get_an_error_each_and_nothing_is_dropped(tmp_path, tiny_encoder_path):
    texts = [b"fine text", b"bad \xff\xfe utf-8", None, b"", "long " .encode() * 200, b"second fine text",
             b"dup one", b"dup two", b" \t\n ", b""]
    ids = ["a", "b", "c", None, "e", "f", "dup", "dup", "w", "empty"]
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": ids, "text": pa.array(texts, pa.binary())}), tmp_path / "in" / "rows.parquet")
    summary = run_job(config_for(tmp_path, tiny_encoder_path))
    out = pq.read_table(tmp_path / "out" / "rows.parquet").to_pylist()
    assert [row["id"] for row in out] == ids
    errors = [row["error"] for row in out]
    assert errors[0] is None and errors[5] is None
    assert errors[1].startswith("text is not valid UTF-8 (byte 4")
    assert errors[2] == "text is null"
    assert errors[3] == "id is null"  # (its text is empty too; the id is checked last and wins)
    assert errors[4] is None and out[4]["truncated"] is True and out[4]["embedding"] is not None
    assert [row["embedding"] is None for row in out] == [e is not None for e in errors]
    assert errors[8] == errors[9] == "text is empty or whitespace only"
    assert summary.error_rows == 5 and summary.truncated_rows == 1
    assert summary.duplicate_ids == 1 and summary.duplicate_id_examples == ["dup"]
    assert errors[6] is None and errors[7] is None  # duplicates are kept, in place


def _corrupt_middle(path):
    data = bytearray(path.read_bytes())
    middle = len(data) // 3
    data[middle:middle + 64] = b"\x00" * 64
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_bad_shards_fail_alone_and_the_others_are_committed(tmp_path, sample_table, tiny_encoder_path):
    good = sample_table.slice(0, 20)
    (tmp_path / "in").mkdir()
    pq.write_table(good, tmp_path / "in" / "a-good.parquet")
    (tmp_path / "in" / "b-not-parquet.parquet").write_bytes(b"PAR1 this is not parquet at all")
    pq.write_table(good.rename_columns(["id", "body"]), tmp_path / "in" / "c-no-text.parquet")
    pq.write_table(pa.table({"id": ["x"], "text": [3]}), tmp_path / "in" / "d-int-text.parquet")
    full = pq.read_table(tmp_path / "in" / "a-good.parquet")
    pq.write_table(full, tmp_path / "in" / "e-truncated.parquet")
    data = (tmp_path / "in" / "e-truncated.parquet").read_bytes()
    (tmp_path / "in" / "e-truncated.parquet").write_bytes(data[: len(data) // 2])
    pq.write_table(pa.table({"id": [f"z{i}" for i in range(2000)], "text": [f"row {i} " * 20 for i in range(2000)]}),
                   tmp_path / "in" / "f-corrupt-page.parquet", compression="snappy", row_group_size=500)
    _corrupt_middle(tmp_path / "in" / "f-corrupt-page.parquet")
    pq.write_table(good, tmp_path / "in" / "g-good.parquet")

    result = CliRunner().invoke(cli, ["run", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                                      "--model", tiny_encoder_path, "--no-progress", "--tokenize-workers", "0"])
    assert result.exit_code == 1, result.output
    assert sorted(read_outputs(tmp_path / "out")) == ["a-good", "g-good"]
    markers = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "out" / ".lengthwise" / "shards").glob("*")}
    assert {stem: m["status"] for stem, m in markers.items()} == {
        "a-good": "done", "b-not-parquet": "failed", "c-no-text": "failed", "d-int-text": "failed",
        "e-truncated": "failed", "f-corrupt-page": "failed", "g-good": "done"}
    assert "has no column 'text'" in markers["c-no-text"]["error"]
    assert "is int64, not a string" in markers["d-int-text"]["error"]
    assert "FAILED" in result.output and "5 shard(s) failed" in result.output
    assert not list((tmp_path / "out").glob(".*.tmp"))

    # a rerun retries the failed shards only (and they fail again)
    again = CliRunner().invoke(cli, ["run", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                                     "--model", tiny_encoder_path, "--no-progress", "--tokenize-workers", "0",
                                     "--summary-json", str(tmp_path / "s.json")])
    assert again.exit_code == 1
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["shards_done_before"] == 2 and len(summary["failed_shards"]) == 5

    status = CliRunner().invoke(cli, ["status", "--output", str(tmp_path / "out"), "--json"])
    report = json.loads(status.output)
    assert (report["shards"], report["done"], report["failed"], report["pending"]) == (7, 2, 5, 0)
    assert report["rows_done"] == 40


@pytest.mark.slow
def test_fail_fast_stops_at_the_first_failed_shard(tmp_path, sample_table, tiny_encoder_path):
    (tmp_path / "in").mkdir()
    pq.write_table(sample_table.slice(0, 10), tmp_path / "in" / "a.parquet")
    (tmp_path / "in" / "b.parquet").write_bytes(b"garbage")
    pq.write_table(sample_table.slice(10, 10), tmp_path / "in" / "c.parquet")
    summary = run_job(config_for(tmp_path, tiny_encoder_path, fail_fast=True, window_rows=5))
    assert [f["shard"].rsplit("/", 1)[-1] for f in summary.failed_shards] == ["b.parquet"]
    assert sorted(read_outputs(tmp_path / "out")) == ["a"]


def test_a_second_run_on_the_same_output_is_refused_and_a_stale_lock_taken_over(tmp_path, three_shards,
                                                                                 tiny_encoder_path):
    lock = tmp_path / "out" / ".lengthwise" / "lock"
    lock.parent.mkdir(parents=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(json.dumps({"host": os.uname().nodename, "pid": sleeper.pid, "since": "earlier"}))
        with pytest.raises(UsageError, match=f"another run \\(pid {sleeper.pid}"):
            run_job(config_for(tmp_path, tiny_encoder_path))
    finally:
        sleeper.kill()
        sleeper.wait()
    summary = run_job(config_for(tmp_path, tiny_encoder_path))  # the holder is dead now: stale
    assert summary.rows == 90
    assert not lock.exists()


def test_status_without_a_run_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(cli, ["status", "--output", str(tmp_path)])
    assert result.exit_code == 2 and "has no lengthwise run" in result.output


@pytest.mark.slow
def test_pickle_checkpoints_are_refused_unless_allowed(tmp_path, tiny_encoder_path, three_shards):
    import shutil

    import torch
    from safetensors.torch import load_file

    pickled = tmp_path / "pickled-model"
    shutil.copytree(tiny_encoder_path, pickled)
    weights = load_file(pickled / "model.safetensors")
    (pickled / "model.safetensors").unlink()
    torch.save(weights, pickled / "pytorch_model.bin")
    with pytest.raises(UsageError, match="only pickle checkpoints \\(pytorch_model.bin\\).*--allow-pickle"):
        run_job(config_for(tmp_path, str(pickled)))
    summary = run_job(config_for(tmp_path, str(pickled), allow_pickle=True))
    assert summary.rows == 90


def test_a_classify_job_refuses_a_model_without_a_classification_head(tmp_path, tiny_encoder_path, three_shards):
    with pytest.raises(UsageError, match="no trained weights for classifier"):
        run_job(config_for(tmp_path, tiny_encoder_path, job="classify"))


def test_transient_errors_are_retried_with_backoff_and_others_are_not():
    from pipeline.core.retry import is_transient, retry_transient

    calls, sleeps = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError("An error occurred (SlowDown) when calling the PutObject operation")
        return "ok"

    assert retry_transient(flaky, "put", sleep=sleeps.append) == "ok"
    assert len(calls) == 3 and len(sleeps) == 2
    assert all(0 <= delay <= 0.5 * 2 ** i for i, delay in enumerate(sleeps))

    def missing():
        calls.append(1)
        raise FileNotFoundError("s3://bucket/x.parquet")

    calls.clear()
    with pytest.raises(FileNotFoundError):
        retry_transient(missing, "get", sleep=sleeps.append)
    assert len(calls) == 1

    calls.clear()
    with pytest.raises(TimeoutError):
        retry_transient(lambda: calls.append(1) or (_ for _ in ()).throw(TimeoutError("read timed out")), "get",
                        attempts=4, sleep=lambda s: None)
    assert len(calls) == 4
    assert is_transient(ConnectionResetError()) and not is_transient(PermissionError("denied"))
    assert not is_transient(ValueError("read 503 rows"))


@pytest.mark.slow
def test_dtype_auto_resumes_with_the_dtype_the_output_was_made_with(tmp_path, three_shards, tiny_encoder_path):
    """Whatever `auto` would pick on this node now, a rerun keeps the recorded dtype."""
    run_job(config_for(tmp_path, tiny_encoder_path, dtype="bfloat16", input=(str(three_shards / "part-00000.parquet"),)))
    resumed = run_job(config_for(tmp_path, tiny_encoder_path, dtype="auto"))  # the other two shards, resumed
    assert resumed.dtype == "bfloat16" and resumed.shards_done_before == 1 and resumed.rows == 60
    # the summary says where the dtype came from: not `--dtype`, which the rerun did not pass
    assert resumed.dtype_reason == f"bfloat16: what {tmp_path / 'out'} was made with (--dtype auto)"
    run_json = json.loads((tmp_path / "out" / ".lengthwise" / "run.json").read_text())
    assert run_json["fingerprint"]["dtype"] == "bfloat16"
    with pytest.raises(UsageError, match=r"dtype: 'bfloat16' → 'float32'"):
        run_job(config_for(tmp_path, tiny_encoder_path, dtype="float32"))
