"""The feeder process (offline/feeder.py): on CUDA the run's batches are built in a process of their own. Here on
the CPU it is chosen by hand (`uses_feeder_process`); everything else is the real run."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pyarrow as pa
import pytest

from pipeline.core.buckets import BatchLimits
from pipeline.core.clock import StageTimes
from pipeline.core.tokenize import WorkerStartError, load_tokenizer_spec
from pipeline.offline import feeder
from pipeline.offline.config import RunConfig
from pipeline.offline.producer import ProducerSpec
from pipeline.offline.source import list_source_shards
from pipeline.offline.windows import BatchPacking, WindowBatch, WindowPart
from tests.conftest import run_to_table, write_shards


def feeders(monkeypatch) -> list[subprocess.Popen]:
    """From now on every run's producer is a feeder process; the processes started, for the test to look at."""
    started = []
    monkeypatch.setattr(feeder, "uses_feeder_process", lambda device_type: True)
    start = feeder._Feeder.__init__

    def recorded(self):
        start(self)
        started.append(self.process)

    monkeypatch.setattr(feeder._Feeder, "__init__", recorded)
    return started


def rows_with_repeats_and_long_ones(sample_table) -> pa.Table:
    texts = sample_table["text"].to_pylist()[:300]
    texts[7] = texts[3]  # dedupe copies it
    texts[120] = texts[118]
    texts[40] = " ".join(texts[41:60])  # longer than max_length: segments
    texts[60] = None
    return pa.table({"id": [f"row-{i}" for i in range(300)], "text": pa.array(texts, pa.string()),
                     "lang": pa.array(["en"] * 300)})


SETTINGS = {"several windows and shards, split into segments": dict(window_rows=64, long_text="split"),
            "two tokenizer workers, one batch a row": dict(tokenize_workers=2, max_batch_rows=1, window_rows=100)}


@pytest.mark.slow
@pytest.mark.parametrize("setting", SETTINGS)
def test_a_run_fed_by_a_feeder_process_writes_cell_for_cell_what_a_run_fed_here_does(
        tmp_path, sample_table, tiny_encoder_path, monkeypatch, setting):
    table = rows_with_repeats_and_long_ones(sample_table)
    settings = dict(model=tiny_encoder_path, max_length=32, keep_columns=("lang",), **SETTINGS[setting])
    expected, expected_summary = run_to_table(tmp_path, "here", table, [100, 0, 130, 70], **settings)
    started = feeders(monkeypatch)
    ours, summary = run_to_table(tmp_path, "fed", table, [100, 0, 130, 70], **settings)
    assert len(started) == 1 and started[0].wait(timeout=30) == 0  # one feeder for the run, closed with it
    assert ours.equals(expected)
    for count in ("rows", "error_rows", "deduplicated_rows", "truncated_rows", "real_tokens", "padded_tokens",
                  "batches"):
        assert summary[count] == expected_summary[count], count
    assert summary["deduplicated_rows"] == 2
    assert summary["stage_s"]["tokenize"] > 0 and summary["stage_s"]["read"] > 0  # the feeder's times, sent back
    assert list(summary["setup_steps"]) == list(expected_summary["setup_steps"])


@pytest.mark.slow
def test_reuse_through_a_feeder_copies_yesterdays_results_and_logs_its_index_once(
        tmp_path, sample_table, tiny_encoder_path, monkeypatch, caplog):
    table = rows_with_repeats_and_long_ones(sample_table)
    settings = dict(model=tiny_encoder_path, max_length=32, window_rows=64)
    first, _ = run_to_table(tmp_path, "first", table, [150, 150], **settings)
    started = feeders(monkeypatch)
    with caplog.at_level("INFO", logger="pipeline"):
        again, summary = run_to_table(tmp_path, "again", table, [150, 150], reuse=str(tmp_path / "first-out"),
                                      **settings)
    assert len(started) == 1
    assert summary["reused_rows"] == 299  # every row but the null one
    assert again.equals(first)
    indexed = [r for r in caplog.records if r.getMessage().startswith("--reuse: indexed 300 rows of 2 shard(s)")]
    assert len(indexed) == 1 and indexed[0].name == "pipeline.offline.producer"


