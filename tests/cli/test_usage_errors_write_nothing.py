"""A usage error (exit 2) leaves the output untouched, so the corrected command just runs; a
KEY=VALUE flag overrides its --config table key by key."""

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from tests.conftest import write_shards


@pytest.fixture
def shards(tmp_path, sample_table):
    rows = sample_table.slice(0, 30)
    rows = rows.append_column("truncated", rows["text"])  # a name the output has too
    write_shards(tmp_path / "in", rows, [10, 20])
    return tmp_path / "in"


def invoke(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones too) → sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


USAGE_ERRORS = {
    "max length beyond the model": (["--max-length", "100000"],
                                    "more than the 512 tokens this bert model takes (512 positions); "
                                    "set --max-length 512 or less"),
    "missing model": (["--model", "/nowhere/model"], "is not a Hugging Face model folder"),
    "threshold of no label": (["--job", "moderate", "--threshold", "toxc=0.8"], "not a label of this model"),
    "threshold out of range": (["--job", "moderate", "--threshold", "toxic=1.5"], "outside 0…1"),
    "threshold without score": (["--job", "moderate", "--threshold", "toxic"], "is not LABEL=SCORE"),
    "kept column taken": (["--keep-columns", "truncated"], "the output already has a column of that name"),
    "missing text column": (["--text-column", "body"], "has no column 'body'"),
    "unknown job": (["--job", "summarise"], "set --job to one of"),
    "unknown prompt name": (["--prompt-name", "query"], "query"),
    "ray with num-shards": (["--engine", "ray", "--num-shards", "2", "--shard-index", "0"], "drop --num-shards"),
    "reuse of no output": (["--reuse", "/nowhere/yesterday"], "is no lengthwise output"),
}


# Found only after the model loads and the memory plan is probed: a whole run's start, and the same refusal on a
# finished output stays in the fast loop (test_a_usage_error_on_a_finished_output_changes_no_byte_of_it)
FOUND_AFTER_THE_PROBE = {"kept column taken"}


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case in FOUND_AFTER_THE_PROBE else case
                                  for case in sorted(USAGE_ERRORS)])
def test_a_usage_error_exits_2_and_leaves_a_new_output_uncreated(tmp_path, shards, tiny_multilabel_path,
                                                                 tiny_encoder_path, case):
    extra, message = USAGE_ERRORS[case]
    model = tiny_multilabel_path if "moderate" in extra else tiny_encoder_path
    output = tmp_path / "out"
    result = invoke(["run", "--input", str(shards), "--output", str(output), "--model", model, "--no-progress",
                     "--tokenize-workers", "0", *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not output.exists(), sorted(str(p) for p in output.rglob("*"))


def test_the_corrected_command_runs_into_the_output_a_usage_error_left(tmp_path, shards, tiny_encoder_path):
    output = tmp_path / "out"
    base = ["run", "--input", str(shards), "--output", str(output), "--model", tiny_encoder_path, "--no-progress",
            "--tokenize-workers", "0"]
    assert invoke([*base, "--max-length", "100000"]).exit_code == 2
    result = invoke([*base, "--max-length", "64"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in output.glob("*.parquet")) == ["part-00000.parquet", "part-00001.parquet"]


@pytest.mark.parametrize("extra", [["--max-length", "100000"], ["--max-length", "32"],
                                   ["--keep-columns", "truncated"]])
def test_a_usage_error_on_a_finished_output_changes_no_byte_of_it(tmp_path, shards, tiny_encoder_path, extra):
    output = tmp_path / "out"
    base = ["run", "--input", str(shards), "--output", str(output), "--model", tiny_encoder_path, "--no-progress",
            "--tokenize-workers", "0", "--max-length", "64"]
    assert invoke(base).exit_code == 0
    before = tree_digest(output)
    result = invoke([*base, *extra])
    assert result.exit_code == 2, result.output
    assert tree_digest(output) == before


@pytest.mark.slow
def test_a_threshold_flag_overrides_the_config_table_per_label(tmp_path, shards, tiny_multilabel_path):
    config = tmp_path / "job.toml"
    config.write_text(f'input = "{shards}"\njob = "moderate"\nmodel = "{tiny_multilabel_path}"\n'
                      'tokenize_workers = 0\nprogress = false\n'
                      '[thresholds]\ntoxic = 0.6\ninsult = 0.7\n')
    result = invoke(["run", "--config", str(config), "--output", str(tmp_path / "out"), "--threshold", "insult=0.8",
                     "--threshold", "threat=0.9"])
    assert result.exit_code == 0, result.output
    recorded = json.loads((tmp_path / "out" / ".lengthwise" / "run.json").read_text())
    assert recorded["config"]["thresholds"] == {"toxic": 0.6, "insult": 0.8, "threat": 0.9}
    assert recorded["fingerprint"]["thresholds"] == {"toxic": 0.6, "insult": 0.8, "threat": 0.9}


def test_a_storage_flag_overrides_the_config_table_per_key(tmp_path, shards, tiny_encoder_path):
    from pipeline.cli.job_commands import run as run_command

    config = tmp_path / "job.toml"
    config.write_text('[storage]\nanon = true\nendpoint_url = "http://127.0.0.1:1"\n')
    with run_command.make_context("run", ["--config", str(config), "--storage-option",
                                          "endpoint_url=http://127.0.0.1:2"]) as context:
        pairs = context.params["storage_option"]
    from pipeline.offline.options import parse_storage_options

    assert parse_storage_options(pairs) == {"anon": True, "endpoint_url": "http://127.0.0.1:2"}
    with run_command.make_context("run", ["--config", str(config)]) as context:
        assert parse_storage_options(context.params["storage_option"]) == {"anon": True,
                                                                             "endpoint_url": "http://127.0.0.1:1"}
