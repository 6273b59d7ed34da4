"""Static fan-out: N worker processes (--num-shards N --shard-index I) into one output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.core.errors import UsageError
from pipeline.offline.source import WorkerSlot, resolve_worker_slot, slot_of
from tests.conftest import assert_equal_outputs, read_outputs, run_to_table, write_shards

LENGTHWISE = str(Path(sys.executable).parent / "lengthwise")
SIZES = [40, 30, 0, 50, 45, 35]


# ── the slot: pure ─────────────────────────────────────────────────────────────────────


def test_the_index_comes_from_the_flag_else_the_scheduler():
    assert resolve_worker_slot(1, None, {}) == WorkerSlot(0, 1, "single worker")
    assert resolve_worker_slot(4, 2, {"JOB_COMPLETION_INDEX": "3"}) == WorkerSlot(2, 4, "--shard-index")
    assert resolve_worker_slot(4, None, {"JOB_COMPLETION_INDEX": "3"}) == WorkerSlot(3, 4, "JOB_COMPLETION_INDEX")
    slurm = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "4"}
    assert resolve_worker_slot(4, None, slurm) == WorkerSlot(1, 4, "SLURM_ARRAY_TASK_ID")


@pytest.mark.parametrize("count, index, environ, message", [
    (3, 3, {}, "worker index 3 (from --shard-index) is outside 0…2"),
    (3, -1, {}, "worker index -1 (from --shard-index) is outside 0…2"),
    (2, None, {"JOB_COMPLETION_INDEX": "2"}, "worker index 2 (from JOB_COMPLETION_INDEX) is outside 0…1"),
    (2, None, {}, "needs this worker's index"),
    (2, None, {"SLURM_ARRAY_TASK_ID": "x"}, "is not a worker index"),
])
def test_a_bad_index_is_a_usage_error(count, index, environ, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        resolve_worker_slot(count, index, environ)


def test_the_slots_split_the_sorted_shards_exactly_once():
    urls = [f"s3://b/part-{i:03d}.parquet" for i in (7, 3, 11, 0, 5, 9, 1)]
    for count in (1, 2, 3, 7, 10):
        taken = [url for index in range(count) for url in slot_of(urls, WorkerSlot(index, count))]
        assert sorted(taken) == sorted(urls)
    assert slot_of(urls, WorkerSlot(1, 3)) == sorted(urls)[1::3]
    assert slot_of(urls, WorkerSlot()) == urls  # one worker keeps the input order


def test_an_index_outside_the_range_exits_2(tmp_path):
    result = CliRunner().invoke(cli, ["run", "--input", "x", "--output", str(tmp_path / "o"), "--num-shards", "3"],
                                env={"JOB_COMPLETION_INDEX": "7"})
    assert result.exit_code == 2 and "worker index 7 (from JOB_COMPLETION_INDEX) is outside 0…2" in result.output


# ── real worker processes ──────────────────────────────────────────────────────────────


def worker_command(inputs: Path, output: Path, model: str, count: int, index: int | None) -> list[str]:
    command = [LENGTHWISE, "run", "--input", str(inputs), "--output", str(output), "--model", model,
               "--max-length", "128", "--no-progress", "--tokenize-workers", "0", "--num-shards", str(count),
               "--dtype", "float32"]
    return command + (["--shard-index", str(index)] if index is not None else [])


@pytest.mark.slow
def test_two_concurrent_workers_equal_a_local_run_and_status_counts_each(tmp_path, rows_with_bad_ones,
                                                                          tiny_encoder_path):
    expected, _ = run_to_table(tmp_path, "local", rows_with_bad_ones, SIZES, model=tiny_encoder_path, max_length=128)
    write_shards(tmp_path / "in", rows_with_bad_ones, SIZES)
    output = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # worker 1 gets its index the way a Kubernetes Indexed Job gives it
    workers = [subprocess.Popen(worker_command(tmp_path / "in", output, tiny_encoder_path, 2, 0), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
               subprocess.Popen(worker_command(tmp_path / "in", output, tiny_encoder_path, 2, None),
                                env={**env, "JOB_COMPLETION_INDEX": "1"}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)]
    for worker in workers:
        _, stderr = worker.communicate(timeout=300)
        assert worker.returncode == 0, stderr
    assert "worker 1 of 2 (index from JOB_COMPLETION_INDEX): 3 shard(s)" in stderr
    assert sorted(p.name for p in output.glob("*.parquet")) == [f"part-{i:05d}.parquet" for i in range(6)]
    assert not list(output.glob(".*.tmp")) and not list((output / ".lengthwise").glob("lock*"))
    assert_equal_outputs(read_outputs(output), expected)

    report = json.loads(CliRunner().invoke(cli, ["status", "--output", str(output), "--json"]).output)
    assert (report["shards"], report["done"], report["pending"], report["rows_done"]) == (6, 6, 0, 200)
    assert [(w["index"], w["shards"], w["done"], w["running"]) for w in report["workers"]] == [
        (0, 3, 3, False), (1, 3, 3, False)]
    assert all(w["last_rows_per_s"] > 0 for w in report["workers"] if w["rows_done"])
    summaries = sorted(p.name for p in (output / ".lengthwise" / "workers").glob("*.json"))
    assert summaries == ["0-of-2.json", "1-of-2.json"]
    assert "shard_index" not in json.loads((output / ".lengthwise" / "run.json").read_text())["config"]


@pytest.mark.slow
def test_a_worker_index_given_twice_is_refused_and_status_shows_it_running(tmp_path, rows_with_bad_ones,
                                                                           tiny_encoder_path):
    write_shards(tmp_path / "in", rows_with_bad_ones, SIZES)
    output = tmp_path / "out"
    first = CliRunner().invoke(cli, worker_command(tmp_path / "in", output, tiny_encoder_path, 2, 1)[1:])
    assert first.exit_code == 0, first.output
    lock = output / ".lengthwise" / "lock-worker-1-of-2"
    with subprocess.Popen(["sleep", "60"]) as sleeper:  # a live process holding worker 1's lock
        try:
            lock.write_text(json.dumps({"host": os.uname().nodename, "pid": sleeper.pid, "since": "earlier",
                                        "index": 1, "count": 2}))
            again = CliRunner().invoke(cli, worker_command(tmp_path / "in", output, tiny_encoder_path, 2, 1)[1:])
            assert again.exit_code == 2 and "another worker with index 1 of 2" in again.output
            other_layout = CliRunner().invoke(cli, worker_command(tmp_path / "in", output, tiny_encoder_path, 1,
                                                                  None)[1:])
            assert other_layout.exit_code == 2 and "split 2 way(s) are writing" in other_layout.output
            status = CliRunner().invoke(cli, ["status", "--output", str(output)])
            assert "worker 0: 0 of 3 shards done, 0 failed, 3 pending" in status.output
            assert "worker 1: 3 of 3 shards done, 0 failed, 0 pending (running)" in status.output
            assert f"worker 1 of 2 running: pid {sleeper.pid}" in status.output
        finally:
            sleeper.kill()
    assert lock.exists()  # the refused runs left the holder's lock alone


@pytest.mark.slow
def test_a_worker_never_deletes_another_workers_temporary_file(tmp_path, rows_with_bad_ones, tiny_encoder_path):
    write_shards(tmp_path / "in", rows_with_bad_ones, SIZES)
    output = tmp_path / "out"
    output.mkdir()
    # shards sorted: part-00000 … part-00005; worker 1 of 2 owns 00001, 00003, 00005
    live = output / ".part-00003.parquet.attempt-of-worker-1.tmp"
    live.write_bytes(b"being written")
    # one worker after the other, in this process: what is tested is which temporaries each removes
    zero = CliRunner().invoke(cli, worker_command(tmp_path / "in", output, tiny_encoder_path, 2, 0)[1:])
    assert zero.exit_code == 0, zero.output
    assert live.exists(), "worker 0 removed a temporary file of worker 1"
    one = CliRunner().invoke(cli, worker_command(tmp_path / "in", output, tiny_encoder_path, 2, 1)[1:])
    assert one.exit_code == 0, one.output
    assert not live.exists() and "removed temporary files of an interrupted run" in one.output