@pytest.mark.slow
def test_a_killed_feeder_stops_the_run_with_its_name_and_a_rerun_writes_every_row(
        tmp_path, sample_table, tiny_encoder_path, monkeypatch):
    from pipeline.engines.local import run_job

    table = rows_with_repeats_and_long_ones(sample_table)
    settings = dict(model=tiny_encoder_path, max_length=32, window_rows=32, tokenize_workers=0, dtype="float32")
    expected, _ = run_to_table(tmp_path, "here", table, [100, 100, 100], **settings)
    started = feeders(monkeypatch)
    ready = feeder.FeederProcess.ready

    def killed_once_ready(self):
        ready(self)
        if len(started) == 1:
            os.kill(started[0].pid, signal.SIGKILL)

    monkeypatch.setattr(feeder.FeederProcess, "ready", killed_once_ready)
    write_shards(tmp_path / "in", table, [100, 100, 100])
    config = RunConfig.of(input=(str(tmp_path / "in"),), output=str(tmp_path / "out"), progress=False, **settings)
    with pytest.raises(feeder.FeederDied, match=r"the feeder process \(pid \d+\) exited with code -9; the shards not "
                                                r"committed are redone"):
        run_job(config)
    assert started[0].poll() == -9
    run_job(config)  # the rerun: a feeder of its own
    assert len(started) == 2
    written = pa.concat_tables(pa.parquet.read_table(p) for p in sorted((tmp_path / "out").glob("*.parquet")))
    assert written.equals(expected)


def test_a_worker_that_cannot_start_is_told_with_its_type(tiny_encoder_path):
    spec = load_tokenizer_spec(tiny_encoder_path, 32)
    broken = feeder.FeederProcess(type(spec)("not a tokenizer", 32, spec.pad_token_id), 1)
    try:
        broken.configure(producer_spec(RunConfig.of(input=("unused",), output="unused")))
        with pytest.raises(WorkerStartError, match="a tokenizer worker process"):
            broken.ready()
    finally:
        broken.close()


def producer_spec(config: RunConfig, limits: BatchLimits | None = None, window_rows: int = 64) -> ProducerSpec:
    packing = BatchPacking(window_rows, None, 16, 32, 0, 1, False)
    return ProducerSpec(config, packing, limits or BatchLimits(None))


