"""benchmarks/host_rate.py's harness still reaches the real pipeline: it swaps the shard runner's setup for one
whose forward returns zeros, and a refactor that moves that setup would break the benchmark silently."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.conftest import write_shards

ROOT = Path(__file__).resolve().parents[2]


def load_host_rate():
    spec = importlib.util.spec_from_file_location("host_rate", ROOT / "benchmarks" / "host_rate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["host_rate"] = module
    spec.loader.exec_module(module)
    return module


def put_back_what_the_harness_replaces(patches: pytest.MonkeyPatch) -> None:
    """What host_rate.py replaces (the runner's setup, the choice of a feeder process), restored when `patches` is
    undone."""
    import pipeline.engines.runner_setup as runner_setup
    import pipeline.offline.runner as runner
    from pipeline.offline import feeder

    patches.setattr(runner_setup, "open_chosen_models", runner_setup.open_chosen_models)
    patches.setattr(runner.SetupClock, "breakdown", runner.SetupClock.breakdown)
    patches.setattr(feeder, "uses_feeder_process", feeder.uses_feeder_process)


@pytest.mark.slow
def test_the_harness_runs_the_real_pipeline_with_a_forward_of_zeros(tmp_path, sample_table, monkeypatch):
    host_rate = load_host_rate()
    put_back_what_the_harness_replaces(monkeypatch)
    forwarded = []
    zero_forward = host_rate.ZeroForwardJob.forward
    monkeypatch.setattr(host_rate.ZeroForwardJob, "forward",
                        lambda job, model, input_ids, *args, **kwargs: forwarded.append(int(input_ids.shape[0]))
                        or zero_forward(job, model, input_ids, *args, **kwargs))
    write_shards(tmp_path / "in", sample_table.select(["id", "text"]).slice(0, 200), [120, 80])
    figures = host_rate.measure_pipeline(tmp_path / "in", 200, 128, 1)
    assert sum(forwarded) == 200 - figures["deduplicated_rows"]  # every row the run computes went through zeros
    assert figures["rows_per_s"] > 0 and figures["main_process_us_per_row"] > 0


@pytest.mark.slow
def test_the_feeder_process_hands_the_device_loop_the_batches_a_cpu_run_builds(tmp_path, sample_table, monkeypatch):
    """host_rate's pipeline runs as on a GPU host, its batches from a feeder process (offline/feeder.py), and
    `--in-process-producer` as on a CPU: the device loop gets the very same batches either way."""
    from pipeline.offline import feeder

    host_rate = load_host_rate()
    batches: dict[bool, list] = {}
    feeders = []
    zero_forward = host_rate.ZeroForwardJob.forward
    start_feeder = feeder._Feeder.__init__
    monkeypatch.setattr(feeder._Feeder, "__init__", lambda process: start_feeder(process) or feeders.append(process))
    write_shards(tmp_path / "in", sample_table.select(["id", "text"]).slice(0, 300), [120, 100, 80])
    for feeder_process in (False, True):
        recorded = batches.setdefault(feeder_process, [])

        def forward(job, model, input_ids, attention_mask, *args, recorded=recorded, **kwargs):
            recorded.append((tuple(input_ids.shape), input_ids.numpy().tobytes(), attention_mask.numpy().tobytes()))
            return zero_forward(job, model, input_ids, attention_mask, *args, **kwargs)

        with monkeypatch.context() as patches:  # put back after each run, so the second does not wrap the first
            put_back_what_the_harness_replaces(patches)
            patches.setattr(host_rate.ZeroForwardJob, "forward", forward)
            host_rate.measure_pipeline(tmp_path / "in", 300, 128, 1, feeder_process=feeder_process)
        assert len(feeders) == int(feeder_process)
    assert len(batches[False]) > 1 and batches[True] == batches[False]
