"""Values of the wrong kind, from a flag, an env var or the --config TOML file: refused with
exit 2 and the one line that names the key or flag, never coerced. No model is loaded."""

import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.core.units import parse_bytes


def error_line(result) -> str:
    """click's own line of a usage error (the others are the usage and the help hint)."""
    return next(line for line in result.output.splitlines() if line.startswith("Error: "))


@pytest.mark.parametrize("toml, message", [
    ('output = ["o/a", "o/b"]', "output is a list, but it takes a string"),
    ("max_length = 64.7", "max_length is a float, but it takes an integer"),
    ("max_batch_rows = 64.7", 'max_batch_rows is a float, but it takes an integer or "auto"'),
    ("max_length = true", "max_length is a boolean, but it takes an integer"),
    ('probe = "no"', "probe is a string, but it takes a boolean (true or false)"),
    ('overwrite = "yes"', "overwrite is a string, but it takes a boolean (true or false)"),
    ('model = { path = "models/x" }', "model is a table, but it takes a string"),
    ("input = [1, 2]", "input holds an integer, but it takes a list of strings or a string"),
    ("compile = false", 'compile is a boolean, but it takes one of "auto", "on", "off"'),
    ('safety = "high"', "safety is a string, but it takes a number"),
    ("memory_budget = 4.5", 'memory_budget is a float, but it takes a size (bytes, or a string such as "4GiB")'),
    ("keep_columns = [1]", "keep_columns holds an integer, but it takes a list of strings or a string"),
])
def test_a_config_value_of_the_wrong_type_is_exit_2_naming_key_and_types(tmp_path, toml, message):
    config = tmp_path / "job.toml"
    config.write_text(f'input = "in"\noutput = "out"\n{toml}\n' if not toml.startswith(("input", "output"))
                      else f"{toml}\n")
    result = CliRunner().invoke(cli, ["run", "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert error_line(result) == f"Error: Invalid value for '--config': {config}: {message}; fix it in the file"
    assert not (tmp_path / "out").exists()


def test_an_integer_where_a_float_goes_is_taken(tmp_path):
    """The worked example of the formula: 24 GiB / (384 MiB × 2) = 32 rows."""
    config = tmp_path / "plan.toml"
    config.write_text("safety = 2\n")
    result = CliRunner().invoke(cli, ["plan", "--config", str(config), "--available", "24GiB",
                                      "--per-sample", "384MiB"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "32"


def test_a_sweep_config_value_of_the_wrong_type_is_refused_too(tmp_path):
    config = tmp_path / "sweep.toml"
    config.write_text("warmup_rows = 50.5\n")
    result = CliRunner().invoke(cli, ["sweep", "--config", str(config), "--vary", "max-batch-tokens",
                                      "--values", "512", "--out", str(tmp_path / "s.csv")])
    assert result.exit_code == 2
    assert "warmup_rows is a float, but it takes an integer" in error_line(result)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
def test_safety_nan_or_inf_is_refused_on_the_flag(value):
    result = CliRunner().invoke(cli, ["plan", "--available", "24GiB", "--per-sample", "384MiB", "--safety", value])
    assert result.exit_code == 2, result.output
    assert error_line(result).startswith("Error: Invalid value for '--safety'")


def test_safety_nan_is_refused_in_the_env_var_and_in_the_config_file(tmp_path):
    result = CliRunner().invoke(cli, ["plan", "--available", "24GiB", "--per-sample", "384MiB"],
                                env={"LENGTHWISE_SAFETY": "nan"})
    assert result.exit_code == 2
    assert error_line(result) == ("Error: Invalid value for '--safety' (env var: 'LENGTHWISE_SAFETY'): 'nan' is not "
                                  "a finite number; give one in 1.0<=x<=4.0")
    config = tmp_path / "plan.toml"
    config.write_text("safety = nan\n")  # a TOML float
    result = CliRunner().invoke(cli, ["plan", "--config", str(config), "--available", "24GiB", "--per-sample", "1MiB"])
    assert result.exit_code == 2
    assert "nan is not a finite number; give one in 1.0<=x<=4.0" in error_line(result)


SWEEP = ["sweep", "--vary", "max-batch-tokens", "--values", "512", "--out", "s.csv"]
LOADTEST = ["loadtest", "--vary", "max-batch-size", "--values", "1", "--out", "l.csv"]


@pytest.mark.parametrize("args, flag", [
    (["run", "--input", "x", "--output", "y", "--default-threshold", "nan"], "--default-threshold"),
    (["run", "--input", "x", "--output", "y", "--memory-reserve", "nan"], "--memory-reserve"),
    (["run", "--input", "x", "--output", "y", "--memory-budget", "1e999"], "--memory-budget"),
    ([*SWEEP, "--max-p99-ms", "inf"], "--max-p99-ms"),
    ([*SWEEP, "--max-p99-rise", "inf"], "--max-p99-rise"),
    ([*SWEEP, "--max-throughput-drop", "nan"], "--max-throughput-drop"),
    ([*SWEEP, "--memory-headroom", "nan"], "--memory-headroom"),
    ([*LOADTEST, "--qps", "inf"], "--qps"),
    ([*LOADTEST, "--batch-timeout-ms", "inf"], "--batch-timeout-ms"),
    ([*LOADTEST, "--request-timeout-ms", "nan"], "--request-timeout-ms"),
    ([*LOADTEST, "--duration", "inf"], "--duration"),
    (["plan", "--estimate", "--input", "x", "--window", "nans"], "--window"),
])
def test_every_float_option_refuses_nan_and_inf(args, flag):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    line = error_line(result)
    assert line.startswith(f"Error: Invalid value for '{flag}'") and "finite" in line


def test_a_size_too_large_for_a_float_is_a_value_error_not_an_overflow():
    with pytest.raises(ValueError, match="'1e999' is not a finite size"):
        parse_bytes("1e999")
    assert parse_bytes("1.5KiB") == 1536
