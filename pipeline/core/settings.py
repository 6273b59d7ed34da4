"""The resolved settings of a run or a sweep: every CLI flag, TOML key and LENGTHWISE_* variable."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

from pipeline.core.errors import UsageError

# What `auto` batch limits become without a saved sweep recommendation, per device type. The
# memory plan caps them further. CPU: the sweep's knee on 2 cores (1,024–2,048 tokens within 3%,
# docs/tuning.md "Choosing batch settings"). CUDA: 2,048 tokens starve a large GPU; 32k padded tokens is
# the order where an encoder's matmuls fill an H100/H200 (TEI's default budget is 16k), and a
# cap keeps one batch's latency and its out-of-memory back-off bounded; a smaller model gets more
# (`cuda_batch_tokens`). A GPU sweep should try 8k–256k tokens (docs/tuning.md).
DEVICE_BATCH_LIMITS = {"cpu": {"max_batch_tokens": 2048, "max_batch_rows": 512},
                       "cuda": {"max_batch_tokens": 32768, "max_batch_rows": 4096}}


# The settings a sweep or a load test may vary, by flag name → config field: the one map of them.
VARIED_SETTINGS = {"max-batch-tokens": "max_batch_tokens", "max-batch-rows": "max_batch_rows",
                   "max-batch-size": "max_batch_size", "batch-timeout-ms": "batch_timeout_ms"}
SWEEP_VARIES = ("max-batch-tokens", "max-batch-rows")  # `lengthwise sweep --vary` (offline batches)
LOADTEST_VARIES = ("max-batch-size", "batch-timeout-ms", "max-batch-tokens")  # `lengthwise loadtest --vary` (batcher)


MAX_BATCH_ROWS = 65535  # the most rows a batch may hold: CUDA's grid limit (65,535 blocks in y and z), where the
# attention kernels put the batch; the exported forward's row bound (`Dim("rows")`) on every device

CUDA_TOKENS_AT_BERT_BASE = 32768  # DEVICE_BATCH_LIMITS' CUDA tokens hold for hidden 768 × 12 layers
CUDA_TOKEN_RANGE = (16384, 262144)


def cuda_batch_tokens(hidden_size: int, layers: int) -> int:
    """The default CUDA token budget for a model of this size: the same work per batch as
    32,768 tokens of BERT-base (a token costs ≈ hidden² × layers), as a power of two within
    16k–256k. A batch of a smaller model is otherwise over in the time the host takes to launch
    its kernels: all-MiniLM-L6-v2 (384 × 6) at 32k tokens is ≈0.7 TFLOP, 2–3 ms on an H200."""
    tokens = CUDA_TOKENS_AT_BERT_BASE * (768 * 768 * 12) / max(1, hidden_size * hidden_size * layers)
    low, high = CUDA_TOKEN_RANGE
    return min(high, max(low, 2 ** math.floor(math.log2(max(1.0, tokens)))))


def device_batch_limit(device_type: str, name: str, model_config=None) -> int:
    """The default `name` (max_batch_tokens, max_batch_rows) on a device type; on CUDA the
    token budget follows the model's size when its config is given (`cuda_batch_tokens`)."""
    hidden, layers = getattr(model_config, "hidden_size", None), getattr(model_config, "num_hidden_layers", None)
    if device_type == "cuda" and name == "max_batch_tokens" and isinstance(hidden, int) and isinstance(layers, int):
        return cuda_batch_tokens(hidden, layers)
    return DEVICE_BATCH_LIMITS.get(device_type, DEVICE_BATCH_LIMITS["cpu"])[name]


WINDOW_BATCHES = 16  # `--window-rows auto` holds this many batches of the row limit: enough rows of each length
# that a batch need not span the window's length range (an 8,192-row window at CUDA's 4,096 rows was two batches,
# half their tokens padding)
MIN_WINDOW_ROWS, MAX_WINDOW_ROWS = 8192, 65536  # 8,192: the CPU's window before auto (never fewer: packing only gets worse);
# 65,536: what bounds memory (docs/design.md "Windows")


