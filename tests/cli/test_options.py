"""Every command's options are declared once (`pipeline.offline.options`, `pipeline.tuning.options`): the
CLI's click options are made of them, and `pipeline.api` resolves the run's keywords, variables and TOML
file to the same RunConfig with no click. No model is loaded."""

import logging
import os
import subprocess
import sys

import pytest

import click
from click.testing import CliRunner

from pipeline.api import run_config_from
from pipeline.cli import cli
from pipeline.cli.options import COMMANDS, Checked, _config_keys
from pipeline.core import values
from pipeline.core.errors import UsageError
from pipeline.core.logs import configure_logging
from pipeline.core.options import env_name
from pipeline.offline.options import LOG_LEVEL_OPTIONS, RUN_OPTIONS, run_config
from pipeline.tuning.options import COMMAND_OPTIONS, OTHER_COMMANDS_KEYS
from tests.test_layers import ROOT


def cli_config(arguments: list[str], env: dict):
    """The RunConfig `lengthwise run ARGUMENTS` resolves under `env`, as the command builds it."""
    command = cli.commands["run"]
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("LENGTHWISE_")]:
            patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        try:
            with command.make_context("run", arguments) as context:
                return run_config(**context.params)
        finally:
            configure_logging(logging.INFO)  # as the CLI starts every command: a -q in the file lowered it


def test_every_command_has_a_table():
    assert set(COMMANDS) == set(COMMAND_OPTIONS)


@pytest.mark.parametrize("name", sorted(COMMAND_OPTIONS))
def test_every_option_of_every_command_is_made_of_its_declaration(name):
    """A command's options are its table's, in its order, each made of its row: an option added to a
    command by hand, not declared, fails here."""
    options = {p.opts[0].lstrip("-").replace("-", "_"): p for p in COMMANDS[name].params if p.name != "config"}
    table = COMMAND_OPTIONS[name]
    assert list(options) == list(table)
    for key, option in options.items():
        declared = table[key]
        assert option.envvar == env_name(key) and option.multiple == declared.multiple, key
        assert option.required == declared.required and option.help == declared.help, key
        if isinstance(declared.kind, values.Flag):
            assert option.is_flag, key
        elif isinstance(declared.kind, values.FilePath):
            assert isinstance(option.type, click.Path) and not option.type.dir_okay, key
        else:
            assert option.type.kind is declared.kind, key
        assert option.name == (declared.parameter or key), key


def test_the_run_table_takes_moderates_options_from_the_job():
    from jobs.moderate_options import MODERATE_OPTIONS

    assert all(RUN_OPTIONS[key] is option for key, option in MODERATE_OPTIONS.items())
    assert set(LOG_LEVEL_OPTIONS) == {"quiet", "verbose"}


@pytest.mark.parametrize("name, key", [(name, key) for name, table in sorted(COMMAND_OPTIONS.items())
                                       for key, option in table.items() if option.required])
def test_a_required_option_left_out_is_a_usage_error(name, key):
    """Each required option's absence is click's one line and exit 2, before the command runs (`verify`
    without --output reached fsspec with None and ended in a traceback, exit 1)."""
    given = {"input": "in", "vary": "max-batch-size" if name == "loadtest" else "max-batch-rows", "values": "1,2",
             "out": "o.csv", "output": "o"}
    arguments = [part for other, option in COMMAND_OPTIONS[name].items() if option.required and other != key
                 for part in (f"--{other}", given[other])]
    result = CliRunner().invoke(cli, [name, *arguments])
    assert result.exit_code == 2, result.output
    assert f"Missing option '--{key}'" in result.output


def test_the_keys_a_run_skips_are_exactly_the_other_commands_keys():
    run_keys = set(_config_keys(COMMANDS["run"]))
    others = set().union(*(_config_keys(command) for command in COMMANDS.values())) - run_keys
    assert others == OTHER_COMMANDS_KEYS


def test_every_typed_option_of_every_command_is_checked_by_a_declared_kind():
    for command in COMMANDS.values():
        for option in command.params:
            if not option.is_flag and option.name not in ("config",) and type(option.type).__name__ not in (
                    "StringParamType", "Path"):
                assert isinstance(option.type, Checked), f"{command.name} {option.opts[0]}"


