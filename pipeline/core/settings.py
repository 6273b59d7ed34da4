"""The resolved settings of a run or a sweep: every CLI flag, TOML key and LENGTHWISE_* variable."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field
from typing import ClassVar

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


@contextlib.contextmanager
def torch_threads_restored():
    """Give the process back the intra-op thread count it had once a run is over: --torch-threads
    is process-wide, and a script (or a test) that runs a job through the API must not have its
    later forwards on another count (their float sums then differ in the last bits)."""
    import torch

    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


LONG_TEXT_MODES = ("auto", "truncate", "split")


def long_text_mode(long_text: str, job: str) -> str:
    """truncate or split: `auto` splits for moderate, where a text padded past --max-length must
    not hide what follows, and truncates otherwise (docs/jobs.md)."""
    return "split" if long_text == "split" or (long_text == "auto" and job == "moderate") else "truncate"


def segment_length_of(segment_length: int | None, max_length: int) -> int:
    """--segment-length, which a model's window must hold: at most --max-length (its default)."""
    if segment_length is not None and segment_length > max_length:
        raise UsageError(f"--segment-length {segment_length} is more than --max-length {max_length}, the "
                         f"tokens the model takes per row; set --segment-length {max_length} or less")
    return segment_length or max_length


@dataclass(frozen=True)
class LongRowSettings:
    """What becomes of rows longer than max_length: the same for a run, its estimate and its sweep, so that
    the sweep measures the rows the run computes."""

    long_text: str = "auto"  # truncate | split (into segments, each scored, folded back: pipeline/core/segments.py)
    # | auto = split for moderate, truncate otherwise; a resume keeps the output's
    segment_length: int | None = None  # split: tokens per segment at most; None = max_length

    def split_length(self, job: str, max_length: int) -> int | None:
        """Tokens per segment when `job` splits rows longer than `max_length`, else None: they are truncated."""
        if long_text_mode(self.long_text, job) == "truncate":
            return None
        return segment_length_of(self.segment_length, max_length)


TRUNCATE = LongRowSettings(long_text="truncate")  # a product without an input (the batcher, its load test)


@dataclass(frozen=True)
class ModelSettings:
    """Which model runs, where and how: the one model setup's input (`pipeline.runtime.open_runtime`),
    the same for a run, a sweep, the batcher and a load test."""

    job: str = "embed"  # what to compute: embed | classify | moderate | pair
    model: str | None = None  # Hugging Face model folder; None = packaged all-MiniLM-L6-v2
    max_length: int | None = None  # tokens per row, longer texts truncated (and flagged); None = the model
    # folder's sentence-transformers max_seq_length, else 256
    prompt: str | None = None  # text put before every row (sentence-transformers prompts)
    prompt_name: str | None = None  # a prompt of the model folder by name; default: its default_prompt_name
    thresholds: dict | None = None  # moderate: label → score at or above which it flags, checked against the
    # model's labels; None: not checked, every label flags at the default (a sweep, the batcher: they measure speed)
    default_threshold: float = 0.5  # moderate: the threshold of flag labels not in `thresholds`
    flag_labels: tuple[str, ...] | None = None  # moderate: labels that can flag; None = all (sigmoid models)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    compile: str = "auto"  # auto | on | off: a compiled forward where measured faster (core/compile.py)
    unpad: str = "auto"  # auto | on | off: the unpadded forward (core/unpadded.py); auto = on CUDA where the model has
    # BERT's layout; never with a compiled forward
    torch_threads: int | None = None  # intra-op threads of the forward in this process; None = torch's default
    # (the cores): two jobs on one machine each set it to their share
    allow_pickle: bool = False  # accept pickle (.bin) checkpoints; they can run code when loaded
    trust_remote_code: bool = False  # let a model folder run its own Python code


@dataclass(frozen=True)
class BatchSettings:
    """How batches are sized: the limits (None = auto: the sweep's recommendation, else the device's
    default) and the memory plan that caps them."""

    max_batch_tokens: int | None = None  # padded tokens per batch (rows × padded length)
    max_batch_rows: int | None = None  # rows per batch, whatever their length
    probe: bool = True  # size batches by the memory plan (cached, else probed on the device)
    memory_budget: int | None = None  # bytes batches may use; None = device default
    memory_reserve: float = 0.10  # share of GPU memory kept free when there is no budget
    safety: float = 1.5  # headroom factor of the memory formula, 1.0–4.0


