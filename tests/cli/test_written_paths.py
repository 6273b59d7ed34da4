"""No path a command writes lands in what it reads or in the output: every writing flag of every
command (run, plan, sweep, loadtest; status and verify write nothing) and the API's run are refused
with exit 2 and one line before anything is written, the file they name left byte for byte."""

import os
import shutil

import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.core.errors import UsageError
from tests.cli.test_usage_errors_write_nothing import tree_digest
from tests.conftest import write_shards

INSIDE_THE_INPUT = "is inside the input"
INSIDE_THE_OUTPUT = "is inside --output"


@pytest.fixture
def places(tmp_path, sample_table, tiny_encoder_path):
    """in/ (two shards), out/ (an earlier output's files), yesterday/ (a --reuse), a copy of the tiny
    model, an earlier sweep CSV, a symlink to in/, and rows.json: a file an input may be."""
    write_shards(tmp_path / "in", sample_table.slice(0, 30), [10, 20])
    for name in ("out", "yesterday"):
        shutil.copytree(tmp_path / "in", tmp_path / name)
        (tmp_path / name / ".lengthwise").mkdir()
        (tmp_path / name / ".lengthwise" / "run.json").write_text('{"fingerprint": {}}\n')
    (tmp_path / "out" / "_summary.json").write_text("{}\n")
    (tmp_path / "out" / "sub").mkdir()
    (tmp_path / "out" / "sub" / "x.json").write_text("{}\n")
    shutil.copytree(tiny_encoder_path, tmp_path / "model")
    (tmp_path / "previous.csv").write_text("level,rows_per_s\n")
    (tmp_path / "rows.json").write_text('{"id": 1, "text": "a"}\n')
    os.symlink(tmp_path / "in", tmp_path / "alias")
    return tmp_path


RUN = ["run", "--input", "in", "--output", "out", "--model", "model", "--no-progress", "--tokenize-workers", "0"]
PLAN = ["plan", "--model", "model"]
ESTIMATE = ["plan", "--estimate", "--input", "in", "--model", "model"]
SWEEP = ["sweep", "--input", "in", "--model", "model", "--vary", "max-batch-tokens", "--values", "512",
         "--out", "sweep.csv"]
LOADTEST = ["loadtest", "--input", "in", "--model", "model", "--vary", "max-batch-size", "--values", "1",
            "--out", "load.csv"]

