"""The command line: config file, env vars and flags, outputs on disk, exit codes."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from tests.conftest import write_shards

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def shards(tmp_path, sample_table):
    write_shards(tmp_path / "in", sample_table.slice(0, 90), [40, 50])
    return tmp_path / "in"


def invoke(args, env=None):
    result = CliRunner().invoke(cli, args, env=env, catch_exceptions=False)
    return result


@pytest.mark.slow
def test_run_writes_one_file_per_shard_with_every_id_in_order(tmp_path, shards, sample_table, tiny_encoder_path):
    result = invoke(["run", "--input", str(shards), "--output", str(tmp_path / "out"), "--model", tiny_encoder_path,
                     "--no-progress", "--tokenize-workers", "1", "--summary-json", str(tmp_path / "s.json")])
    assert result.exit_code == 0, result.output
    for name, expected in (("part-00000", sample_table.slice(0, 40)), ("part-00001", sample_table.slice(40, 50))):
        out = pq.read_table(tmp_path / "out" / f"{name}.parquet")
        assert out["id"].to_pylist() == expected["id"].to_pylist()
    summary = json.loads((tmp_path / "s.json").read_text())
    assert {"rows", "real_tokens", "padded_tokens", "padding_efficiency", "rows_per_s", "tokens_per_s", "wall_s",
            "stage_s", "device_busy_fraction"} <= set(summary)
    assert summary["rows"] == 90
    assert "padding efficiency" in result.output and f"output          {tmp_path / 'out'}" in result.output
    status = invoke(["status", "--output", str(tmp_path / "out")])  # which batch setting (and its source) applied
    assert f"batch setting   {summary['batch_setting']} (the last run's)" in status.output.splitlines()
    assert "auto" in summary["batch_setting"]  # says where the limits came from


@pytest.mark.slow
def test_flags_win_over_env_and_env_over_the_config_file(tmp_path, shards, tiny_encoder_path):
    config = tmp_path / "job.toml"
    config.write_text(f'input = "{shards}"\noutput = "{tmp_path / "from-file"}"\nmodel = "{tiny_encoder_path}"\n'
                      f'max-length = 16\nprogress = false\ntokenize_workers = 0\n'
                      f'summary_json = "{tmp_path / "s.json"}"\n')
    env = {"LENGTHWISE_OUTPUT": str(tmp_path / "from-env"), "LENGTHWISE_MAX_BATCH_ROWS": "3"}
    assert invoke(["run", "--config", str(config)]).exit_code == 0
    assert (tmp_path / "from-file" / "part-00000.parquet").exists()
    assert invoke(["run", "--config", str(config)], env=env).exit_code == 0
    assert (tmp_path / "from-env" / "part-00000.parquet").exists()
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["settings"]["max_batch_rows"] == 3  # from the environment
    assert summary["batches"] >= 30  # 90 rows, at most 3 per batch
    result = invoke(["run", "--config", str(config), "--output", str(tmp_path / "from-flag"), "--max-length", "8"],
                    env=env)
    assert result.exit_code == 0
    assert (tmp_path / "from-flag" / "part-00001.parquet").exists()
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["padded_tokens"] <= 8 * 90  # --max-length 8 from the flag, not 16 from the file
    assert summary["truncated_rows"] >= 85


@pytest.mark.parametrize("case, message", [
    ("missing column", "has no column 'body'"),
    ("missing path", "does not exist; check --input"),
    ("unknown job", "set --job to one of: classify, embed"),
    ("model without config", "is not a Hugging Face model folder"),
    ("no output", "no output directory; set --output"),
])
def test_usage_errors_exit_2_with_one_line_saying_what_to_change(tmp_path, shards, tiny_encoder_path, case, message):
    args = {"missing column": ["--text-column", "body"],
            "missing path": ["--input", str(tmp_path / "nowhere")],
            "unknown job": ["--job", "summarise"],
            "model without config": ["--model", str(tmp_path)],
            "no output": []}[case]
    base = ["run", "--no-progress", "--model", tiny_encoder_path]
    if case != "missing path":
        base += ["--input", str(shards)]
    if case != "no output":
        base += ["--output", str(tmp_path / "out")]
    result = CliRunner().invoke(cli, base + args)
    assert result.exit_code == 2, result.output
    error_lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message in error_lines[0]
    assert not list((tmp_path / "out").glob("*.parquet")) if (tmp_path / "out").exists() else True


@pytest.mark.parametrize("flag, value, message", [
    ("--max-batch-tokens", "lots", "is neither a number of tokens nor 'auto'"),
    ("--max-batch-rows", "0", "0 is not a positive number of rows"),
    ("--window-rows", "0", "0 is not a positive number of rows"),
    ("--window-rows", "many", "is neither a number of rows nor 'auto'"),
    ("--tokenize-workers", "-1", "-1 is below 0, the fewest workers"),
])
def test_batch_limits_take_a_positive_count_or_auto(flag, value, message):
    result = CliRunner().invoke(cli, ["run", "--input", "x", "--output", "y", flag, value])
    assert result.exit_code == 2 and message in result.output


def test_unknown_config_key_is_a_usage_error(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text('input = "x"\nmax_batch_tokenz = 5\n')
    result = CliRunner().invoke(cli, ["run", "--config", str(config)])
    assert result.exit_code == 2
    assert "unknown key 'max_batch_tokenz'" in result.output


@pytest.mark.slow
def test_console_script_runs_the_demo_config_offline(tmp_path, tiny_encoder_path):
    script = Path(sys.executable).parent / "lengthwise"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LENGTHWISE_MODEL": tiny_encoder_path}
    completed = subprocess.run([str(script), "run", "--config", "configs/demo.toml", "--output", str(tmp_path / "o"),
                                "--summary-json", str(tmp_path / "s.json"), "--no-progress"],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    outputs = sorted(p.name for p in (tmp_path / "o").glob("*.parquet"))
    assert outputs == ["stdlib-docs-00000.parquet", "stdlib-docs-00001.parquet"]
    rows = sum(pq.read_metadata(tmp_path / "o" / name).num_rows for name in outputs)
    assert rows == 400 == json.loads((tmp_path / "s.json").read_text())["rows"]


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_use_only_known_keys(config):
    # --config and --help are eager: the file is read (an unknown key fails) and nothing runs
    result = CliRunner().invoke(cli, ["run", "--config", str(config), "--help"])
    assert result.exit_code == 0, result.output


# ── settings defined once ──────────────────────────────────────────────────────────────


def _options(command):
    return [p for p in command.params if isinstance(p, click.Option) and p.name not in ("help", "config")]


def test_every_option_of_every_command_has_a_lengthwise_variable():
    for name, command in cli.commands.items():
        missing = [o.opts[0] for o in _options(command) if not str(o.envvar or "").startswith("LENGTHWISE_")]
        assert not missing, f"`lengthwise {name}` options without a LENGTHWISE_ variable: {missing}"


def test_no_command_defines_an_option_twice():
    """Two decorators for one flag make click warn on every call and only one help text shows."""
    for name, command in cli.commands.items():
        flags = [flag for option in _options(command) for flag in option.opts]
        assert len(flags) == len(set(flags)), (name, sorted({f for f in flags if flags.count(f) > 1}))


def test_run_defaults_are_the_config_defaults():
    import dataclasses

    from pipeline.offline.config import RunConfig

    required = {f.name for f in dataclasses.fields(RunConfig) if f.default is f.default_factory is dataclasses.MISSING}
    run = cli.commands["run"]
    compared = 0
    for option in _options(run):
        if option.name not in RunConfig.flat_names() or option.is_flag or option.name in required:
            continue
        default = RunConfig.default(option.name)
        if option.name in ("max_batch_tokens", "max_batch_rows", "window_rows", "tokenize_workers"):  # a count or auto (None)
            default = "auto" if default is None else str(default)
        expected = default
        assert option.default == expected, option.name
        compared += 1
    assert compared >= 15


@pytest.mark.slow
def test_sweep_and_plan_read_a_run_config_file(tmp_path, tiny_encoder_path):
    """A nightly TOML serves `plan` and `sweep` too: their keys apply, run-only keys (output) are skipped."""
    config = tmp_path / "nightly.toml"
    config.write_text(f'input = "{ROOT / "pipeline" / "sample_data"}"\noutput = "{tmp_path / "never"}"\n'
                      f'model = "{tiny_encoder_path}"\nmax_length = 256\ntokenize_workers = 0\n'
                      f'plan_cache = "{tmp_path / "cache"}"\nmemory_budget = "16MiB"\nmax_batch_tokens = 1024\n')
    planned = invoke(["plan", "--config", str(config), "--json"])
    assert planned.exit_code == 0, planned.output
    plan = json.loads(planned.output[planned.output.index("{"):])
    assert max(bucket["length"] for bucket in plan["buckets"]) == 256 and plan["available_bytes"] == 16 * 2**20
    assert "--max-batch-tokens 1024" in planned.output
    swept = invoke(["sweep", "--config", str(config), "--vary", "max-batch-rows", "--values", "4,8",
                    "--sample-rows", "20", "--warmup-rows", "0", "--no-save", "--out", str(tmp_path / "s.csv")])
    assert swept.exit_code == 0, swept.output
    assert json.loads((tmp_path / "s.csv.json").read_text())["max_length"] == 256
    assert not (tmp_path / "never").exists()
    config.write_text(config.read_text() + "max_batch_tokenz = 5\n")
    assert "unknown key 'max_batch_tokenz'" in CliRunner().invoke(cli, ["sweep", "--config", str(config)]).output


def test_quiet_keeps_only_the_summary_and_verbose_adds_nothing_wrong(tmp_path, shards, tiny_encoder_path):
    base = ["run", "--input", str(shards), "--model", tiny_encoder_path, "--no-progress", "--tokenize-workers", "0",
            "--max-length", "16", "--no-probe"]
    loud = invoke(base + ["--output", str(tmp_path / "a")])
    quiet = invoke(base + ["--output", str(tmp_path / "b"), "--quiet"])
    assert loud.exit_code == quiet.exit_code == 0
    assert "batch setting:" in loud.output and "batch setting:" not in quiet.output
    assert "padding efficiency" in quiet.output  # the summary is output, not a log line



def test_one_vocabulary_every_option_has_one_env_var_named_after_its_flag():
    """Same concept, same name, one LENGTHWISE_ variable, in every command."""
    from pipeline.cli.options import COMMANDS

    named_otherwise = {}
    for name, command in COMMANDS.items():
        for option in command.params:
            if isinstance(option, click.Option) and option.envvar:
                expected = "LENGTHWISE_" + option.opts[0].lstrip("-").replace("-", "_").upper()
                if option.envvar != expected:
                    named_otherwise[f"{name} {option.opts[0]}"] = option.envvar
    assert not named_otherwise
    for option in ("--max-batch-tokens", "--max-batch-rows", "--torch-threads", "--sample-rows"):
        takers = [name for name, command in COMMANDS.items() if any(option in p.opts for p in command.params)]
        assert {"sweep"} <= set(takers), (option, takers)
    assert {"run", "sweep", "loadtest"} <= {name for name, command in COMMANDS.items()
                                             if any("--torch-threads" in p.opts for p in command.params)}


def test_help_texts_say_what_the_tuning_and_input_options_take():
    runner = CliRunner()
    sweep_help = runner.invoke(cli, ["sweep", "--help"], terminal_width=200).output
    assert "--max-batch-tokens TOKENS|AUTO" in sweep_help and "--sample-rows" in sweep_help
    assert "--warmup-rows" in sweep_help and "--rows " not in sweep_help
    loadtest_help = runner.invoke(cli, ["loadtest", "--help"], terminal_width=200).output
    assert "default: 30s]" in loadtest_help and "30.0" not in loadtest_help
    run_help = runner.invoke(cli, ["run", "--help"], terminal_width=200).output
    assert "The input column of row ids" in run_help and "The input column of texts" in run_help
    assert "--torch-threads" in run_help and "LENGTHWISE_TORCH_THREADS" in run_help
    assert "--config" in runner.invoke(cli, ["status", "--help"]).output


def test_run_and_plan_help_give_the_cuda_token_budget_that_follows_the_model():
    """`run`, `plan` and the load test's batcher scale the CUDA default with the model (MiniLM gets
    262,144): one setup settles it for all of them."""
    def help_text(command: str) -> str:  # one line, as the words read (a wrap may break after a hyphen)
        return re.sub(r"-\s+", "-", " ".join(CliRunner().invoke(cli, [command, "--help"]).output.split()))

    for command in ("run", "plan"):
        assert "32768 at BERT-base's, 262144 for all-MiniLM-L6-v2" in help_text(command), command
        assert "32768 on CUDA" not in help_text(command), command
    assert "follows the model's size (32768 at BERT-base's)" in help_text("loadtest")
    assert "flat" not in help_text("loadtest")


def test_sweep_takes_auto_for_the_setting_it_holds_fixed(tmp_path):
    from pipeline.cli.tuning_commands import sweep

    with sweep.make_context("sweep", ["--input", "x", "--vary", "max-batch-rows", "--values", "8,16", "--out",
                                      str(tmp_path / "s.csv"), "--max-batch-tokens", "auto"]) as context:
        assert context.params["max_batch_tokens"] is None and context.params["rows"] == 2000
    with sweep.make_context("sweep", ["--input", "x", "--vary", "max-batch-rows", "--values", "8", "--out",
                                      str(tmp_path / "s.csv"), "--max-batch-tokens", "4096", "--sample-rows",
                                      "50"]) as context:
        assert context.params["max_batch_tokens"] == 4096 and context.params["rows"] == 50


def test_status_reads_its_output_from_the_config_file(tmp_path):
    (tmp_path / "job.toml").write_text(f'input = "in"\noutput = "{tmp_path / "nothing-here"}"\njob = "embed"\n')
    result = CliRunner().invoke(cli, ["status", "--config", str(tmp_path / "job.toml")])
    assert result.exit_code == 2
    assert f"{tmp_path / 'nothing-here'} has no lengthwise run" in result.output