def test_the_api_resolves_keywords_variables_and_the_file_as_the_cli_does(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text('input = "in"\noutput = "out"\nmax_length = 96\nsafety = 2\nlock_lease = "2m"\n'
                    'keep_columns = ["label"]\nquiet = true\nout = "sweep.csv"\n'  # a sweep's key: skipped
                    '[storage]\nanon = true\nendpoint_url = "http://127.0.0.1:1"\n'
                    '[thresholds]\ntoxic = 0.7\nhate = 0.9\n')
    env = {"LENGTHWISE_MAX_BATCH_TOKENS": "4096", "LENGTHWISE_SAFETY": "3", "LENGTHWISE_PROBE": "false",
           "LENGTHWISE_STORAGE_OPTION": "endpoint_url=http://127.0.0.1:2"}
    from_cli = cli_config(["--config", str(toml), "--threshold", "hate=0.5", "--max-length", "64",
                           "--tokenize-workers", "0", "--no-progress"], env)
    from_api, quiet, verbose = run_config_from({"config": str(toml), "threshold": {"hate": 0.5}, "max_length": 64,
                                                "tokenize_workers": 0, "progress": False}, env)
    assert from_api == from_cli and (quiet, verbose) == (True, False)  # quiet from the file, as -q
    # keyword over variable over file over default, and tables merged key by key
    assert (from_api.model.max_length, from_api.batch.safety, from_api.batch.max_batch_tokens) == (64, 3.0, 4096)
    assert (from_api.batch.probe, from_api.lock_lease_s, from_api.keep_columns) == (False, 120.0, ("label",))
    assert from_api.model.thresholds == {"toxic": 0.7, "hate": 0.5}
    assert from_api.source.storage_options == {"anon": True, "endpoint_url": "http://127.0.0.1:2"}
    assert from_api.batch.max_batch_rows is None and from_api.source.input == ("in",)


def test_defaults_alone_resolve_alike():
    assert run_config_from({"input": "x", "output": "y"}, {}) == (cli_config(["--input", "x", "--output", "y"], {}),
                                                                  False, False)


@pytest.mark.parametrize("given, env, message", [
    ({"max_length": 0}, {}, "max_length=0: 0 is not in the range x>=1."),
    ({"max_length": 64.5}, {}, "max_length=64.5: 64.5 is not a valid integer range."),
    ({"safety": float("nan")}, {}, "safety=nan: nan is not a finite number; give one in 1.0<=x<=4.0"),
    ({}, {"LENGTHWISE_SAFETY": "9"}, "LENGTHWISE_SAFETY='9': 9.0 is not in the range 1.0<=x<=4.0."),
    ({"dtype": "fp8"}, {}, "dtype='fp8': 'fp8' is not one of 'auto', 'float32', 'bfloat16', 'float16'."),
    ({"max_batch_rows": "many"}, {}, "'many' is neither a number of rows nor 'auto'"),
    ({"lock_lease": "soon"}, {}, "'soon' is not a duration such as 30s, 500ms or 2m"),
    ({"overwrite": 1}, {}, "overwrite=1: give True or False"),
    ({"max_lenght": 64}, {}, "run() has no option 'max_lenght'; options: "),
    ({"config": "missing.toml"}, {}, "config='missing.toml': cannot read missing.toml"),
])
def test_a_bad_value_is_a_usage_error_naming_where_it_came_from(given, env, message):
    with pytest.raises(UsageError) as raised:
        run_config_from({"input": "x", "output": "y", **given}, env)
    assert message in str(raised.value)


def test_a_wrong_toml_type_is_refused_by_the_api_with_the_clis_words(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text("max_batch_rows = 64.7\n")
    with pytest.raises(UsageError, match='max_batch_rows is a float, but it takes an integer or "auto"; fix it'):
        run_config_from({"input": "x", "output": "y", "config": str(toml)}, {})
    toml.write_text("max_lenght = 64\n")
    with pytest.raises(UsageError, match="unknown key 'max_lenght'; known keys: "):
        run_config_from({"input": "x", "output": "y", "config": str(toml)}, {})


def test_the_api_imports_no_click():
    code = "import sys, pipeline.api; assert 'click' not in sys.modules, sorted(m for m in sys.modules if 'click' in m)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_list_keyword_is_the_flags_comma_separated_value():
    given = {"input": "x", "output": "y", "keep_columns": ["label", "lang"], "flag_labels": ("toxic",)}
    assert run_config_from(given, {})[0] == cli_config(["--input", "x", "--output", "y", "--keep-columns",
                                                        "label,lang", "--flag-labels", "toxic"], {})
