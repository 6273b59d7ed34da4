"""`lengthwise plan --estimate`: will the job fit in its window? Rows from the footers, token
lengths from a sample of rows tokenized here, and the throughput measured for this model,
device and dtype (the saved sweep recommendation's tokens/s, else a short measurement on the
sample with the real model) give the device seconds, the wall seconds, and how many workers
(`--num-shards`) a window needs. The arithmetic is pure; `estimate_run` gathers its inputs.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np

from pipeline.core.errors import UsageError
from pipeline.core.settings import tokenize_workers_for
from pipeline.offline.config import RunConfig

EXPECTED_DEVICE_BUSY = 0.9  # share of a run's wall after setup that the device computes (reading, tokenizing
# and writing overlap it; a run's summary prints the measured share as `device busy`)
MEASURED_ROWS = 256  # rows of the sample run through the model when no sweep figure is saved
WARMUP_ROWS = 32


def device_seconds(tokens: int, tokens_per_s: float) -> float:
    """Seconds the device needs for `tokens` real tokens at the measured rate."""
    if tokens_per_s <= 0:
        raise ValueError(f"tokens_per_s must be positive, got {tokens_per_s}")
    return tokens / tokens_per_s


def wall_seconds(device_s: float, setup_s: float, workers: int = 1, busy: float = EXPECTED_DEVICE_BUSY) -> float:
    """Wall seconds of `workers` equal workers: each loads the model (setup) and does its share."""
    return setup_s + device_s / busy / workers


def workers_for_window(device_s: float, setup_s: float, window_s: float,
                       busy: float = EXPECTED_DEVICE_BUSY) -> int | None:
    """The fewest workers whose wall fits `window_s`; None when setup alone does not fit."""
    if window_s <= setup_s:
        return None
    return max(1, math.ceil(device_s / busy / (window_s - setup_s)))


def scored_tokens_per_row(lengths: np.ndarray, segment_rows: np.ndarray | None = None,
                          segment_lengths: np.ndarray | None = None) -> np.ndarray:
    """The tokens each row sends to the device: its own, or for a row --long-text split cut into
    segments (`segment_rows`: the row of each segment), its segments' together, as the run scores them."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if segment_rows is None or not len(segment_rows):
        return lengths
    split = np.bincount(segment_rows, weights=segment_lengths, minlength=len(lengths)).astype(np.int64)
    return np.where(np.bincount(segment_rows, minlength=len(lengths)) > 0, split, lengths)


def mean_tokens_per_row(lengths: np.ndarray) -> float:
    """Mean real tokens a row sends to the device (rows that error send none)."""
    return float(np.mean(lengths)) if len(lengths) else 0.0


@dataclass
class Estimate:
    rows: int
    shards: int
    sample_rows: int
    mean_tokens_per_row: float
    tokens: int  # predicted real tokens of the whole input (after truncation)
    tokens_per_s: float
    basis: str  # where tokens_per_s comes from
    device_seconds: float
    setup_seconds: float  # model load, measured here
    predicted_seconds: float  # wall of one worker
    window_seconds: float | None = None
    workers: int | None = None  # --num-shards that fits the window (None: no window, or it cannot fit)
    note: str = ""
    computed_rows: int | None = None  # --reuse: rows predicted to go to the device (the others are reused)
    reused_share: float | None = None  # --reuse: share of the sampled rows found in the previous output
    memory_plan: str = ""  # where the run's memory plan comes from (probed here and cached, or the cache)

    def to_dict(self) -> dict:
        return {key: round(value, 2) if isinstance(value, float) else value for key, value in asdict(self).items()}

    def to_text(self) -> str:
        lines = [f"rows            {self.rows:,} in {self.shards} shard(s) (from the footers)"]
        if self.reused_share is not None:
            lines.append(f"reuse           {self.reused_share:.1%} of the sampled rows are in the --reuse output: "
                         f"{self.computed_rows:,} rows to compute")
        lines += [f"tokens          {self.tokens:,} predicted ({self.mean_tokens_per_row:,.1f} a row in a sample of "
                 f"{self.sample_rows:,})",
                 f"throughput      {self.tokens_per_s:,.0f} tokens/s ({self.basis})",
                 f"device          {self.device_seconds:,.0f}s; setup {self.setup_seconds:,.1f}s",
                 f"predicted wall  {self.predicted_seconds:,.0f}s ({self.predicted_seconds / 3600:.2f}h) on one worker"]
        if self.memory_plan:
            lines.append(f"memory plan     {self.memory_plan}")
        if self.window_seconds is not None:
            fits = (f"{self.workers} worker(s): --num-shards {self.workers}" if self.workers
                    else "no number of workers (setup alone is longer)")
            lines.append(f"window          {self.window_seconds / 3600:.2f}h needs {fits}")
        if self.note:
            lines.append(f"note            {self.note}")
        return "\n".join(lines)