def auto_window_rows(max_batch_rows: int) -> int:
    """`--window-rows auto`: WINDOW_BATCHES batches of `max_batch_rows` rows, within MIN_WINDOW_ROWS–MAX_WINDOW_ROWS.
    CPU (512 rows): 8,192, as before; CUDA (4,096 rows): 65,536."""
    return min(MAX_WINDOW_ROWS, max(MIN_WINDOW_ROWS, WINDOW_BATCHES * max_batch_rows))


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity: a container's or a Slurm job's share),
    not the host's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


CUDA_HOST_THREADS = 3  # cores a CUDA run keeps from its tokenizer pool for its own busy threads: the device loop
# (kernel launches), the prefetch thread (collate, pin, copy) and the writer (Parquet encoding); on a CPU the
# pool takes every core, as measured (the forward's threads wait while a window is tokenized)


def tokenize_workers_for(setting: int | None, device_type: str, cores: int | None = None) -> int:
    """`--tokenize-workers` (None: auto): on a CPU every usable core; on CUDA all but
    CUDA_HOST_THREADS of them, at least one (13 on a 16-core H200 host)."""
    if setting is not None:
        return setting
    cores = usable_cores() if cores is None else cores
    return max(1, cores - CUDA_HOST_THREADS) if device_type == "cuda" else cores


def set_torch_threads(threads: int | None) -> None:
    """Fix the forward's intra-op threads (process-wide) before the model is loaded and timed
    (--torch-threads). On a CPU shared with other processes, two threads that meet at every
    operator's barrier turned a 10 ms single-row forward into ~1 s (load average 8 on 2 cores);
    one thread kept it at 23-33 ms."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


LONG_TEXT_MODES = ("auto", "truncate", "split")


def long_text_mode(long_text: str, job: str) -> str:
    """truncate or split: `auto` splits for moderate, where a text padded past --max-length must
    not hide what follows, and truncates otherwise (docs/jobs.md)."""
    return "split" if long_text == "split" or (long_text == "auto" and job == "moderate") else "truncate"


def segment_length_of(config, max_length: int) -> int:
    """--segment-length, which a model's window must hold: at most --max-length (its default)."""
    if config.segment_length is not None and config.segment_length > max_length:
        raise UsageError(f"--segment-length {config.segment_length} is more than --max-length {max_length}, the "
                         f"tokens the model takes per row; set --segment-length {max_length} or less")
    return config.segment_length or max_length


