"""pipeline.api.run: the CLI's options as keywords, a summary dict back, exceptions instead of exits;
and scripts run as real processes: with a main guard, without one, and inside an asyncio loop."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.api import run
from pipeline.core.errors import UsageError
from pipeline.offline.summary import RunSummary
from tests.conftest import read_outputs, write_shards

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, sample_table) -> Path:
    rows = sample_table.slice(0, 60)
    table = rows.append_column("label", pa.array([i % 2 for i in range(60)], pa.int64()))
    directory = tmp_path_factory.mktemp("api") / "in"
    write_shards(directory, table, [30, 30])
    return directory


FAST = dict(tokenize_workers=0, dtype="float32", progress=False, max_length=64)


def test_run_takes_the_flags_as_keywords_and_returns_the_summary(tmp_path, shards, tiny_encoder_path):
    summary = run(str(shards), str(tmp_path / "out"), model=tiny_encoder_path, keep_columns=["label"],
                  summary_json=str(tmp_path / "summary.json"), probe=False, **FAST)
    assert set(summary) == {field.name for field in dataclasses.fields(RunSummary)}
    assert summary["rows"] == 60 and summary["failed_shards"] == []
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert read_outputs(tmp_path / "out").column_names == ["id", "label", "embedding", "truncated", "error"]
    assert summary["batch_plan"] == "token and row limits only (no memory plan)"  # probe=False came through
    again = run([str(shards)], str(tmp_path / "out"), model=tiny_encoder_path, keep_columns=["label"], **FAST)
    assert again["shards_done_before"] == 2 and again["rows"] == 0


@pytest.mark.slow
def test_run_moderates_with_thresholds_as_a_dict(tmp_path, shards, tiny_multilabel_path):
    summary = run(str(shards), str(tmp_path / "out"), job="moderate", model=tiny_multilabel_path,
                  threshold={"toxic": 0.0, "threat": 1.0}, flag_labels=["toxic", "threat"], **FAST)
    assert summary["flagged_rows"] == 60 and summary["flagged_by_label"] == {"toxic": 60, "threat": 0}


@pytest.mark.parametrize("options, message", [
    (dict(max_lenght=64), "run() has no option 'max_lenght'; options: "),
    (dict(max_length=0), "0 is not in the range x>=1"),
    (dict(keep_columns=["nope"]), "has no column 'nope' to keep"),
    (dict(job="moderate", threshold={"toxc": 0.5}), "'toxc', not a label of this model"),
    (dict(probe="yes"), "probe='yes': give True or False"),
])
def test_bad_options_raise_usage_errors_not_exits(tmp_path, shards, tiny_multilabel_path, options, message):
    settings = {**FAST, "model": tiny_multilabel_path, **options}
    with pytest.raises(UsageError) as raised:
        run(str(shards), str(tmp_path / "out"), **settings)
    assert message in str(raised.value)
    assert not list((tmp_path / "out").glob("*.parquet"))


SCRIPT = """
from pipeline.api import run

{body}
"""


def run_script(tmp_path, name: str, body: str, as_code: bool = False, timeout_s: float = 240):
    """Run a Python script as its own process, with tokenizer workers; (exit code, output, seconds)."""
    source = SCRIPT.format(body=textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    if as_code:  # like a notebook cell: __main__ has no file for the workers to re-run
        done = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, env=env,
                              timeout=timeout_s, cwd=tmp_path)
    else:
        script = tmp_path / f"{name}.py"
        script.write_text(source)
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                              timeout=timeout_s, cwd=tmp_path)
    return done.returncode, done.stdout + done.stderr, time.perf_counter() - started


def call(shards, output, model) -> str:
    return (f"run({str(shards)!r}, {str(output)!r}, model={model!r}, tokenize_workers=2, dtype='float32', "
            f"progress=False, max_length=64)")


@pytest.mark.slow
def test_a_guarded_script_runs_with_tokenizer_workers(tmp_path, shards, tiny_encoder_path):
    code, output, _ = run_script(tmp_path, "guarded", f"""
        if __name__ == "__main__":
            print("ROWS", {call(shards, tmp_path / "out", tiny_encoder_path)}["rows"])
        """)
    assert code == 0, output
    assert "ROWS 60" in output


@pytest.mark.slow
def test_an_unguarded_script_fails_at_once_in_the_parent_even_inside_try_except(tmp_path, shards, tiny_encoder_path):
    """Without the guard each spawned worker would run the script again; a try/except around
    the call used to swallow the workers' errors and the run succeeded after three bodies."""
    code, output, seconds = run_script(tmp_path, "unguarded", f"""
        print("BODY")
        try:
            print("ROWS", {call(shards, tmp_path / "out", tiny_encoder_path)}["rows"])
        except Exception as error:
            print("CAUGHT", type(error).__name__, error)
        """)
    assert code == 0, output
    assert output.count("BODY") == 1 and output.count("CAUGHT") == 1 and "ROWS" not in output
    assert "CAUGHT UsageError lengthwise is called at the top level of" in output
    assert 'outside `if __name__ == "__main__":`' in output and "tokenize_workers=0" in output
    assert not (tmp_path / "out").exists(), "the refused call touched the output"
    print(f"unguarded script refused after {seconds:.1f}s (process start to exit)")


def test_a_guarded_call_and_a_call_without_a_script_file_are_not_refused(tmp_path):
    from pipeline.api import unguarded_main_call_line

    script = tmp_path / "job.py"
    script.write_text("import sys\nfrom pipeline.api import unguarded_main_call_line as where\n"
                      "TOP = where(sys._getframe())\n"
                      "if __name__ == '__main__':\n    GUARDED = where(sys._getframe())\n"
                      "    print(TOP[1], GUARDED)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.split() == ["3", "None"], done.stderr
    assert unguarded_main_call_line(sys._getframe()) is None  # pytest's own main is guarded


def test_run_async_keeps_the_event_loop_ticking_while_the_job_runs(tmp_path, shards, tiny_encoder_path):
    import asyncio

    from pipeline.api import run_async

    async def main():
        ticks_during_the_run = 0
        running = True

        async def ticker():
            nonlocal ticks_during_the_run
            while running:
                await asyncio.sleep(0.005)
                ticks_during_the_run += 1

        task = asyncio.create_task(ticker())
        summary = await run_async(str(shards), str(tmp_path / "out"), model=tiny_encoder_path, probe=False, **FAST)
        running = False
        await task
        return summary, ticks_during_the_run

    summary, ticks = asyncio.run(main())
    assert summary["rows"] == 60 and summary["failed_shards"] == []
    assert ticks >= 3, "the loop stood still while the job ran"
    with pytest.raises(UsageError, match="run\\(\\) has no option 'max_lenght'"):
        asyncio.run(run_async(str(shards), str(tmp_path / "other"), max_lenght=64))


@pytest.mark.slow
def test_a_call_from_a_running_asyncio_loop_in_a_notebook_like_main(tmp_path, shards, tiny_encoder_path):
    code, output, _ = run_script(tmp_path, "notebook", f"""
        import asyncio

        async def cell():
            return {call(shards, tmp_path / "out", tiny_encoder_path)}

        print("ROWS", asyncio.run(cell())["rows"])
        """, as_code=True)
    assert code == 0, output
    assert "ROWS 60" in output
