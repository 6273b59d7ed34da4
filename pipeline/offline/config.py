"""A run's settings: the settings groups (model, batch, source) and what only a run has."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.core.errors import UsageError
from pipeline.core.settings import (
    BatchSettings,
    CacheSettings,
    InputSettings,
    ModelSettings,
    SettingsTree,
    LongRowSettings,
    RuntimeNeeds,
)


@dataclass(frozen=True)
class RunConfig(SettingsTree):
    output: str  # directory (local or URL) that receives one Parquet file per input shard
    source: InputSettings = field(default_factory=InputSettings)
    model: ModelSettings = field(default_factory=lambda: ModelSettings(thresholds={}))  # a run checks its thresholds
    batch: BatchSettings = field(default_factory=BatchSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    long_rows: LongRowSettings = field(default_factory=LongRowSettings)  # --long-text, --segment-length
    keep_columns: tuple[str, ...] = ()  # input columns copied to the output unchanged, after `id`
    models: dict = field(default_factory=dict)  # several models in one pass: name → its model settings that differ
    # from `model`'s (a TOML [models.NAME] table; offline/model_set.py); {} = the one model of `model`
    window_rows: int | None = None  # rows sorted and packed together; bounds memory in flight; None = auto:
    # 16 batches of the row limit, 8,192–65,536 (`auto_window_rows`)
    tokenize_workers: int | None = None  # tokenizer processes, 0 = in-process; None = auto: the usable cores,
    # on CUDA less CUDA_HOST_THREADS (`tokenize_workers_for`)
    prefetch_batches: int = 4  # collated batches waiting ahead of the device
    overwrite: bool = False  # redo every shard, even under a different fingerprint
    reuse: str | None = None  # a previous output of the same settings: rows with unchanged id and text copy its result
    dedupe: bool = True  # rows with the same text in a window run once and copy the result (bit-identical)
    engine: str = "local"  # local (this process, or worker I of N) | ray (actors on a Ray cluster)
    ray_address: str | None = None  # engine ray: auto, ray://host:10001; None = RAY_ADDRESS or a local cluster
    workers: int | None = None  # engine ray: actors; None = one per GPU, else CPUs // threads_per_worker
    threads_per_worker: int | None = None  # engine ray: torch threads per actor (CPU actors: 1 when None)
    num_shards: int = 1  # this process is one of N workers over the same input and output
    shard_index: int | None = None  # which of them (0…N-1); None = JOB_COMPLETION_INDEX / SLURM_ARRAY_TASK_ID
    fail_fast: bool = False  # stop at the first failed shard
    lock_lease_s: float = 300.0  # the output lock's lease: renewed every fifth of it; a lock not renewed for
    # longer is taken over from any host (a run OOM-killed or lost with its node)
    progress: bool = True  # tqdm bar on stderr
    summary_json: str | None = None  # also write the run summary here
    metrics_textfile: str | None = None  # Prometheus metrics for node_exporter's textfile collector, kept up to date
    metrics_interval_s: float = 30.0  # how often the textfile is rewritten during the run
    pushgateway: str | None = None  # a Prometheus Pushgateway the run's metrics are pushed to at its end

    def runtime_needs(self) -> RuntimeNeeds:
        """Both batch limits and a sweep's recommendation."""
        return RuntimeNeeds(long_rows=self.long_rows)

    def input_rows(self):
        """Every shard of the input (`plan`, the estimate; a run weighs the shards it has to do), for the dtype
        trial and the compile; None without an input (`plan` alone)."""
        from pipeline.offline.workload import InputSample

        return InputSample.listed(self.source) if self.source.input else None


def check_named_inputs(job: str, pair_column: str | None, long_text: str) -> None:
    """--job pair reads a text and its pair (--pair-column) and never splits them; no other job reads a pair."""
    if job == "pair" and not pair_column:
        raise UsageError("--job pair scores a text with its pair: set --pair-column to the input column of the pairs")
    if job != "pair" and pair_column:
        raise UsageError(f"--pair-column is for --job pair, not --job {job}; drop --pair-column or set --job pair")
    if job == "pair" and long_text == "split":
        raise UsageError("--long-text split cuts one text into segments, which a pair cannot be: --job pair truncates "
                         "the longer text first (longest_first); drop --long-text split")
