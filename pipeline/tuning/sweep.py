"""The sweep's measurements on the device: a sample of real rows, then one load test per
level of the varied setting. The analysis (CSV, recommendation, comparison, plot) is in
`tuning/levels.py`.

Each level runs the same code path as `lengthwise run` (pack → collate on the prefetch
thread → forward with out-of-memory back-off) in three phases: warm-up rows (not counted:
first kernels, allocator growth, caches), measured rows, and the drain (the clock stops when
the last batch's outputs are back on the host).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from pipeline.core.batch_setting import recommendation_key
from pipeline.core.buckets import padding_efficiency
from pipeline.core.device import is_out_of_memory, measure_peak_bytes, peak_rss_bytes, reset_peak_rss
from pipeline.core.errors import UsageError
from pipeline.core.findings import as_dicts
from pipeline.core.buckets import BatchLimits
from pipeline.core.clock import StageTimes
from pipeline.core.forward import DeviceFeeder, collate_batches, run_on_device
from pipeline.core.settings import SWEEP_VARIES, VARIED_SETTINGS, tokenize_workers_for
from pipeline.tuning.config import SweepConfig
from pipeline.core.tokenize import EncodedRows, rows_without_error
from pipeline.core.unpadded import runs_unpadded
from pipeline.offline.source import Shard, read_blocks
from pipeline.tuning.diagnosis import diagnose_sweep
from pipeline.tuning.levels import (
    LevelResult,
    Recommendation,
    length_distribution,
    percentiles_ms,
    recommend,
    sample_positions,
    save_recommendation,
)

BLOCK_ROWS = 8192


log = logging.getLogger(__name__)


def read_sample(shards: list[Shard], text_column: str, id_column: str, sample_rows: int, seed: int,
                storage_options: dict, with_ids: bool = False) -> list:
    """Texts of `sample_rows` rows drawn uniformly across all shards (positions chosen from
    the footers' row counts), in random order (`with_ids`: (id, text) pairs). Streams the shards;
    a broken shard is skipped with a warning."""
    readable = [shard for shard in shards if not shard.problem]
    for shard in shards:
        if shard.problem:
            log.info(f"sweep: skipping {shard.url}: {shard.problem}")
    starts = np.concatenate([[0], np.cumsum([shard.num_rows for shard in readable])])
    positions = sample_positions(int(starts[-1]), sample_rows, seed)
    if positions.size == 0:
        raise UsageError("the input has no rows to sample; check --input")
    order = np.argsort(positions)
    wanted = positions[order]  # ascending: taken while streaming
    texts: list = [None] * len(positions)
    taken = np.zeros(len(positions), dtype=bool)
    for block in read_blocks(readable, id_column, text_column, BLOCK_ROWS, storage_options):
        if block.failure is not None:
            log.info(f"sweep: skipping the rest of {readable[block.shard_index].url}: {block.failure}")
            continue
        first = starts[block.shard_index] + block.first_row
        low, high = np.searchsorted(wanted, [first, first + block.num_rows])
        if high > low:
            rows = pa.array(wanted[low:high] - first)
            picked = block.texts.take(rows).to_pylist()
            if with_ids:
                picked = list(zip(block.ids.take(rows).to_pylist(), picked))
            for slot, text in zip(order[low:high], picked):
                texts[slot] = text
            taken[order[low:high]] = True
    return [text for text, ok in zip(texts, taken) if ok]


@dataclass
class LevelSettings:
    """Everything a level's batches depend on; the sweep changes exactly one field."""

    max_batch_tokens: int | None
    max_batch_rows: int
    max_length: int
    prefetch_batches: int


def measure_level(job, model, device: torch.device, encoded: EncodedRows, warmup_rows: np.ndarray,
                  measured_rows: np.ndarray, settings: LevelSettings, level: int, pad_token_id: int) -> LevelResult:
    """Warm up, then load-test `measured_rows` of `encoded` under `settings` through the run's
    device loop; a level that runs out of memory comes back with status `oom` instead of raising."""
    feeder = DeviceFeeder(device)
    limits = BatchLimits(None)  # no memory plan: the level itself is what is measured, out of memory included
    stats = {"batch_s": [], "row_s": [], "real": 0, "padded": 0, "splits": 0, "failed": 0}

    def run_phase(rows: np.ndarray, record: bool) -> None:
        times = StageTimes()
        batches = collate_batches(encoded, rows, settings.max_batch_tokens, settings.max_batch_rows,
                                  settings.max_length, limits, pad_token_id, feeder, packed=runs_unpadded(model))
        forward_before = 0.0
        for batch, result in run_on_device(batches, job, model, device, feeder, limits, settings.prefetch_batches,
                                           times):
            finished = time.perf_counter()  # outputs are on the host: the batch is done
            if record:
                stats["batch_s"].append(times.forward - forward_before)
                stats["row_s"].append(np.full(len(batch.rows), finished - batch.entered))
                stats["real"] += batch.real_tokens
                stats["padded"] += batch.padded_tokens
                stats["splits"] += result.splits
                stats["failed"] += int(result.failed.sum())
            forward_before = times.forward

    timing = {}

    def measured_phase() -> None:
        started = time.perf_counter()
        run_phase(measured_rows, record=True)
        timing["total_s"] = time.perf_counter() - started

    out_of_memory = False
    try:
        if len(warmup_rows):
            run_phase(warmup_rows, record=False)
        reset_peak_rss()
        peak_device = measure_peak_bytes(measured_phase, device)
    except Exception as error:  # noqa: BLE001 - only out-of-memory is recorded; anything else is raised
        if not is_out_of_memory(error):
            raise
        out_of_memory, peak_device = True, 0.0
    total_s = timing.get("total_s", 0.0)
    batch_ms = percentiles_ms(stats["batch_s"])
    row_ms = percentiles_ms(np.concatenate(stats["row_s"]) if stats["row_s"] else [])
    rows = len(measured_rows)
    return LevelResult(
        level=level, status="oom" if out_of_memory or stats["splits"] or stats["failed"] else "ok",
        rows=rows, total_s=round(total_s, 4), rows_per_s=round(rows / total_s, 3) if total_s else 0.0,
        tokens_per_s=round(stats["real"] / total_s, 1) if total_s else 0.0,
        padding_efficiency=round(padding_efficiency(stats["real"], stats["padded"]), 4),
        batch_latency_ms_avg=round(batch_ms["avg"], 2), batch_latency_ms_p50=round(batch_ms["p50"], 2),
        batch_latency_ms_p95=round(batch_ms["p95"], 2), batch_latency_ms_p99=round(batch_ms["p99"], 2),
        batch_latency_ms_max=round(batch_ms["max"], 2), row_latency_ms_p50=round(row_ms["p50"], 2),
        row_latency_ms_p95=round(row_ms["p95"], 2), row_latency_ms_p99=round(row_ms["p99"], 2),
        row_latency_ms_max=round(row_ms["max"], 2), peak_device_bytes=int(peak_device),
        peak_rss_bytes=peak_rss_bytes(), batches=len(stats["batch_s"]), oom_splits=stats["splits"])


@dataclass
class SweepReport:
    levels: list[LevelResult]
    recommendation: Recommendation
    settings: dict  # the fixed settings and the sample, as written to <out>.json
    saved_to: str | None  # where `run … auto` finds the recommendation
    not_saved: str | None = None  # why a recommendation was not saved, when it was not for a reason


def why_not_saved(findings: list[dict], vary: str) -> str | None:
    """Why a sweep's recommendation must not steer later runs (None: it may): a sample too thin
    to fill the larger batches measures them with more padding than a run has."""
    if any(finding["code"] == "sweep-sample-too-thin" for finding in findings):
        return (f"not saved for `lengthwise run --{vary} auto`: the sample is too thin to steer later runs "
                "(sweep-sample-too-thin); rerun with more --rows to save one")
    return None


def run_sweep(config: SweepConfig) -> SweepReport:
    """Sample, tokenize once, load the model once, then one load test per level, smallest
    first; the first level that runs out of memory ends the sweep upward."""
    import datetime

    from pipeline.core.cache import model_memory_fingerprint
    from pipeline.core.device import available_memory_bytes, device_name, dtype_name
    from pipeline.runtime import open_runtime
    from pipeline.core.tokenize import TokenizerPool

    if config.vary not in SWEEP_VARIES:
        raise UsageError(f"--vary {config.vary!r} is not one of {', '.join(SWEEP_VARIES)}")
    if not config.values or min(config.values) < 1:
        raise UsageError("--values must be positive integers, e.g. 1024,2048,4096")
    # the tokenizer, the model and the host memory setting, as `run` has them; rows: the device's default unless
    # given (a token budget of None is none: the sweep's levels set it); no memory plan: each level is measured
    # and --dtype auto's trial on the input's rows, as the run's: the recommendation is kept for the run's dtype
    source = config.source
    runtime = open_runtime(config)
    shards = runtime.input.shards
    loaded = runtime.loaded
    job, model, spec = loaded.job, loaded.model, loaded.tokenizer
    model_path, device, dtype, max_length = (loaded.choice.path, loaded.choice.device, loaded.choice.dtype,
                                             loaded.choice.max_length)
    texts = read_sample(shards, source.text_column, source.id_column, config.warmup_rows + config.rows, config.seed,
                        source.storage_options)
    with TokenizerPool(spec, tokenize_workers_for(config.tokenize_workers, device.type)) as pool:
        encoded = pool.result(pool.submit(texts))
    usable = np.flatnonzero(rows_without_error(encoded.errors))
    if len(usable) < len(texts):
        log.info(f"sweep: {len(texts) - len(usable)} sampled rows have no usable text (null, empty, not a string); "
            "they are left out")
    if len(usable) < 2:
        raise UsageError(f"only {len(usable)} usable rows in the sample; the sweep needs more input rows")
    warmup_count = min(config.warmup_rows, len(usable) // 2)
    warmup_rows, measured_rows = usable[:warmup_count], usable[warmup_count:warmup_count + config.rows]
    if len(measured_rows) < config.rows:
        log.info(f"sweep: the input has only {len(measured_rows)} usable rows to measure after {warmup_count} warm-up rows "
            f"(--sample-rows {config.rows})")
    lengths = length_distribution(encoded.lengths[measured_rows])
    truncated = float(encoded.truncated[measured_rows].mean())
    log.info(f"sample: {lengths['rows']:,} rows from {sum(not s.problem for s in shards)} shard(s), token length median "
        f"{lengths['median']:.0f}, p90 {lengths['p90']:.0f}, p99 {lengths['p99']:.0f}, max {lengths['max']} "
        f"({truncated:.1%} truncated at {max_length})")
    budget = available_memory_bytes(device, config.batch.memory_budget, config.batch.memory_reserve)
    batch = runtime.batch
    fixed = LevelSettings(batch.max_batch_tokens, batch.max_batch_rows, max_length, config.prefetch_batches)
    settings = {
        "vary": config.vary, "values": sorted(config.values), "job": config.model.job, "model": model_path,
        "device": device_name(device), "dtype": dtype_name(dtype), "compile": loaded.compile.reason,
        "max_length": max_length, "long_text": "split" if spec.segment_length else "truncate",
        **({"segment_length": spec.segment_length} if spec.segment_length else {}),
        "max_batch_tokens": None if config.vary == "max-batch-tokens" else batch.max_batch_tokens,
        "max_batch_rows": None if config.vary == "max-batch-rows" else batch.max_batch_rows,
        "prefetch_batches": config.prefetch_batches, "torch_threads": torch.get_num_threads(),
        "memory_budget_bytes": budget, "memory_headroom": config.memory_headroom, "max_p99_ms": config.max_p99_ms,
        "rows": len(measured_rows), "warmup_rows": warmup_count, "seed": config.seed,
        "input": list(source.input), "sample_token_lengths": lengths, "sample_truncated_share": round(truncated, 4),
    }
    levels: list[LevelResult] = []
    scored = encoded.with_segments()  # --long-text split: the segments run, as in the run
    scored_warmup, scored_measured = encoded.scored_positions(warmup_rows), encoded.scored_positions(measured_rows)
    for value in sorted(set(config.values)):
        level_settings = LevelSettings(**{**fixed.__dict__, VARIED_SETTINGS[config.vary]: value})
        result = measure_level(job, model, device, scored, scored_warmup, scored_measured, level_settings, value,
                               spec.pad_token_id)
        levels.append(result)
        log.info(f"{config.vary} {value}: {result.rows_per_s:,.1f} rows/s, {result.tokens_per_s:,.0f} tokens/s, "
            f"row p99 {result.row_latency_ms_p99:,.0f} ms, peak {result.peak_device_bytes / 2**20:,.0f} MiB, "
            f"{result.batches} batches" + ("" if result.status == "ok" else " — OUT OF MEMORY, stopping here"))
        if result.status != "ok":
            break
    recommendation = recommend(levels, config.vary, budget, config.memory_headroom, config.max_p99_ms)
    settings["recommendation"] = recommendation.to_dict()
    settings["diagnosis"] = as_dicts(diagnose_sweep(levels, recommendation, settings))
    saved_to, not_saved = None, why_not_saved(settings["diagnosis"], config.vary)
    if config.save_recommendation and recommendation.level is not None and not_saved is None:
        key, name = recommendation_key(model_memory_fingerprint(model_path), config.model.job, device_name(device),
                                       dtype_name(dtype), max_length, spec.segment_length or None, config.vary)
        created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        saved_to = save_recommendation(config.cache.plan_cache, name, key, recommendation,
                                       config.out, created)
    return SweepReport(levels, recommendation, settings, saved_to, not_saved)