# command line, the flag and path it writes (as the message shows them), and why it is refused
REFUSED = {
    "run summary into an input shard": (RUN, "--summary-json", "in/part-00000.parquet", INSIDE_THE_INPUT),
    "run summary as the input folder": (RUN, "--summary-json", "in", "is the input in"),
    "run summary into the input through a symlink": (RUN, "--summary-json", "alias/part-00000.parquet",
                                                     INSIDE_THE_INPUT),
    "run summary into the input through ..": (RUN, "--summary-json", "out/../in/s.json", INSIDE_THE_INPUT),
    "run summary into an input glob's folder": ([*RUN[:2], "in/*.parquet", *RUN[3:]], "--summary-json", "in/s.json",
                                                "is inside the input in/*.parquet"),
    "run summary over an output shard": (RUN, "--summary-json", "out/part-00000.parquet", INSIDE_THE_OUTPUT),
    "run summary over the manifest": (RUN, "--summary-json", "out/.lengthwise/run.json", INSIDE_THE_OUTPUT),
    "run summary as the manifest folder": (RUN, "--summary-json", "out/.lengthwise", INSIDE_THE_OUTPUT),
    "run summary not hidden in the output": (RUN, "--summary-json", "out/_summary.json", INSIDE_THE_OUTPUT),
    "run summary below the output": (RUN, "--summary-json", "out/sub/x.json", INSIDE_THE_OUTPUT),
    "run summary as the output": (RUN, "--summary-json", "out", "is --output out"),
    "run summary into the reused output": ([*RUN, "--reuse", "yesterday"], "--summary-json",
                                           "yesterday/part-00000.parquet", "is inside --reuse yesterday"),
    "run summary into the model": (RUN, "--summary-json", "model/config.json", "is inside --model model"),
    "run plan cache in the input": (RUN, "--plan-cache", "in/plans", INSIDE_THE_INPUT),
    "run plan cache as the output": (RUN, "--plan-cache", "out", "is --output out"),
    "plan's plan cache in the model": (PLAN, "--plan-cache", "model/plans", "is inside --model model"),
    "estimate's plan cache in the input": (ESTIMATE, "--plan-cache", "in/plans", INSIDE_THE_INPUT),
    "estimate's plan cache in the reused output": ([*ESTIMATE, "--reuse", "yesterday"], "--plan-cache",
                                                   "yesterday/.plans", "is inside --reuse yesterday"),
    "sweep csv in the input": (SWEEP, "--out", "in/sweep.csv", INSIDE_THE_INPUT),
    "sweep csv over the compared one": ([*SWEEP, "--compare", "previous.csv"], "--out", "previous.csv",
                                        "is --compare previous.csv"),
    "sweep OUT.json over an input file": ([*SWEEP, "--input", "rows.json"], "--out", "rows.json",
                                          "is the input rows.json"),
    "sweep plot in the input": (SWEEP, "--plot", "in/sweep.png", INSIDE_THE_INPUT),
    "sweep plan cache in the input": (SWEEP, "--plan-cache", "alias/plans", INSIDE_THE_INPUT),
    "loadtest csv in the input": (LOADTEST, "--out", "in/load.csv", INSIDE_THE_INPUT),
    "loadtest csv over the compared one": ([*LOADTEST, "--compare", "previous.csv"], "--out", "previous.csv",
                                           "is --compare previous.csv"),
    "loadtest plot over an input shard": (LOADTEST, "--plot", "in/part-00001.parquet", INSIDE_THE_INPUT),
    "loadtest plan cache in the model": (LOADTEST, "--plan-cache", "model", "is --model model"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_path_written_into_what_a_command_reads_or_into_the_output_exits_2_and_writes_nothing(
        places, monkeypatch, case):
    command, flag, path, why = REFUSED[case]
    monkeypatch.chdir(places)
    written = path.removesuffix(".json") if "OUT.json" in case else path  # --out X writes X and X.json
    before = tree_digest(places)
    result = CliRunner().invoke(cli, [*command, flag, written], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} {path} {why}"), result.stderr
    assert tree_digest(places) == before  # the target byte for byte, and nothing else written


def test_the_refusals_say_what_to_do(places, monkeypatch):
    monkeypatch.chdir(places)
    result = CliRunner().invoke(cli, [*RUN, "--summary-json", "in/s.json"])
    assert result.stderr == ("error: --summary-json in/s.json is inside the input in: it could replace what is read "
                             "there, or be read as it; choose a path outside it\n")
    result = CliRunner().invoke(cli, [*RUN, "--summary-json", "out/_summary.json"])
    assert result.stderr == ("error: --summary-json out/_summary.json is inside --output out: readers of the output, "
                             "or the run's own records, would take it for theirs; choose a path outside it, or "
                             "directly in it a name starting with `.` (out/.summary.json)\n")


@pytest.mark.parametrize("keyword, path, why", [
    ("summary_json", "in/part-00000.parquet", INSIDE_THE_INPUT),
    ("summary_json", "out/.lengthwise/run.json", INSIDE_THE_OUTPUT),
    ("plan_cache", "out/plans", INSIDE_THE_OUTPUT),
])
def test_the_api_refuses_the_same_paths_before_writing(places, monkeypatch, keyword, path, why):
    from pipeline.api import run

    monkeypatch.chdir(places)
    before = tree_digest(places)
    with pytest.raises(UsageError) as refused:
        run("in", "out", model="model", tokenize_workers=0, progress=False, **{keyword: path})
    assert str(refused.value).startswith(f"--{keyword.replace('_', '-')} {path} {why}")
    assert tree_digest(places) == before
