"""Limits of the CUDA path that a CPU can check: the allocator check
under cudaMallocAsync, the row clamp at CUDA's grid limit and the export's row bound. None of
it has run on a GPU."""

from __future__ import annotations


import pytest
import torch

from pipeline.core.batch_setting import resolve_batch_setting
from pipeline.core.settings import MAX_BATCH_ROWS, BatchSettings, ModelSettings
from pipeline.offline.config import RunConfig


def test_the_allocator_check_does_not_ask_cuda_malloc_async_for_segments(monkeypatch):
    """memory_snapshot() raises under the cudaMallocAsync backend (a setting users may choose):
    every run would have failed at the plan key."""
    from pipeline.core.cache import plan_cache_key
    from pipeline.core.device import allocator_config

    def snapshot_refused():
        raise RuntimeError("cudaMallocAsync does not support memory_snapshot")  # as torch refuses it

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "backend:cudaMallocAsync",
                        raising=False)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot_refused)
    expected = "cudaMallocAsync; settings backend:cudaMallocAsync; expandable segments not used by cudaMallocAsync"
    assert allocator_config() == expected
    assert plan_cache_key(kind="test")[0]["allocator"] == expected


@pytest.mark.parametrize("rows, expected", [(4096, 4096), (65535, 65535), (65536, 65535), (10**6, 65535)])
def test_batch_rows_stop_at_cudas_grid_limit(rows, expected):
    batch, note = resolve_batch_setting(BatchSettings(max_batch_tokens=2**20, max_batch_rows=rows), "cuda")
    assert batch.max_batch_rows == expected
    assert ("rows capped at 65,535 (CUDA's grid limit" in note) == (rows > MAX_BATCH_ROWS)


def test_a_saved_recommendation_above_the_grid_limit_is_capped_too():
    saved = {"max-batch-rows": {"level": 100_000, "created": "2026-12-01", "path": "sweep.json"}}
    batch, note = resolve_batch_setting(BatchSettings(max_batch_tokens=2**20), "cuda", saved)
    assert batch.max_batch_rows == MAX_BATCH_ROWS and "recommended by the sweep" in note and "capped" in note


def test_the_batchers_batch_size_is_its_row_limit():
    from pipeline.online.config import BatcherConfig

    config = BatcherConfig.of(max_batch_size=100_000)
    batch, _ = resolve_batch_setting(config.batch, "cuda", fields=("max_batch_tokens",))
    assert config.max_batch_size == batch.max_batch_rows == 100_000 and batch.max_batch_tokens is not None


def test_the_exported_forward_bounds_rows_at_the_grid_limit(tiny_encoder_path):
    from jobs.embed import EmbedJob
    from pipeline.core.compiled_forward import export_call
    from pipeline.runtime.model import load_model

    loaded = load_model(ModelSettings(model=tiny_encoder_path, device="cpu", dtype="float32", compile="off",
                                      max_length=64), BatchSettings())
    assert isinstance(loaded.job, EmbedJob)
    _, _, dynamic_shapes = export_call(loaded.job, loaded.model, torch.device("cpu"))
    rows = {dims[0] for dims in dynamic_shapes.values() if dims and 0 in dims}
    assert {(dim.__name__, dim.min, dim.max) for dim in rows} == {("rows", 1, MAX_BATCH_ROWS)}


def test_cuda_fits_memory_on_batches_many_allocator_pages_large():
    """2 and 8 rows of ≤ 2,048 tokens sat below the CUDA allocator's 2 MiB pages: the fit measured
    page rounding. On CUDA the smaller fitting batch's hidden state now holds ≥ 32 MiB where the
    token caps allow; on the CPU ≥ 192 KiB, which for MiniLM is still 2 and 8 rows."""
    from pipeline.core.memory import fit_rows

    assert fit_rows("cpu", 64, 256, 384, 4, None) == (2, 8)  # MiniLM, float32: the CPU's floor at 2 rows
    assert fit_rows("cpu", 8, 32, 32, 4, 2048) == (192, 768)  # a 32-wide model: 192 KiB, past the token budget
    # MiniLM in bf16 at 256 tokens: 683 rows would put 32 MiB in the 64-token batch; 262,144 tokens cap it at 256
    assert fit_rows("cuda", 64, 256, 384, 2, None) == (256, 1024)
    assert 256 * 64 * 384 * 2 >= 6 * 2**21
    assert fit_rows("cuda", 64, 256, 384, 2, 32768) == (32, 128)  # never past the run's token budget
    assert fit_rows("cuda", 128, 512, 1024, 2, None) == (128, 512)  # BERT-large, fp16: exactly 32 MiB
    assert fit_rows("cuda", 64, 256, 384, 2, 1000) == (2, 8)  # never fewer than the CPU's grid