def fed(tmp_path, tiny_encoder_path, rows: int, keep_pool: bool = False):
    """A feeder process over `rows` rows in three shards, configured; its shards."""
    texts = [f"row {i:04d} is a row like every other" for i in range(rows)]  # one length: full batches
    write_shards(tmp_path / "in", pa.table({"id": [str(i) for i in range(rows)], "text": texts}),
                 [rows // 3, rows // 3, rows - 2 * (rows // 3)])
    config = RunConfig.of(input=(str(tmp_path / "in"),), output=str(tmp_path / "out"), prefetch_batches=2)
    process = feeder.FeederProcess(load_tokenizer_spec(tiny_encoder_path, 32), 1, keep_pool=keep_pool)
    limits = BatchLimits(None)
    process.configure(producer_spec(config, limits))
    process.ready()
    return process, limits, list_source_shards(config.source)


def test_a_limit_lowered_by_the_device_loop_plans_the_feeders_later_batches(tmp_path, tiny_encoder_path):
    process, limits, shards = fed(tmp_path, tiny_encoder_path, 600)
    try:
        rows_per_batch = []
        for item in process.items(shards, StageTimes()):
            if isinstance(item, WindowBatch):
                rows_per_batch.append(len(item.batch.rows))
                if len(rows_per_batch) == 3:  # as an out-of-memory split does, at every length
                    for length in range(1, 33):
                        limits.lower(length, 2)
        assert rows_per_batch[:3] == [16, 16, 16]
        # the feeder runs ahead by its ring's slots at most: after them, every batch takes the lowered limit
        assert max(rows_per_batch[3 + 2 + 1 + feeder.SPARE_SLOTS + 2:]) <= 2
        assert sum(rows_per_batch) == 600
    finally:
        process.close()


def test_shards_started_while_a_run_goes_on_are_run_from_their_first_window_once(tmp_path, tiny_encoder_path):
    process, _, shards = fed(tmp_path, tiny_encoder_path, 300, keep_pool=True)
    try:
        never_run = process.start(shards[2:])
        assert list(process._not_run) == [never_run.pool[1]]
        del never_run  # a Ray actor's call that failed before its run: the feeder forgets it
        assert process._not_run == {}
        counted, begun = {}, None
        for item in process.items(shards[:1], StageTimes()):
            if begun is None:
                begun = process.start(shards[1:])  # a Ray actor's next shards, while this run goes on
            if isinstance(item, WindowPart):
                counted["first"] = counted.get("first", 0) + item.end_row - item.start_row
        assert process.end_run(failed=False)  # kept: in step, and its pool kept
        process.ready()
        parts = [item for item in process.items(shards[1:], StageTimes(), begun) if isinstance(item, WindowPart)]
        assert counted == {"first": 100}
        assert sum(p.end_row - p.start_row for p in parts) == 200
        ids = np.concatenate([b.ids.to_numpy(zero_copy_only=False).astype(int) for p in parts for b in p.blocks])
        assert sorted(ids.tolist()) == list(range(100, 300))
    finally:
        process.close()


@pytest.mark.slow
def test_the_feeder_and_its_workers_exit_when_the_runs_process_is_killed(tmp_path, tiny_encoder_path):
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        from tests.offline.test_feeder import children_of
        from pipeline.core.tokenize import load_tokenizer_spec
        from pipeline.offline.feeder import FeederProcess
        process = FeederProcess(load_tokenizer_spec({tiny_encoder_path!r}, 32), 2)
        process.ready()  # its two tokenizer workers up
        pid = process._process.process.pid
        print(pid, *children_of(pid), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                               cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert completed.returncode == -9, completed.stderr
    pids = [int(pid) for pid in completed.stdout.split()]
    assert len(pids) >= 3  # the feeder, its two workers (and multiprocessing's resource tracker)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(map(alive, pids)):
        time.sleep(0.2)
    assert not any(map(alive, pids))


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def children_of(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as children:
            found += [int(child) for child in children.read().split()]
    return found


@pytest.mark.slow
def test_a_kept_feeder_that_died_between_runs_is_started_again_for_the_next(tmp_path, tiny_encoder_path):
    process, _, shards = fed(tmp_path, tiny_encoder_path, 300, keep_pool=True)
    try:
        first = [i for i in process.items(shards[:1], StageTimes()) if isinstance(i, WindowPart)]
        assert process.end_run(failed=False)
        dead = process._process.process
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait(timeout=30)
        begun = process.start(shards[1:])  # a Ray actor's next shard: on a feeder started again, not an error
        process.ready()
        assert process._process.process is not dead
        parts = [i for i in process.items(shards[1:], StageTimes(), begun) if isinstance(i, WindowPart)]
        assert sum(p.end_row - p.start_row for p in first) == 100
        assert sum(p.end_row - p.start_row for p in parts) == 200
    finally:
        process.close()



FED_LENGTHWISE = ("import sys; from pipeline.offline import feeder; feeder.uses_feeder_process = lambda device_type: "
                  "True; sys.argv[0] = 'lengthwise'; from pipeline.cli import main; main()")  # as on CUDA: a feeder


@pytest.mark.slow
def test_sigterm_to_a_run_fed_by_a_feeder_exits_143_takes_its_processes_and_a_rerun_finishes(
        tmp_path, sample_table, tiny_encoder_path):
    import psutil

    from tests.conftest import run_in_this_process

    table = pa.concat_tables([pa.table({"id": [f"{k}/{i}" for i in sample_table["id"].to_pylist()],
                                        "text": sample_table["text"]}) for k in range(2)])
    write_shards(tmp_path / "in", table, [table.num_rows // 6] * 5 + [table.num_rows - 5 * (table.num_rows // 6)])
    arguments = ["run", "--input", str(tmp_path / "in"), "--model", tiny_encoder_path, "--max-length", "64",
                 "--max-batch-rows", "1", "--window-rows", "100", "--no-progress", "--no-probe",
                 "--tokenize-workers", "1"]
    run_in_this_process(["lengthwise", *arguments, "--output", str(tmp_path / "whole")])
    process = subprocess.Popen([sys.executable, "-c", FED_LENGTHWISE, *arguments, "--output", str(tmp_path / "out")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    markers = tmp_path / "out" / ".lengthwise" / "shards"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (markers.exists() and any(markers.iterdir())):
        time.sleep(0.05)
    helpers = psutil.Process(process.pid).children(recursive=True)
    assert any("pipeline.offline.feeder" in " ".join(p.cmdline()) for p in helpers)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    assert "interrupted by SIGTERM" in stderr
    _, left = psutil.wait_procs(helpers, timeout=20)
    assert not left, f"left running: {[p.cmdline() for p in left]}"
    assert not list((tmp_path / "out").glob(".*.tmp"))
    run_in_this_process(["lengthwise", *arguments, "--output", str(tmp_path / "out")])
    written = {p.name: pa.parquet.read_table(p) for p in sorted((tmp_path / "out").glob("*.parquet"))}
    whole = {p.name: pa.parquet.read_table(p) for p in sorted((tmp_path / "whole").glob("*.parquet"))}
    assert list(written) == list(whole) and all(written[name].equals(whole[name]) for name in whole)


@pytest.mark.slow
def test_a_fail_fast_run_fed_by_a_feeder_keeps_the_feeders_stage_times(tmp_path, sample_table, tiny_encoder_path,
                                                                       monkeypatch):
    from pipeline.engines.local import run_job

    write_shards(tmp_path / "in", rows_with_repeats_and_long_ones(sample_table).drop_columns(["lang"]),
                 [100, 100, 100])
    (tmp_path / "in" / "part-00001.parquet").write_bytes(b"not parquet at all")  # the run stops at it
    started = feeders(monkeypatch)
    config = RunConfig.of(input=(str(tmp_path / "in"),), output=str(tmp_path / "out"), progress=False,
                          model=tiny_encoder_path, max_length=32, window_rows=50, tokenize_workers=0,
                          fail_fast=True)
    summary = run_job(config)
    assert len(started) == 1 and summary.failed_shards and summary.rows < 300  # left before the end
    assert summary.stage_s["read"] > 0 and summary.stage_s["tokenize"] > 0  # the feeder's, told with each part