def summarize_estimate(rows: int, shards: int, lengths: np.ndarray, tokens_per_s: float, basis: str, setup_s: float,
                       window_s: float | None, reused: np.ndarray | None = None) -> Estimate:
    """The estimate from its measured inputs (pure); `reused` (--reuse): which sampled rows the previous
    output has, so they cost no device time."""
    mean = mean_tokens_per_row(lengths)
    computed_share = 1.0 if reused is None or not len(reused) else 1.0 - float(np.mean(reused))
    tokens = int(round(mean_tokens_per_row(np.where(reused, 0, lengths)) * rows if reused is not None and len(reused)
                       else mean * rows))
    device_s = device_seconds(tokens, tokens_per_s)
    estimate = Estimate(rows, shards, len(lengths), mean, tokens, tokens_per_s, basis, device_s, setup_s,
                        wall_seconds(device_s, setup_s), window_s)
    if reused is not None:
        estimate.reused_share = 1.0 - computed_share
        estimate.computed_rows = int(round(rows * computed_share))
    if window_s is not None:
        estimate.workers = workers_for_window(device_s, setup_s, window_s)
        if estimate.workers is not None and estimate.workers > shards:
            estimate.note = (f"{estimate.workers} workers but only {shards} shard(s): a worker takes whole shards, "
                             "so split the input into more files")
    return estimate


def estimate_run(config: RunConfig, sample_rows: int, window_s: float | None) -> Estimate:
    """Read the footers, tokenize a sample, find the throughput (saved sweep, else measured
    here on the sample), and predict."""
    from pipeline.core.clock import SetupClock
    from pipeline.core.tokenize import TokenizerPool
    from pipeline.runtime import open_runtime
    from pipeline.offline.workload import InputSample
    from pipeline.offline.source import list_source_shards
    from pipeline.tuning.sweep import LevelSettings, measure_level, read_sample

    source = config.source
    shards = list_source_shards(source)
    rows = sum(shard.num_rows for shard in shards if not shard.problem)
    # the model, batch setting and memory plan the run will take (the plan probed here once and cached, so the run
    # does not probe); --dtype auto's trial on the input's rows, as the run's: the throughput depends on the dtype
    started, clock = time.perf_counter(), SetupClock()
    runtime = open_runtime(config, InputSample(shards, source), clock=clock)
    loaded, plan = runtime.loaded, runtime.plan
    setup_s = time.perf_counter() - started - clock.steps.get("batch plan", 0.0)  # a cached plan costs the run nothing
    sample = read_sample(shards, source.text_column, source.id_column, sample_rows, 0, source.storage_options,
                         with_ids=True)
    texts = [text for _, text in sample]
    reused, reuse_s = sampled_rows_reused(config, sample) if config.reuse else (None, 0.0)
    with TokenizerPool(loaded.tokenizer, tokenize_workers_for(config.tokenize_workers,
                                                              loaded.choice.device.type)) as pool:
        encoded = pool.result(pool.submit(texts))
    valid = np.array([error is None for error in encoded.errors], dtype=bool)
    segments = encoded.segments
    lengths = np.where(valid, scored_tokens_per_row(encoded.lengths, *((segments.row, segments.lengths)
                                                                      if segments is not None else ())), 0)
    reference = runtime.sweep_reference
    if reference:
        tokens_per_s = reference["tokens_per_s"]
        basis = (f"the saved sweep of {reference['created']}: --{reference['vary']} {reference['level']} "
                 f"({reference['path']})")
    else:
        usable = np.flatnonzero(valid)
        if len(usable) < 2:
            raise UsageError("the sample has no usable text to measure the throughput on; check --text-column")
        warmup = usable[:min(WARMUP_ROWS, len(usable) // 2)]
        measured = usable[len(warmup):len(warmup) + MEASURED_ROWS]
        batch = runtime.batch
        level = LevelSettings(batch.max_batch_tokens, batch.max_batch_rows, runtime.max_length, config.prefetch_batches)
        result = measure_level(loaded.job, loaded.model, loaded.choice.device, encoded.with_segments(),
                               encoded.scored_positions(warmup), encoded.scored_positions(measured), level, 0,
                               loaded.tokenizer.pad_token_id)
        tokens_per_s = result.tokens_per_s
        basis = (f"measured here on {len(measured)} sampled rows at --max-batch-tokens {batch.max_batch_tokens}, "
                 f"--max-batch-rows {batch.max_batch_rows}; `lengthwise sweep` saves a figure")
    device = f"{loaded.choice.device}, {loaded.choice.dtype}".replace("torch.", "")
    estimate = summarize_estimate(rows, len(shards), lengths, tokens_per_s, f"{basis}; {device}", setup_s + reuse_s,
                                  window_s, reused)
    estimate.memory_plan = plan.source if plan is not None else "none (--no-probe)"
    return estimate


def sampled_rows_reused(config: RunConfig, sample: list) -> tuple[np.ndarray, float]:
    """Which sampled (id, text) rows the --reuse output has (the run's own index and match), and the seconds
    building the index took (the run spends them too)."""
    import pyarrow as pa

    from pipeline.offline.reuse import PreviousOutput, hash_rows

    started = time.perf_counter()
    previous = PreviousOutput(config.reuse, config.source.storage_options, config.keep_columns)
    try:
        build_s = time.perf_counter() - started
        hashes = hash_rows(pa.array([i for i, _ in sample]), pa.array([t for _, t in sample]))
        has_text = hashes.text_hashes.is_valid().to_numpy(zero_copy_only=False)
        matches = previous.index.match(hashes.id_hashes, hashes.text_hashes.fill_null(0).to_numpy(), has_text)
        return matches.reused, build_s
    finally:
        previous.close()
