"""Options shared by the commands: the --config TOML file and its tables, LENGTHWISE_* env
vars, parameter types, the click options made of the declared tables (`pipeline.core.options`),
logging, and the one-line error exit."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Mapping

import click
from click.core import ParameterSource

from pipeline.core import exit_codes, values
from pipeline.core.errors import as_credentials_error, as_storage_error
from pipeline.core.logs import configure_logging
from pipeline.core.options import Option, env_name
from pipeline.core.redact import redact_text
from pipeline.offline.options import LOG_LEVEL_OPTIONS, TABLES, config_file_values


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
TABLE_OPTIONS = tuple(TABLES.values())  # repeatable KEY=VALUE options that a TOML table also sets


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


def click_option(key: str, option: Option):
    """The click option of one declared option (`pipeline.core.options.Option`), made of it alone: flag
    --KEY, its kind as a click type (a file's path as click.Path), default, required, LENGTHWISE_<KEY>
    variable and help. A flag on by default (or unset: None) also takes --no-KEY. A KEY=VALUE option merges
    its --config table."""
    flag, kwargs = f"--{key.replace('_', '-')}", {}
    if isinstance(option.kind, values.Flag):
        kwargs["is_flag"] = True
        if option.default is not False:
            flag = f"{flag}/--no-{key.replace('_', '-')}"
    elif isinstance(option.kind, values.FilePath):
        kwargs["type"] = click.Path(dir_okay=False)
    else:
        kwargs["type"] = Checked(option.kind)
    if option.multiple:
        kwargs["multiple"] = True
    elif not option.required:  # a required option has none: its absence is click's "Missing option"
        kwargs["default"] = option.default
    if option.shows_default:
        kwargs["show_default"] = True
    if key in TABLE_OPTIONS:
        kwargs["callback"] = merge_config_table
    return click.option(flag, option.parameter or key, envvar=env_name(key), show_envvar=True,
                        required=option.required, help=option.help, **kwargs)


def declared_options(table: Mapping[str, Option]):
    """The decorator that gives a command the click options of its table, in the table's order."""
    return with_options([click_option(key, option) for key, option in table.items()])


def log_option(key: str, short: str, level: int):
    """-q / -v, made of its row in `LOG_LEVEL_OPTIONS`: it sets the log level as it is read, and no
    command takes its value."""

    def set_level(ctx, param, value):
        if value:
            configure_logging(level)

    return click.option(f"--{key}", short, envvar=env_name(key), show_envvar=True, is_flag=True, expose_value=False,
                        callback=set_level, help=LOG_LEVEL_OPTIONS[key].help)


LOG_OPTIONS = [log_option("quiet", "-q", logging.WARNING), log_option("verbose", "-v", logging.DEBUG)]
CONFIG_OPTION = click.option("--config", type=click.Path(dir_okay=False), callback=_read_config_file, is_eager=True,
                             expose_value=False,
                             help="TOML job file (configs/*.toml); flags and env vars override it. Keys that only "
                                  "another command takes (e.g. `output` for sweep) are skipped.")


def with_options(options):
    def decorate(function):
        for option in reversed(options):
            function = option(function)
        return function

    return decorate


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
