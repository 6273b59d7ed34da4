"""Options shared by the commands: the --config TOML file and its tables, LENGTHWISE_* env
vars, parameter types, the option lists, logging, and the one-line error exit."""

from __future__ import annotations

import contextlib
import logging
import sys

import click
from click.core import ParameterSource

from pipeline.core import exit_codes, values
from pipeline.core.errors import as_credentials_error, as_storage_error
from pipeline.core.logs import configure_logging
from pipeline.core.redact import redact_text
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
    refused = {"models": f"`{ctx.info_name}` takes one model and {path} declares several ([models] tables): give "
                         "it the one with --model (and the table's settings as flags)"} \
        if "model" in names and "models" not in names else {}
    try:
        found = config_file_values(path, kinds, other_commands, refused)
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


def run_option(name: str, **kwargs):
    """The click option of a `lengthwise run` option (and of the commands that share it), made of its one
    declaration in `RUN_OPTIONS`: flag, kind, default, env var and help. A flag on by default (or unset:
    None) also takes --no-NAME. A KEY=VALUE option merges its --config table. `kwargs`: what another
    command says differently (its help, required)."""
    option = RUN_OPTIONS[name]
    flag = f"--{name.replace('_', '-')}"
    if isinstance(option.kind, values.Flag):
        kwargs["is_flag"] = True
        if option.default is not False:
            flag = f"{flag}/--no-{name.replace('_', '-')}"
    else:
        kwargs["type"] = Checked(option.kind)
    if option.multiple:
        kwargs["multiple"] = True
    else:
        kwargs["default"] = option.default
    if option.shows_default:
        kwargs["show_default"] = True
    if name in TABLE_OPTIONS:
        kwargs["callback"] = merge_config_table
    kwargs.setdefault("help", option.help)
    return click.option(flag, option.parameter or name, envvar=env_name(name), show_envvar=True, **kwargs)


def run_options(*names: str) -> list:
    """The click options of these run options, in this order."""
    return [run_option(name) for name in names]


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


def level_test_header(sampled: str, varies: tuple[str, ...], setting: str, example: str) -> list:
    """The options that open `sweep` and `loadtest`: the input the sample comes from, the one setting
    varied and its levels."""
    return [
        run_option("input", required=True,
                   help=f"Shards to sample {sampled} from: a directory, a glob or a file, local or fsspec URL. "
                        "Repeatable."),
        env_option("--vary", env="VARY", required=True, type=Checked(values.OneOf(*varies)),
                   help=f"The one {setting} that changes between levels."),
        env_option("--values", env="VALUES", required=True, type=Checked(values.IntegerList()),
                   help=f"Its levels, e.g. {example}."),
    ]


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


MODEL_OPTIONS = run_options("job", "model", "max_length", "prompt", "prompt_name", "device", "dtype", "compile",
                            "unpad", "allow_pickle", "trust_remote_code")
INPUT_OPTIONS = run_options("id_column", "text_column", "storage_option")
MEMORY_OPTIONS = run_options("memory_budget", "memory_reserve")
CACHE_OPTIONS = run_options("plan_cache", "no_plan_cache")
BATCH_OPTIONS = [*run_options("max_batch_tokens", "max_batch_rows"), *MEMORY_OPTIONS, run_option("safety"),
                 *CACHE_OPTIONS]
TORCH_THREADS_OPTION = run_option("torch_threads")
WORKER_OPTIONS = [*run_options("tokenize_workers", "prefetch_batches"), TORCH_THREADS_OPTION]
RUN_COMMAND_OPTIONS = run_options(*RUN_OPTIONS)  # `lengthwise run`: every one, in the table's order


def sweep_default(name: str):
    return default_of(name, SweepConfig)


def batcher_default(name: str):
    return default_of(name, BatcherConfig)


def loadtest_default(name: str):
    return default_of(name, OnlineLoadtestConfig)


def fail(message: str, exit_code: int = exit_codes.USAGE) -> None:
    click.echo(f"error: {redact_text(message)}", err=True)
    sys.exit(exit_code)


@contextlib.contextmanager
def exit_on_known_errors(path: str | None = None):
    """The one handler of a command's errors: an error the exit-code table maps (`core/exit_codes.py`:
    UsageError 2, StorageError 4) ends the command with one line and its code; with `path`, so does an
    error raised reaching that storage which stands for one (no credentials: 2; refused or unreachable:
    4). Its traceback only with --verbose. Any other error passes: a bug, exit 1 with its traceback."""
    try:
        yield
    except Exception as error:
        known = error if exit_codes.exit_code_for(error) is not None else (
            path is not None and (as_credentials_error(error, path) or as_storage_error(error, path)))
        if not known:
            raise
        logging.getLogger(__name__).debug("the error's traceback:", exc_info=error)
        fail(str(known), exit_codes.exit_code_for(known))
