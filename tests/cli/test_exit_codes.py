"""The exit-code table: the one list of codes, what `run --help` and the docs say, and which
errors map to a code (only those; anything else is a bug, exit 1 with its traceback).

Each code is reached by a real command elsewhere: 0 and 2 in tests/cli/test_cli.py, 1 for failed
shards in tests/offline/test_reliability.py, 3 in tests/tuning/test_sweep.py and tests/tuning/test_online_loadtest.py,
4 in tests/offline/test_storage_faults.py, 130 and 143 in tests/cli/test_interrupts.py."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.core.errors import StorageError, UsageError
from pipeline.core.exit_codes import EXIT_CODES, exit_code_for
from tests.conftest import SAMPLE_DIR

ROOT = Path(__file__).resolve().parents[2]
TABLE_CODES = {row.code for row in EXIT_CODES}


def documented_codes(markdown: str, heading: str) -> set[int]:
    """The codes in the first column of the table under `heading` ("130 / 143" is two)."""
    section = markdown.split(f"\n{heading}\n", 1)[1]
    rows = re.findall(r"^\| ([0-9][0-9 /]*) \|", section.split("\n## ", 1)[0], flags=re.MULTILINE)
    return {int(code) for row in rows for code in row.split("/")}


def test_the_table_run_help_the_readme_and_operations_name_the_same_codes():
    assert TABLE_CODES == {0, 1, 2, 3, 4, 130, 143}  # the documented numbers, unchanged
    help_text = CliRunner().invoke(cli, ["run", "--help"]).output
    listed = help_text.split("Exit codes:\n", 1)[1]
    assert {int(code) for code in re.findall(r"^ {4}(\d+) ", listed, flags=re.MULTILINE)} == TABLE_CODES
    flat = " ".join(listed.split())
    for row in EXIT_CODES:
        assert f"{row.code} {row.meaning}" in flat
    assert documented_codes((ROOT / "docs" / "operations.md").read_text(), "## Exit codes in detail") == TABLE_CODES
    assert documented_codes((ROOT / "README.md").read_text(), "## Exit codes") == TABLE_CODES


def test_only_the_mapped_error_types_have_a_code():
    class ShardListMissing(UsageError):
        pass

    assert exit_code_for(UsageError("set --text-column")) == 2
    assert exit_code_for(ShardListMissing("a named usage error")) == 2
    assert exit_code_for(StorageError("no space left")) == 4
    assert exit_code_for(ValueError("a bug")) is None
    assert exit_code_for(ImportError("a bug")) is None


def test_a_plot_without_matplotlib_is_a_usage_error_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # how Python marks a package as not importable
    result = CliRunner().invoke(cli, ["sweep", "--input", str(SAMPLE_DIR), "--vary", "max-batch-rows",
                                      "--values", "1,2", "--out", str(tmp_path / "s.csv"),
                                      "--plot", str(tmp_path / "s.png")])
    assert result.exit_code == 2, result.output
    assert "error: --plot needs matplotlib: pip install 'lengthwise[plot]'" in result.output
    assert not (tmp_path / "s.csv").exists()


BROKEN_JOB = """
import sys

import jobs.registry
from jobs.embed import EmbedJob
from pipeline.cli import main


class BrokenEmbed(EmbedJob):
    name = "embed-broken"

    def forward(self, model, input_ids, attention_mask, padded=True, packing=None):
        raise ValueError("a bug in the job, reading s3://AKIDSECRET:hunter2@bucket/in/")


jobs.registry.JOBS["embed-broken"] = BrokenEmbed()
sys.argv = ["lengthwise", *sys.argv[1:]]
main()
"""


@pytest.mark.slow
def test_a_bug_exits_1_with_its_redacted_traceback_not_as_a_usage_error(tmp_path, tiny_encoder_path):
    """A ValueError deep in the sweep once read as exit 2 ("error: …"), as if a setting were wrong."""
    script = tmp_path / "broken.py"
    script.write_text(BROKEN_JOB)
    result = subprocess.run(
        [sys.executable, str(script), "sweep", "--input", str(SAMPLE_DIR), "--model", tiny_encoder_path,
         "--job", "embed-broken", "--vary", "max-batch-rows", "--values", "4", "--sample-rows", "8",
         "--warmup-rows", "0", "--max-length", "16", "--tokenize-workers", "0", "-q",
         "--plan-cache", str(tmp_path / "cache"), "--out", str(tmp_path / "s.csv")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1, result.stderr
    assert "Traceback" in result.stderr and "ValueError: a bug in the job" in result.stderr
    assert "hunter2" not in result.stderr and "AKIDSECRET" not in result.stderr
    assert "error: " not in result.stderr  # no one-line usage error
    assert not (tmp_path / "s.csv").exists()


def test_one_handler_maps_the_tables_errors_to_their_codes_and_lets_a_bug_pass(capsys):
    """Every command ends through `exit_on_known_errors`: the table's errors exit with its code and one line;
    an error met reaching a storage path stands for one; anything else is a bug and passes as it is."""
    import errno

    from pipeline.cli.options import exit_on_known_errors

    def code_of(error: BaseException, path: str | None = None) -> int:
        with pytest.raises(SystemExit) as ended:
            with exit_on_known_errors(path):
                raise error
        return ended.value.code

    assert code_of(UsageError("set --output")) == 2 and capsys.readouterr().err == "error: set --output\n"
    assert code_of(StorageError("bucket down")) == 4 and capsys.readouterr().err == "error: bucket down\n"
    assert code_of(OSError(errno.ENOSPC, "No space left on device"), "out/") == 4
    assert capsys.readouterr().err.startswith("error: out/: no space left")
    with pytest.raises(OSError):  # without the path it reached, an OSError is not known to be the storage's
        with exit_on_known_errors():
            raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(KeyError):
        with exit_on_known_errors("out/"):
            raise KeyError("a bug")