def test_a_cuda_compile_trial_runs_the_runs_own_batch_shapes():
    from pipeline.core.compile import CPU_TRIAL_SHAPES, trial_shapes

    assert trial_shapes("cpu", 2048, 512, 256) == CPU_TRIAL_SHAPES == ((64, 32), (16, 128))
    # MiniLM's CUDA default, 262,144 tokens and 4,096 rows: the rows cap the short batch, the budget the long one
    assert trial_shapes("cuda", 262144, 4096, 256) == ((4096, 32), (2048, 128))
    assert trial_shapes("cuda", 32768, 4096, 64) == ((1024, 32), (512, 64))  # never past the max length


def test_compile_auto_judges_a_trial_by_this_devices_own_compile_seconds(tmp_path, tiny_encoder_path, monkeypatch):
    """5M tokens at 50k eager tokens/s save 50 s at the best 2x: worth a trial against the CPU's
    30 s figure, not against the 1,000 s this device measured."""
    import pipeline.runtime.compile_decision
    from pipeline.core.cache import write_keyed
    from pipeline.runtime.compile_decision import device_compile_seconds, settle_compile
    from pipeline.runtime.model import load_model

    trials = []

    def trial(job, model, device, package, shapes):
        trials.append(shapes)
        raise RuntimeError("trial stopped here")

    monkeypatch.setattr(pipeline.runtime.compile_decision, "eager_tokens_per_s", lambda job, model, device, shapes: 50_000.0)
    monkeypatch.setattr(pipeline.runtime.compile_decision, "compile_trial", trial)
    config = RunConfig.of(input=(), output="", model=tiny_encoder_path, device="cpu", dtype="float32", compile="off",
                          max_length=64, plan_cache=str(tmp_path))
    loaded = load_model(config.model, config.batch, cache=config.cache)
    auto = config.with_settings(compile="auto")
    assert device_compile_seconds(tmp_path, loaded.choice.device_key)[0] == 30.0  # none measured yet: the CPU's figure
    _, choice = settle_compile(auto.model, auto.batch, auto.cache, loaded.choice, loaded.job, loaded.model, 5_000_000)
    assert choice.reason == "eager: the compile trial failed (RuntimeError: trial stopped here)"
    assert trials == [((64, 32), (16, 128))]
    _, path, key = device_compile_seconds(tmp_path, loaded.choice.device_key)
    write_keyed(path, key, {"compile_s": 1000.0})  # what this device measured for a cold compile
    _, choice = settle_compile(auto.model, auto.batch, auto.cache, loaded.choice, loaded.job, loaded.model, 5_000_000)
    assert choice.reason == "eager: 5,000,000 tokens are too few to try a compile (1000 s on this device)"
    assert len(trials) == 1


def test_a_cuda_peak_measurement_runs_no_full_garbage_collection(monkeypatch):
    """The allocator's peak stats are reset before each run, so a collection measures nothing;
    a full gc.collect() before every probe measurement cost ~15 s of a GPU lease."""
    import gc

    from pipeline.core.device import measure_peak_bytes

    collections, stats = [], {"allocated": 100, "reserved": 200, "peak_allocated": 100, "peak_reserved": 200}

    def run():
        stats.update(peak_allocated=160, peak_reserved=264)

    monkeypatch.setattr(gc, "collect", lambda *generation: collections.append(generation) or 0)
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: stats.update(peak_allocated=stats["allocated"],
                                                         peak_reserved=stats["reserved"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: stats["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: stats["reserved"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: stats["peak_allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: stats["peak_reserved"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 2000))
    assert measure_peak_bytes(run, torch.device("cuda", 0)) == 64  # reserved above reserved-before
    assert collections == []
