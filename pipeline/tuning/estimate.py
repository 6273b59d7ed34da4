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


def wall_seconds(device_s: float, setup_s: float, workers: int = 1, busy: float = EXPECTED_DEVICE_BUSY,
                 host_s: float = 0.0, shared_cores: bool = False) -> float:
    """Wall seconds of `workers` equal workers: each loads the model (setup) and does its share of the work."""
    return setup_s + work_seconds(device_s, busy, host_s, shared_cores) / workers


def work_seconds(device_s: float, busy: float, host_s: float, shared_cores: bool) -> float:
    """One worker's seconds past setup for `device_s` of forwards and `host_s` of tokenizing: the device at its
    busy share, and no less than what the host needs: on a GPU the host tokenizes while the device computes, so
    a small model on a large GPU waits on the host; on a CPU the two share the cores, so they add up."""
    return max(device_s / busy, device_s + host_s if shared_cores else host_s)


def workers_for_window(device_s: float, setup_s: float, window_s: float, busy: float = EXPECTED_DEVICE_BUSY,
                       host_s: float = 0.0, shared_cores: bool = False) -> int | None:
    """The fewest workers whose wall fits `window_s`; None when setup alone does not fit."""
    if window_s <= setup_s:
        return None
    return max(1, math.ceil(work_seconds(device_s, busy, host_s, shared_cores) / (window_s - setup_s)))


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
    host_seconds: float = 0.0  # the run's tokenizer pool on the rows to compute, timed on the sample
    shared_cores: bool = False  # the forward runs on the CPU cores that tokenize (work_seconds)

    def to_dict(self) -> dict:
        return {key: round(value, 2) if isinstance(value, float) else value for key, value in asdict(self).items()}

    def fit_window(self) -> None:
        """The workers (`--num-shards`) that fit `window_seconds`, from this estimate's own figures, and a
        note where they outnumber the shards."""
        if self.window_seconds is None:
            return
        self.workers = workers_for_window(self.device_seconds, self.setup_seconds, self.window_seconds,
                                          host_s=self.host_seconds, shared_cores=self.shared_cores)
        if self.workers is not None and self.workers > self.shards:
            self.note = (f"{self.workers} workers but only {self.shards} shard(s): a worker takes whole shards, "
                         "so split the input into more files")

    def to_text(self) -> str:
        lines = [f"rows            {self.rows:,} in {self.shards} shard(s) (from the footers)"]
        if self.reused_share is not None:
            lines.append(f"reuse           {self.reused_share:.1%} of the sampled rows are in the --reuse output: "
                         f"{self.computed_rows:,} rows to compute")
        lines += [f"tokens          {self.tokens:,} predicted ({self.mean_tokens_per_row:,.1f} a row in a sample of "
                 f"{self.sample_rows:,})",
                 f"throughput      {self.tokens_per_s:,.0f} tokens/s ({self.basis})",
                 f"device          {self.device_seconds:,.0f}s; setup {self.setup_seconds:,.1f}s; tokenize "
                 f"{self.host_seconds:,.0f}s (the pool on the sample, scaled)",
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
                       window_s: float | None, reused: np.ndarray | None = None,
                       sample_tokenize_s: float = 0.0, shared_cores: bool = False) -> Estimate:
    """The estimate from its measured inputs (pure); `reused` (--reuse): which sampled rows the previous
    output has, so they cost no device time and are not tokenized; `sample_tokenize_s`: the tokenizer pool's
    seconds on the sample; `shared_cores`: a CPU device (work_seconds)."""
    mean = mean_tokens_per_row(lengths)
    computed_share = 1.0 if reused is None or not len(reused) else 1.0 - float(np.mean(reused))
    tokens = int(round(mean_tokens_per_row(np.where(reused, 0, lengths)) * rows if reused is not None and len(reused)
                       else mean * rows))
    device_s = device_seconds(tokens, tokens_per_s)
    host_s = sample_tokenize_s / len(lengths) * rows * computed_share if len(lengths) else 0.0
    estimate = Estimate(rows, shards, len(lengths), mean, tokens, tokens_per_s, basis, device_s, setup_s,
                        wall_seconds(device_s, setup_s, host_s=host_s, shared_cores=shared_cores), window_s,
                        host_seconds=host_s, shared_cores=shared_cores)
    if reused is not None:
        estimate.reused_share = 1.0 - computed_share
        estimate.computed_rows = int(round(rows * computed_share))
    estimate.fit_window()
    return estimate


@dataclass
class SampleWork:
    """A sample of the input read and tokenized as the run will: what every model's estimate shares."""

    rows: int  # the input's, from the footers
    shards: int
    encoded: object  # the tokenizer pool's result (EncodedRows)
    valid: np.ndarray
    lengths: np.ndarray  # tokens each sampled row sends to the device (0: an error)
    tokenize_s: float  # the pool's seconds on the sample
    reused: np.ndarray | None  # --reuse: which sampled rows the previous output has
    reuse_s: float  # building the --reuse index


