"""The online load test: real texts sent to the DynamicBatcher at a Poisson rate, one batcher
setting stepped over its levels. (`tuning/sweep.py` measures the offline sweep.)

Per level, a fresh batcher on the one loaded model: warm-up arrivals (not counted), then
`duration_s` of measured arrivals, then the drain (every measured request answered,
rejected or timed out) before the tail latencies are computed. The generator is open-loop:
arrival times are drawn in advance and do not wait for answers; at most `concurrency`
requests are in flight, and an arrival that finds them all busy waits for a slot, its
latency counted from its scheduled time, so a slow server cannot hide its queue (no
coordinated omission). The CSV, recommendation, comparison and plot are the offline
sweep's (`tuning/levels.py`), read through `ONLINE_MEASURES`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np

from pipeline.core.errors import UsageError
from pipeline.core.findings import as_dicts
from pipeline.core.settings import LOADTEST_VARIES
from pipeline.tuning.config import OnlineLoadtestConfig
from pipeline.online.batcher import DynamicBatcher
from pipeline.online.rules import QueueFull, check_timeouts
from pipeline.tuning.diagnosis import diagnose_loadtest, falls_behind
from pipeline.tuning.levels import Measures, Recommendation, percentiles_ms, recommend

log = logging.getLogger(__name__)


@dataclass
class OnlineLevelResult:
    """One CSV row: one level's measured requests (warm-up excluded) and the settings to replay it."""

    CSV_KIND: ClassVar[str] = "online load test"

    level: int  # the varied setting's value
    status: str  # ok | overloaded (requests rejected or timed out) | oom (a batch ran out of memory)
    max_batch_size: int
    batch_timeout_ms: float
    max_batch_tokens: int
    qps_target: float
    concurrency: int
    requests: int  # measured arrivals
    qps_offered: float  # measured arrivals per second of duration (Poisson: near qps_target)
    total_s: float  # first measured arrival to the last answer (the drain included)
    latency_ms_avg: float  # answered requests, scheduled arrival to answer
    latency_ms_p50: float
    latency_ms_p95: float
    latency_ms_p99: float
    latency_ms_max: float
    qps_achieved: float  # the rate answers came at, first to last (see PhaseOutcome.answers_per_s)
    rejected: int  # QueueFull or too large
    timed_out: int
    mean_batch_size: float
    mean_batch_padded_tokens: float  # rows × padded length, per batch
    batches: int
    batches_by_size: int  # formed because max_batch_size requests waited
    batches_by_tokens: int  # because max_batch_tokens padded tokens waited
    batches_by_timeout: int  # because the oldest request had waited batch_timeout_ms
    oom_splits: int
    max_queue_depth: int
    queue_depth_at_end: int  # waiting when the last measured arrival came
    wait_ms_p50: float  # submit to the start of its batch on the device
    wait_ms_p99: float
    compute_ms_p50: float  # one batch on the device
    compute_ms_p99: float
    peak_memory_bytes: int  # memory the level added above the loaded model

    @classmethod
    def columns(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def problem(self) -> str:
        if self.status == "oom":
            return f"ran out of memory ({self.oom_splits} batch splits)"
        return (f"overloaded: {self.qps_achieved:.1f} of {self.qps_offered:.1f} requests/s served, "
                f"{self.rejected} rejected, {self.timed_out} timed out of {self.requests}")


# Every level that keeps up answers at the offered rate, so throughput rarely separates them: they
# tie within the noise of their request counts, and the smallest level wins (levels.recommend).
ONLINE_MEASURES = Measures("qps_achieved", "latency_ms_p99", "peak_memory_bytes", "requests/s", "p99 latency",
                           count="requests", target="qps_target")


def poisson_arrivals(qps: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival offsets in [0, duration_s): exponential gaps with mean 1/qps."""
    if qps <= 0 or duration_s <= 0:
        return np.zeros(0)
    expected = qps * duration_s
    gaps = rng.exponential(1.0 / qps, size=int(expected + 6 * math.sqrt(expected) + 10))
    offsets = np.cumsum(gaps) - gaps[0]  # the first request at the start
    return offsets[offsets < duration_s]


def level_status(rejected: int, timed_out: int, oom_splits: int, qps_achieved: float, qps_offered: float) -> str:
    """oom when a batch ran out of memory; overloaded when requests were rejected or timed out
    or the answers fell behind the arrivals (the client's concurrency cap then holds them back)."""
    if oom_splits:
        return "oom"
    return "overloaded" if rejected or timed_out or falls_behind(qps_achieved, qps_offered) else "ok"


LOADTEST_COLUMNS = (("requests", "{0.requests:,}"), ("req/s achieved", "{0.qps_achieved:,.1f}"),
                    ("p50 ms", "{0.latency_ms_p50:,.1f}"), ("p95 ms", "{0.latency_ms_p95:,.1f}"),
                    ("p99 ms", "{0.latency_ms_p99:,.1f}"), ("max ms", "{0.latency_ms_max:,.1f}"),
                    ("mean batch", "{0.mean_batch_size:.2f}"), ("rejected", "{0.rejected}"),
                    ("timed out", "{0.timed_out}"), ("peak memory", "peak_memory_bytes"))  # `levels.markdown_table`


@dataclass
class PhaseOutcome:
    latencies_s: list[float]
    answered_at: list[float]  # loop time of each answer
    rejected: int
    timed_out: int
    total_s: float
    queue_depth_at_end: int

    def answers_per_s(self) -> float:
        """The rate answers came at, first to last: the offered rate when the server keeps up,
        its capacity when it does not; unlike answers / total_s, not lowered by the drain's
        tail latency."""
        if len(self.answered_at) < 2:
            return 0.0
        span = max(self.answered_at) - min(self.answered_at)
        return (len(self.answered_at) - 1) / span if span > 0 else 0.0


async def send_arrivals(batcher: DynamicBatcher, texts: Sequence[str], arrivals: np.ndarray,
                        concurrency: int) -> PhaseOutcome:
    """Submit texts[i % len(texts)] at each arrival offset; wait for every answer (the drain)."""
    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    answered_at: list[float] = []
    counts = {"rejected": 0, "timed_out": 0}
    start = loop.time()

    async def one(text: str, scheduled: float) -> None:
        try:
            await batcher.submit(text)
            answered_at.append(loop.time())
            latencies.append(answered_at[-1] - scheduled)
        except (QueueFull, ValueError):  # ValueError: RequestTooLarge
            counts["rejected"] += 1
        except TimeoutError:
            counts["timed_out"] += 1
        finally:
            slots.release()

    tasks = []
    for index, offset in enumerate(arrivals):
        scheduled = start + float(offset)
        delay = scheduled - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        await slots.acquire()
        tasks.append(asyncio.create_task(one(texts[index % len(texts)], scheduled)))
    depth = batcher.stats.queue_depth
    await asyncio.gather(*tasks)
    return PhaseOutcome(latencies, answered_at, counts["rejected"], counts["timed_out"], loop.time() - start, depth)


def warm_up_process(runtime, batcher_config, texts: Sequence[str], config: OnlineLoadtestConfig) -> None:
    """One warm-up phase before the first level, outside its memory measurement: the process's
    one-off costs (thread pools, kernel caches, allocator growth) must not count as that level's
    peak memory or slow its first requests."""
    arrivals = poisson_arrivals(config.qps, config.warmup_s, np.random.default_rng(config.seed))

    async def warm_up() -> None:
        async with DynamicBatcher(fresh_limits(runtime), batcher_config) as batcher:
            await send_arrivals(batcher, list(texts), arrivals, config.concurrency)

    asyncio.run(warm_up())


def fresh_limits(runtime):
    """`runtime` with its memory plan's limits as planned: each level starts from the plan, not from what an
    out-of-memory split of an earlier level lowered."""
    from pipeline.core.buckets import BatchLimits

    return dataclasses.replace(runtime, limits=BatchLimits(runtime.plan))


def measure_online_level(runtime, batcher_config, texts: Sequence[str], config: OnlineLoadtestConfig,
                         level: int) -> OnlineLevelResult:
    """Warm-up, measured arrivals and drain for one batcher setting, in a fresh event loop;
    the peak memory is what the whole level added. Every level gets the same arrival times
    and texts (drawn from `config.seed`): only the setting differs."""
    from pipeline.core.device import measure_peak_bytes

    rng = np.random.default_rng(config.seed)
    warmup = poisson_arrivals(config.qps, config.warmup_s, rng)
    measured = poisson_arrivals(config.qps, config.duration_s, rng)
    order = rng.permutation(len(texts))
    shuffled = [texts[i] for i in order]
    found = {}

    async def run_level() -> None:
        async with DynamicBatcher(fresh_limits(runtime), batcher_config) as batcher:
            await send_arrivals(batcher, shuffled, warmup, config.concurrency)
            batcher.stats.reset()
            found["outcome"] = await send_arrivals(batcher, shuffled[len(warmup):] + shuffled[:len(warmup)],
                                                   measured, config.concurrency)
            found["stats"] = batcher.stats

    peak = measure_peak_bytes(lambda: asyncio.run(run_level()), runtime.loaded.choice.device)
    outcome, stats = found["outcome"], found["stats"]
    latency = percentiles_ms(outcome.latencies_s)
    wait = percentiles_ms(list(stats.wait_s))
    compute = percentiles_ms(list(stats.compute_s))
    rejected = outcome.rejected
    qps_offered = round(len(measured) / config.duration_s, 2)
    qps_achieved = round(outcome.answers_per_s(), 2)
    return OnlineLevelResult(
        level=level, status=level_status(rejected, outcome.timed_out, stats.oom_splits, qps_achieved, qps_offered),
        max_batch_size=batcher_config.max_batch_size, batch_timeout_ms=batcher_config.batch_timeout_ms,
        max_batch_tokens=batcher_config.batch.max_batch_tokens, qps_target=config.qps,
        concurrency=config.concurrency, requests=len(measured), qps_offered=qps_offered,
        total_s=round(outcome.total_s, 3),
        latency_ms_avg=round(latency["avg"], 2), latency_ms_p50=round(latency["p50"], 2),
        latency_ms_p95=round(latency["p95"], 2), latency_ms_p99=round(latency["p99"], 2),
        latency_ms_max=round(latency["max"], 2),
        qps_achieved=qps_achieved,
        rejected=rejected, timed_out=outcome.timed_out, mean_batch_size=round(stats.mean_batch_size, 3),
        mean_batch_padded_tokens=round(float(np.mean(stats.batch_padded_tokens)), 1) if stats.batches else 0.0,
        batches=stats.batches, batches_by_size=stats.triggers["size"], batches_by_tokens=stats.triggers["tokens"],
        batches_by_timeout=stats.triggers["timeout"], oom_splits=stats.oom_splits,
        max_queue_depth=stats.max_queue_depth,
        queue_depth_at_end=outcome.queue_depth_at_end, wait_ms_p50=round(wait["p50"], 2),
        wait_ms_p99=round(wait["p99"], 2), compute_ms_p50=round(compute["p50"], 2),
        compute_ms_p99=round(compute["p99"], 2), peak_memory_bytes=int(peak))


@dataclass
class OnlineLoadtestReport:
    levels: list[OnlineLevelResult]
    diagnosis: list[dict]  # pipeline.tuning.diagnosis findings, level by level
    recommendation: Recommendation
    settings: dict  # the fixed settings and the sample, as written to <out>.json


def level_configs(config: OnlineLoadtestConfig) -> list:
    """The batcher setting of each level, smallest first; bad combinations refused up front."""
    if config.vary not in LOADTEST_VARIES:
        raise UsageError(f"--vary {config.vary!r} is not one of {', '.join(LOADTEST_VARIES)}")
    if not config.values or min(config.values) < 1:
        raise UsageError("--values must be positive integers, e.g. 1,2,4,8,16,32,64")
    settings = list(zip(sorted(set(config.values)), config.levels()))
    for value, level in settings:
        try:
            check_timeouts(level.batch_timeout_ms, level.request_timeout_ms)
        except ValueError as error:
            raise UsageError(f"{config.vary} {value}: {error}") from None
    return settings


def run_online_loadtest(config: OnlineLoadtestConfig) -> OnlineLoadtestReport:
    """Sample texts, load the model and its memory plan once, then one level per value."""
    import torch

    from pipeline.core.device import available_memory_bytes, device_name, dtype_name
    from pipeline.core.tokenize import TokenizerPool
    from pipeline.runtime import open_runtime
    from pipeline.offline.source import list_source_shards
    from pipeline.tuning.levels import length_distribution
    from pipeline.tuning.sweep import read_sample

    fixed, levels_asked = config.batcher, level_configs(config)
    # one plan for every level: made for the largest batches they may form
    runtime = open_runtime(config)
    loaded, plan = runtime.loaded, runtime.plan
    levels_to_run = [(value, dataclasses.replace(level, batch=runtime.resolve(level.batch)[0]))
                     for value, level in levels_asked]
    source = config.source
    texts = [t for t in read_sample(list_source_shards(source), source.text_column, source.id_column,
                                    config.sample_rows, config.seed, source.storage_options)
             if isinstance(t, str) and t.strip()]
    if len(texts) < 2:
        raise UsageError(f"only {len(texts)} usable texts in the input; the load test needs more")
    with TokenizerPool(loaded.tokenizer, 0) as pool:
        encoded = pool.result(pool.submit(texts))
    lengths = length_distribution(encoded.lengths[encoded.lengths > 0])
    device = loaded.choice.device
    budget = available_memory_bytes(device, fixed.batch.memory_budget, fixed.batch.memory_reserve)
    settings = {
        "vary": config.vary, "values": [value for value, _ in levels_to_run], "job": fixed.model.job,
        "model": loaded.choice.path, "device": device_name(device), "dtype": dtype_name(loaded.choice.dtype),
        "compile": loaded.compile.reason,
        "max_length": runtime.max_length, "qps": config.qps, "concurrency": config.concurrency,
        "duration_s": config.duration_s, "warmup_s": config.warmup_s,
        "max_batch_size": None if config.vary == "max-batch-size" else fixed.max_batch_size,
        "batch_timeout_ms": None if config.vary == "batch-timeout-ms" else fixed.batch_timeout_ms,
        "max_batch_tokens": None if config.vary == "max-batch-tokens" else runtime.batch.max_batch_tokens,
        "request_timeout_ms": fixed.request_timeout_ms, "max_queue": fixed.max_queue,
        "max_queue_tokens": fixed.max_queue_tokens, "memory_plan": plan is not None,
        "torch_threads": torch.get_num_threads(), "memory_budget_bytes": budget,
        "memory_headroom": config.memory_headroom, "max_p99_ms": config.max_p99_ms, "seed": config.seed,
        "input": list(config.source.input), "sample_texts": len(texts), "sample_token_lengths": lengths,
    }
    log.info(f"sample: {len(texts):,} texts, token length median {lengths['median']:.0f}, p90 {lengths['p90']:.0f}, "
             f"p99 {lengths['p99']:.0f}, max {lengths['max']}")
    levels = []
    warm_up_process(runtime, levels_to_run[0][1], texts, config)
    for value, level_config in levels_to_run:
        result = measure_online_level(runtime, level_config, texts, config, value)
        levels.append(result)
        log.info(f"{config.vary} {value}: {result.qps_achieved:,.1f} of {config.qps:g} requests/s, p50 "
                 f"{result.latency_ms_p50:,.1f} ms, p99 {result.latency_ms_p99:,.1f} ms, mean batch "
                 f"{result.mean_batch_size:.2f}, {result.rejected} rejected, {result.timed_out} timed out")
    recommendation = recommend(levels, config.vary, budget, config.memory_headroom, config.max_p99_ms,
                               measures=ONLINE_MEASURES)
    settings["recommendation"] = recommendation.to_dict()
    settings["diagnosis"] = [finding for level in levels  # a line per level: each finding names its level
                             for finding in as_dicts(diagnose_loadtest([dataclasses.asdict(level)]))]
    return OnlineLoadtestReport(levels, settings["diagnosis"], recommendation, settings)