@dataclass(frozen=True)
class CacheSettings:
    """Where what a setup measured is kept (memory plans, dtype and compile verdicts, sweep recommendations,
    inductor's caches): read by the model half as much as by the batch half, so a group of its own."""

    plan_cache: str | None = None  # the directory; None = ~/.cache/lengthwise/plans
    use_plan_cache: bool = True  # reuse a cached memory plan instead of probing


@dataclass(frozen=True)
class InputSettings:
    """Where the rows come from."""

    input: tuple[str, ...] = ()  # directories, globs or files; local paths or fsspec URLs
    id_column: str = "id"
    text_column: str = "text"
    pair_column: str | None = None  # --job pair: the input column of each text's pair
    split: str | None = None  # the split of a `datasets` DatasetDict folder given as --input
    storage_options: dict = field(default_factory=dict)  # passed to fsspec for input and output


BATCH_LIMITS = ("max_batch_tokens", "max_batch_rows")


@dataclass(frozen=True)
class RuntimeNeeds:
    """What a product asks of the one setup, declared by its config (`runtime_needs()`) as data."""

    limits: tuple[str, ...] = BATCH_LIMITS  # the batch limits it settles (None, auto → a number)
    recommended: bool = True  # a sweep's saved recommendation applies (not to the batcher: a sweep measures
    # offline batches)
    long_rows: LongRowSettings = TRUNCATE  # whether rows longer than max_length are split, and how
    levels: tuple[BatchSettings, ...] = ()  # a load test's levels: the memory plan is made for the largest


SETTINGS_GROUPS = {"model": ModelSettings, "batch": BatchSettings, "cache": CacheSettings, "source": InputSettings,
                   "long_rows": LongRowSettings}


class SettingsTree:
    """A product's config (run, sweep, batcher, load test): its own fields plus settings groups
    (`SETTINGS_GROUPS`), built once from flat names, as flags, TOML keys, LENGTHWISE_* variables and
    API keywords give them. `ALIASES`: a flat name the product calls a group's field by."""

    ALIASES: ClassVar[dict[str, str]] = {}

    @classmethod
    @functools.cache
    def flat_names(cls) -> dict[str, tuple[str, ...]]:
        """Every flat name → its path in the tree (("batch", "max_batch_tokens"), ("output",)): the same for
        every instance, so worked out once per class."""
        names = {}
        for item in dataclasses.fields(cls):
            group = SETTINGS_GROUPS.get(item.name)
            if group is not None and item.type in (group.__name__, group):
                names.update({inner.name: (item.name, inner.name) for inner in dataclasses.fields(group)})
            elif item.name not in SETTINGS_GROUPS:
                names[item.name] = (item.name,)
        names.update({alias: names[target] for alias, target in cls.ALIASES.items()})
        return names

    @classmethod
    def routed(cls, values: dict) -> tuple[dict, dict[str, dict]]:
        """Flat `values` split into the config's own fields and each group's; an unknown name is a
        UsageError that lists the known ones."""
        names = cls.flat_names()
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise UsageError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        top, groups = {}, {}
        for name, value in values.items():
            path = names[name]
            if len(path) == 1:
                top[path[0]] = value
            else:
                groups.setdefault(path[0], {})[path[1]] = value
        return top, groups

    @classmethod
    def of(cls, **values):
        """The config of flat `values`, every group from its default."""
        top, groups = cls.routed(values)
        defaults = {item.name: item for item in dataclasses.fields(cls)}
        return cls(**top, **{group: dataclasses.replace(defaults[group].default_factory(), **fields)
                             for group, fields in groups.items()})

    @classmethod
    def default(cls, name: str):
        """The default of one flat-named setting: its group's default, or the config's own."""
        path = cls.flat_names()[name]
        item = {f.name: f for f in dataclasses.fields(cls)}[path[0]]
        value = item.default_factory() if item.default is dataclasses.MISSING else item.default
        return getattr(value, path[1]) if len(path) > 1 else value

    def setting(self, name: str):
        """The value of one flat-named setting."""
        return self._at(self.flat_names()[name])

    def _at(self, path: tuple[str, ...]):
        value = self
        for part in path:
            value = getattr(value, part)
        return value

    def with_settings(self, **values):
        """This config with flat-named settings changed: a sweep's or load test's level, a run that keeps
        what its output was made with."""
        top, groups = self.routed(values)
        return dataclasses.replace(self, **top, **{group: dataclasses.replace(getattr(self, group), **fields)
                                                   for group, fields in groups.items()})

    def to_dict(self) -> dict:
        """Flat: each setting under its flat name, as run.json and the summaries record them."""
        return {name: self._at(path) for name, path in self.flat_names().items() if name not in self.ALIASES}