def tokenized_sample(config: RunConfig, shards: list, tokenizer, device_type: str, sample_rows: int) -> SampleWork:
    """Read `sample_rows` of the input and tokenize them on the run's pool (timed once its workers are up)."""
    from pipeline.core.tokenize import TokenizerPool, rows_without_error
    from pipeline.tuning.sweep import read_sample

    source = config.source
    sample = read_sample(shards, source.text_column, source.id_column, sample_rows, 0, source.storage_options,
                         with_ids=True)
    reused, reuse_s = sampled_rows_reused(config, sample) if config.reuse else (None, 0.0)
    with TokenizerPool(tokenizer, tokenize_workers_for(config.tokenize_workers, device_type)) as pool:
        started = time.perf_counter()
        encoded = pool.result(pool.submit([text for _, text in sample]))
        tokenize_s = time.perf_counter() - started
    valid = rows_without_error(encoded.errors)
    segments = encoded.segments
    lengths = np.where(valid, scored_tokens_per_row(encoded.lengths, *((segments.row, segments.lengths)
                                                                      if segments is not None else ())), 0)
    return SampleWork(sum(shard.num_rows for shard in shards if not shard.problem), len(shards), encoded, valid,
                      lengths, tokenize_s, reused, reuse_s)


def model_throughput(config: RunConfig, runtime, sample: SampleWork) -> tuple[float, str]:
    """Tokens/s of `runtime`'s model: its saved sweep figure, else measured here on the sample at the run's
    batch setting; and where it comes from."""
    from pipeline.tuning.sweep import LevelSettings, measure_level

    loaded, reference = runtime.loaded, runtime.sweep_reference
    if reference:
        basis = (f"the saved sweep of {reference['created']}: --{reference['vary']} {reference['level']} "
                 f"({reference['path']})")
        tokens_per_s = reference["tokens_per_s"]
    else:
        usable = np.flatnonzero(sample.valid)
        if len(usable) < 2:
            raise UsageError("the sample has no usable text to measure the throughput on; check --text-column")
        warmup = usable[:min(WARMUP_ROWS, len(usable) // 2)]
        measured = usable[len(warmup):len(warmup) + MEASURED_ROWS]
        batch, encoded = runtime.batch, sample.encoded
        level = LevelSettings(batch.max_batch_tokens, batch.max_batch_rows, runtime.max_length, config.prefetch_batches)
        result = measure_level(loaded.job, loaded.model, loaded.choice.device, encoded.with_segments(),
                               encoded.scored_positions(warmup), encoded.scored_positions(measured), level, 0,
                               loaded.tokenizer.pad_token_id)
        tokens_per_s = result.tokens_per_s
        basis = (f"measured here on {len(measured)} sampled rows at --max-batch-tokens {batch.max_batch_tokens}, "
                 f"--max-batch-rows {batch.max_batch_rows}; `lengthwise sweep` saves a figure")
    device = f"{loaded.choice.device}, {loaded.choice.dtype}".replace("torch.", "")
    return tokens_per_s, f"{basis}; {device}"


def model_estimate(config: RunConfig, runtime, setup_s: float, sample: SampleWork, window_s: float | None) -> Estimate:
    """One model's estimate as its own run would go: `setup_s`, its model's setup."""
    tokens_per_s, basis = model_throughput(config, runtime, sample)
    estimate = summarize_estimate(sample.rows, sample.shards, sample.lengths, tokens_per_s, basis,
                                  setup_s + sample.reuse_s, window_s, sample.reused, sample.tokenize_s,
                                  runtime.loaded.choice.device.type == "cpu")
    estimate.memory_plan = runtime.plan.source if runtime.plan is not None else "none (--no-probe)"
    return estimate


def estimate_run(config: RunConfig, sample_rows: int, window_s: float | None) -> Estimate | ModelSetEstimate:
    """Read the footers, tokenize a sample, find each model's throughput (saved sweep, else measured
    here on the sample), and predict; for several models, also one pass against separate runs."""
    from pipeline.core.clock import SetupClock
    from pipeline.runtime import open_runtime

    if config.models:
        return estimate_model_set(config, sample_rows, window_s)
    # the model, batch setting and memory plan the run will take (the plan probed here once and cached, so the run
    # does not probe); --dtype auto's trial on the input's rows, as the run's: the throughput depends on the dtype
    started, clock = time.perf_counter(), SetupClock()
    runtime = open_runtime(config, clock)
    # a cached plan costs the run nothing; the listing is the sample's
    setup_s = time.perf_counter() - started - clock.steps.get("batch plan", 0.0) - clock.steps.get("shards", 0.0)
    sample = tokenized_sample(config, runtime.input.shards, runtime.loaded.tokenizer,
                              runtime.loaded.choice.device.type, sample_rows)
    return model_estimate(config, runtime, setup_s, sample, window_s)


def estimate_model_set(config: RunConfig, sample_rows: int, window_s: float | None) -> ModelSetEstimate:
    """Each model opened as the run of several opens it (one tokenizer, each its own dtype, limits and plan),
    the sample tokenized once, each model's throughput measured on it; then one pass against separate runs."""
    from pipeline.offline.model_set_setup import open_models

    opened = open_models(config)
    runtime = opened.runtime
    sample = tokenized_sample(config, runtime.input.shards, runtime.loaded.tokenizer,
                              runtime.loaded.choice.device.type, sample_rows)
    estimates = {}
    for name, each in opened.runtimes.items():
        steps = opened.clocks[name].steps
        # its own run's setup: its choice and opening (a cached plan costs the run nothing)
        setup_s = opened.choice.seconds.get(name, 0.0) + sum(steps.values()) - steps.get("batch plan", 0.0)
        estimates[name] = model_estimate(opened.configs[name], each, setup_s, sample, window_s)
    return one_pass_estimate(estimates, window_s, sample.reuse_s, process_start_seconds())


def process_start_seconds() -> float:
    """Seconds a fresh process takes to start and import what a run imports before its setup (torch, the
    engine): what each separate run pays again, timed here in a child process."""
    import subprocess
    import sys

    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import pipeline.engines.local, pipeline.runtime"], check=True,
                   capture_output=True, timeout=300)
    return time.perf_counter() - started


@dataclass
class ModelSetEstimate:
    """Several models: each as its own run would go, and the one pass that reads and tokenizes once."""

    models: dict[str, Estimate]
    one_pass: Estimate  # setup and device seconds of every model, the host's once
    separate_seconds: float  # the models' own runs, one after another, on one worker (each started anew)
    saved_seconds: float
    start_seconds: float = 0.0  # a process's start and imports, which each separate run pays again

    def to_dict(self) -> dict:
        """The pass's figures at the top, as one model's estimate has them (a scheduler reads `workers` either
        way), then each model's and the comparison."""
        return {**self.one_pass.to_dict(), "models": {name: each.to_dict() for name, each in self.models.items()},
                "separate_seconds": round(self.separate_seconds, 2), "saved_seconds": round(self.saved_seconds, 2),
                "start_seconds": round(self.start_seconds, 2)}

    def to_text(self) -> str:
        lines = []
        for name, each in self.models.items():
            lines.append(f"model {name}")
            lines += [f"  {line}" for line in each.to_text().splitlines()[1:]]  # the rows line is the pass's
        one = self.one_pass
        share = self.saved_seconds / self.separate_seconds if self.separate_seconds else 0.0
        lines.append(one.to_text())
        lines.append(f"one pass        saves {self.saved_seconds:,.0f}s ({share:.0%}) over {len(self.models)} "
                     f"separate runs ({self.separate_seconds:,.0f}s, each starting in {self.start_seconds:,.1f}s): it "
                     "starts and tokenizes once (reading and commits, also once, not counted)")
        return "\n".join(lines)


def one_pass_estimate(models: dict[str, Estimate], window_s: float | None, once_s: float = 0.0,
                      start_s: float = 0.0) -> ModelSetEstimate:
    """One pass of several models (pure): every model's setup and device seconds, the host's tokenizing and
    `once_s` of each model's setup (the --reuse index) once, as the models share one tokenization and one
    read, against the models' own runs one after another, each also paying `start_s` (a process's start and
    imports). Reading and committing, which separate runs also repeat, are not counted: the saving is a floor. Each model's
    device seconds are its own run's: the pass batches under the tightest of their memory plans, which is
    slower where another model's plan is much tighter (`plan` shows the plans)."""
    first = next(iter(models.values()))
    device_s = sum(each.device_seconds for each in models.values())
    setup_s = sum(each.setup_seconds for each in models.values()) - once_s * (len(models) - 1)
    host_s, shared = first.host_seconds, first.shared_cores
    one = Estimate(first.rows, first.shards, first.sample_rows, first.mean_tokens_per_row, first.tokens,
                   first.tokens / device_s if device_s else 0.0, "the models' own, one after another on each batch",
                   device_s, setup_s, wall_seconds(device_s, setup_s, host_s=host_s, shared_cores=shared), window_s,
                   computed_rows=first.computed_rows, reused_share=first.reused_share,
                   memory_plan="each model's (above); batches take the fewest rows any plan allows",
                   host_seconds=host_s, shared_cores=shared)
    one.fit_window()
    separate = sum(each.predicted_seconds for each in models.values()) + start_s * (len(models) - 1)
    return ModelSetEstimate(models, one, separate, separate - one.predicted_seconds, start_s)


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