@dataclass(frozen=True)
class RunConfig:
    input: tuple[str, ...]  # directories, globs or files; local paths or fsspec URLs
    output: str  # directory (local or URL) that receives one Parquet file per input shard
    job: str = "embed"  # what to compute: embed | classify | moderate
    model: str | None = None  # Hugging Face model folder; None = packaged all-MiniLM-L6-v2
    max_length: int | None = None  # tokens per row, longer texts truncated (and flagged); None = the model
    # folder's sentence-transformers max_seq_length, else 256
    prompt: str | None = None  # text put before every row (sentence-transformers prompts)
    prompt_name: str | None = None  # a prompt of the model folder by name; default: its default_prompt_name
    long_text: str = "auto"  # rows longer than max_length: truncate | split (into segments, each scored, folded
    # back: pipeline/core/segments.py) | auto = split for moderate, truncate otherwise; a resume keeps the output's
    segment_length: int | None = None  # split: tokens per segment at most; None = max_length
    id_column: str = "id"
    text_column: str = "text"
    keep_columns: tuple[str, ...] = ()  # input columns copied to the output unchanged, after `id`
    split: str | None = None  # the split of a `datasets` DatasetDict folder given as --input
    thresholds: dict = field(default_factory=dict)  # moderate: label → score at or above which it flags
    default_threshold: float = 0.5  # moderate: the threshold of flag labels not in `thresholds`
    flag_labels: tuple[str, ...] | None = None  # moderate: labels that can flag; None = all (sigmoid models)
    max_batch_tokens: int | None = None  # padded tokens per batch (rows × padded length); None = auto: the
    # sweep's recommendation, else the device's default (DEVICE_BATCH_LIMITS)
    max_batch_rows: int | None = None  # rows per batch, whatever their length; None = auto, as tokens
    probe: bool = True  # size batches by the memory plan (cached, else probed on the device)
    memory_budget: int | None = None  # bytes batches may use; None = device default
    memory_reserve: float = 0.10  # share of GPU memory kept free when there is no budget
    safety: float = 1.5  # headroom factor of the memory formula, 1.0–4.0
    plan_cache: str | None = None  # directory of cached plans; None = ~/.cache/lengthwise/plans
    use_plan_cache: bool = True  # reuse a cached plan instead of probing
    window_rows: int | None = None  # rows sorted and packed together; bounds memory in flight; None = auto:
    # 16 batches of the row limit, 8,192–65,536 (`auto_window_rows`)
    tokenize_workers: int | None = None  # tokenizer processes, 0 = in-process; None = auto: the usable cores,
    # on CUDA less CUDA_HOST_THREADS (`tokenize_workers_for`)
    torch_threads: int | None = None  # intra-op threads of the forward; None = torch's default (the cores)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    compile: str = "auto"  # auto | on | off: a compiled forward where measured faster (core/compile.py)
    unpad: str = "auto"  # auto | on | off: the unpadded forward (core/unpadded.py); auto = on CUDA where the model has
    # BERT's layout; never with a compiled forward
    prefetch_batches: int = 4  # collated batches waiting ahead of the device
    storage_options: dict = field(default_factory=dict)  # passed to fsspec for input and output
    overwrite: bool = False  # redo every shard, even under a different fingerprint
    reuse: str | None = None  # a previous output of the same settings: rows with unchanged id and text copy its result
    dedupe: bool = True  # rows with the same text in a window run once and copy the result (bit-identical)
    engine: str = "local"  # local (this process, or worker I of N) | ray (actors on a Ray cluster)
    ray_address: str | None = None  # engine ray: auto, ray://host:10001; None = RAY_ADDRESS or a local cluster
    workers: int | None = None  # engine ray: actors; None = one per GPU, else CPUs // threads_per_worker
    threads_per_worker: int | None = None  # engine ray: torch threads per actor (CPU actors: 1 when None)
    torch_threads: int | None = None  # intra-op threads of the forward in this process; None = torch's default
    # (the cores): two jobs on one machine each set it to their share
    num_shards: int = 1  # this process is one of N workers over the same input and output
    shard_index: int | None = None  # which of them (0…N-1); None = JOB_COMPLETION_INDEX / SLURM_ARRAY_TASK_ID
    fail_fast: bool = False  # stop at the first failed shard
    lock_lease_s: float = 300.0  # the output lock's lease: renewed every fifth of it; a lock not renewed for
    # longer is taken over from any host (a run OOM-killed or lost with its node)
    allow_pickle: bool = False  # accept pickle (.bin) checkpoints; they can run code when loaded
    trust_remote_code: bool = False  # let a model folder run its own Python code
    progress: bool = True  # tqdm bar on stderr
    summary_json: str | None = None  # also write the run summary here

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SweepConfig:
    """One batch-setting sweep: a single variable stepped over `values` on sampled real rows."""

    input: tuple[str, ...]
    vary: str  # max-batch-tokens | max-batch-rows
    values: tuple[int, ...]  # the levels, run in ascending order
    out: str  # the CSV; the settings and the recommendation go beside it as <out>.json
    job: str = "embed"
    model: str | None = None
    max_length: int | None = None
    prompt: str | None = None
    prompt_name: str | None = None
    id_column: str = "id"
    text_column: str = "text"
    max_batch_tokens: int | None = None  # held fixed when varying rows; None = no token budget
    max_batch_rows: int | None = None  # held fixed when varying tokens; None = the device's default, as in run
    rows: int = 2000  # measured rows per level
    warmup_rows: int = 200  # run before each level, not counted
    seed: int = 0  # which rows the sample takes
    max_p99_ms: float | None = None  # recommendation: p99 row latency limit
    memory_headroom: float = 0.10  # recommendation: share of the memory budget left free
    memory_budget: int | None = None
    memory_reserve: float = 0.10
    device: str = "auto"
    dtype: str = "auto"
    compile: str = "auto"  # auto | on | off: a compiled forward where measured faster (core/compile.py)
    unpad: str = "auto"  # auto | on | off: the unpadded forward (core/unpadded.py); auto = on CUDA where the model has
    # BERT's layout; never with a compiled forward
    tokenize_workers: int | None = None  # as RunConfig's
    torch_threads: int | None = None  # intra-op threads of the forward; None = torch's default (the cores)
    prefetch_batches: int = 4
    storage_options: dict = field(default_factory=dict)
    plan_cache: str | None = None  # where the recommendation is saved for `run … auto`
    save_recommendation: bool = True
    trust_remote_code: bool = False
    allow_pickle: bool = False


