"""Killing a run at any moment loses nothing: signals, SIGKILL and resume, orphan workers."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import run_in_this_process, write_shards

LENGTHWISE = str(Path(sys.executable).parent / "lengthwise")


@pytest.fixture(scope="module")
def many_rows(sample_table) -> pa.Table:
    """2,400 rows: the sample six times, with unique ids."""
    parts = [pa.table({"id": [f"{k}/{i}" for i in sample_table["id"].to_pylist()], "text": sample_table["text"]})
             for k in range(6)]
    return pa.concat_tables(parts)


def command(inputs, output, model, *extra):
    # one row per batch and small windows: many small steps and a commit every few windows,
    # so a signal lands in the middle of the work, not after the last forward
    return [LENGTHWISE, "run", "--input", str(inputs), "--output", str(output), "--model", model,
            "--max-length", "64", "--max-batch-rows", "1", "--window-rows", "100", "--no-progress",
            "--no-probe", *extra]


def outputs(directory) -> dict[str, list]:
    return {p.name: pq.read_table(p).to_pylist() for p in sorted(Path(directory).glob("*.parquet"))}


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, many_rows, tiny_encoder_path):
    base = tmp_path_factory.mktemp("clean")
    write_shards(base / "in", many_rows, [400] * 6)
    # the reference run needs no process of its own: only the interrupted runs do
    run_in_this_process(command(base / "in", base / "out", tiny_encoder_path, "--tokenize-workers", "0"))
    return base / "in", outputs(base / "out")


@pytest.mark.slow
def test_sigterm_stops_cleanly_with_143_and_a_rerun_finishes(tmp_path, clean_run, tiny_encoder_path):
    inputs, expected = clean_run
    process = subprocess.Popen(command(inputs, tmp_path / "out", tiny_encoder_path, "--tokenize-workers", "0"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    markers = tmp_path / "out" / ".lengthwise" / "shards"
    assert wait_for(lambda: markers.exists() and any(markers.iterdir()), 120), "no shard was committed"
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    assert "interrupted by SIGTERM" in stderr
    assert not list((tmp_path / "out").glob(".*.tmp")), "a temporary file survived"
    assert not (tmp_path / "out" / ".lengthwise" / "lock").exists()
    done_before = len(list(markers.iterdir()))
    rerun = run_in_this_process(command(inputs, tmp_path / "out", tiny_encoder_path, "--tokenize-workers", "0"))
    assert f"{done_before} of 6 shards already done, resuming" in rerun
    assert outputs(tmp_path / "out") == expected


@pytest.mark.slow
def test_sigkill_at_a_random_moment_then_rerun_equals_a_clean_run(tmp_path, clean_run, tiny_encoder_path):
    """One kill here, while the model loads and the first shards run; benchmarks/chaos.py's soak (six kills in the
    suite, tests/benchmarks/test_chaos.py) kills at many more moments."""
    inputs, expected = clean_run
    delay_s = random.Random(1).uniform(3.0, 9.0)  # 3.8 s: loading, first shards
    process = subprocess.Popen(command(inputs, tmp_path / "out", tiny_encoder_path, "--tokenize-workers", "1"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay_s)
    workers = [child.pid for child in psutil.Process(process.pid).children(recursive=True)]
    process.kill()
    process.wait()
    # tokenizer workers notice their parent is gone and exit: no orphans
    assert wait_for(lambda: not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                                    for pid in workers), 20), f"orphaned workers {workers}"
    # the lock of the killed run is stale and is taken over
    run_in_this_process(command(inputs, tmp_path / "out", tiny_encoder_path, "--tokenize-workers", "0"))
    assert outputs(tmp_path / "out") == expected
    assert not list((tmp_path / "out").glob(".*.tmp")), "the rerun left a killed run's temporary file"
    visible = sorted(p.name for p in (tmp_path / "out").glob("*.parquet"))
    assert visible == sorted(expected)


@pytest.mark.slow
def test_a_sigint_inside_a_window_that_spans_shards_keeps_the_shards_finished_before_it(tmp_path, many_rows,
                                                                                        tiny_encoder_path):
    """One window holds all six 100-row shards; each shard is committed when its own rows are
    done, not when the window is, so an interrupt after the first commit keeps it and loses
    less than the window."""
    rows = many_rows.slice(0, 600)
    write_shards(tmp_path / "in", rows, [100] * 6)
    one_window = command(tmp_path / "in", tmp_path / "out", tiny_encoder_path, "--tokenize-workers", "0") + [
        "--window-rows", "600"]
    process = subprocess.Popen(one_window, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    markers = tmp_path / "out" / ".lengthwise" / "shards"
    assert wait_for(lambda: markers.exists() and any(markers.iterdir()), 120), "no shard was committed"
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    done = sorted(p.stem for p in markers.iterdir())
    assert 1 <= len(done) < 6, done  # the window's first shards are committed, its last ones are not
    assert sorted(p.stem for p in (tmp_path / "out").glob("*.parquet")) == done
    rerun = subprocess.run(one_window, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(done)} of 6 shards already done, resuming" in rerun.stderr
    written = outputs(tmp_path / "out")
    assert [[row["id"] for row in written[f"part-{i:05d}.parquet"]] for i in range(6)] == [
        rows["id"].to_pylist()[100 * i:100 * (i + 1)] for i in range(6)]


@pytest.mark.slow
def test_a_sigkill_of_the_run_leaves_no_leaked_semaphore_warning_and_no_spec_file(tmp_path, many_rows,
                                                                                  tiny_encoder_path):
    """The tokenizer pool holds no semaphore (core/worker_pool.py) and removes its spec file once its workers
    are up, so the resource tracker that outlives a SIGKILLed run has nothing to warn about in the run's log."""
    write_shards(tmp_path / "in", many_rows.slice(0, 400), [20] * 20)  # the first commit comes soon
    temporary = tmp_path / "tmp"  # the run's own temp folder: other runs on the machine leave theirs elsewhere
    temporary.mkdir()
    process = subprocess.Popen(command(tmp_path / "in", tmp_path / "out", tiny_encoder_path, "--tokenize-workers",
                                       "2"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "TMPDIR": str(temporary)})
    markers = tmp_path / "out" / ".lengthwise" / "shards"
    assert wait_for(lambda: markers.exists() and any(markers.iterdir()), 120), "no shard was committed"
    process.kill()
    # stderr ends when every process that shares it has exited: the workers and the resource tracker
    stderr = process.stderr.read()
    process.wait()
    assert "leaked semaphore" not in stderr and "Traceback" not in stderr, stderr
    assert list(temporary.glob("lengthwise-tokenizer-*")) == []