@dataclass(frozen=True)
class BatcherConfig:
    """The online batcher: requests that arrive one by one, gathered into batches under a deadline."""

    job: str = "embed"
    model: str | None = None
    max_length: int | None = None
    prompt: str | None = None
    prompt_name: str | None = None
    max_batch_size: int = 32  # requests per batch; a batch runs as soon as this many are queued
    max_batch_tokens: int | None = None  # padded tokens per batch (also a trigger); None = the device's default
    # (DEVICE_BATCH_LIMITS, as `run` without a sweep recommendation)
    batch_timeout_ms: float = 20.0  # the oldest queued request waits at most this long for company
    request_timeout_ms: float = 1000.0  # a request's deadline unless submit gives one; > batch_timeout_ms
    max_queue: int = 2000  # requests waiting (tokenizing or queued); one more fails at once with QueueFull
    max_queue_tokens: int = 2**18  # padded tokens waiting; the same
    probe: bool = True  # cap batches by the memory plan (cached, else probed on the device)
    memory_budget: int | None = None
    memory_reserve: float = 0.10
    safety: float = 1.5
    plan_cache: str | None = None
    use_plan_cache: bool = True
    device: str = "auto"
    dtype: str = "auto"
    compile: str = "auto"  # auto | on | off: a compiled forward where measured faster (core/compile.py)
    unpad: str = "auto"  # auto | on | off: the unpadded forward (core/unpadded.py); auto = on CUDA where the model has
    # BERT's layout; never with a compiled forward
    torch_threads: int | None = None  # intra-op threads of the forward; None = torch's default (the cores)
    allow_pickle: bool = False
    trust_remote_code: bool = False

    @property
    def max_batch_rows(self) -> int:
        """What the memory plan calls the batch size (its cache key and row cap)."""
        return self.max_batch_size


@dataclass(frozen=True)
class OnlineLoadtestConfig:
    """The online load test: real texts sent at a Poisson rate; one batcher setting stepped over `values`."""

    input: tuple[str, ...]
    vary: str  # max-batch-size | batch-timeout-ms | max-batch-tokens
    values: tuple[int, ...]
    out: str  # the CSV; the settings and the recommendation go beside it as <out>.json
    batcher: BatcherConfig = field(default_factory=BatcherConfig)  # the fixed settings
    qps: float = 40.0  # mean arrival rate (Poisson)
    concurrency: int = 64  # requests in flight at most; a later arrival waits for a slot (its wait counts)
    duration_s: float = 30.0  # measured seconds of arrivals per level
    warmup_s: float = 3.0  # arrivals before the measured ones, not counted
    sample_rows: int = 5000  # texts sampled from the input, sent in random order
    seed: int = 0
    max_p99_ms: float | None = None  # recommendation: p99 latency limit
    memory_headroom: float = 0.10
    id_column: str = "id"
    text_column: str = "text"
    storage_options: dict = field(default_factory=dict)
