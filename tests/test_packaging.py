"""lengthwise as a user installs it: every package in the wheel, the sample shipped as package
data for `run --demo`, `lengthwise --version`, the exit codes in `run --help`, and a progress
bar only on a terminal. The whole install (a fresh venv, the wheel non-editable, the demo
from another directory) is `.ci/wheel-check`, run by CI."""

import importlib.metadata
import io
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.offline.options import show_progress
from pipeline.sample_data import SAMPLE_DIR

ROOT = Path(__file__).resolve().parents[1]
LENGTHWISE = str(Path(sys.executable).parent / "lengthwise")


def build_wheel(destination: Path) -> Path:
    """The wheel of a copy of the sources (a build in the checkout would leave build/ there)."""
    source = destination / "src"
    source.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("pipeline", "jobs"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    try:  # the installed setuptools where it is recent enough: no download
        isolation = [] if int(importlib.metadata.version("setuptools").split(".")[0]) < 68 else ["--no-build-isolation"]
    except importlib.metadata.PackageNotFoundError:
        isolation = []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(destination),
                    str(source)], check=True, capture_output=True, timeout=300)
    [wheel] = destination.glob("lengthwise-*.whl")
    return wheel


@pytest.mark.slow
def test_the_wheel_holds_every_package_the_sample_data_and_the_command(tmp_path):
    wheel = zipfile.ZipFile(build_wheel(tmp_path))
    names = set(wheel.namelist())
    packages = sorted(path.parent.relative_to(ROOT).as_posix() for top in ("pipeline", "jobs")
                      for path in (ROOT / top).rglob("__init__.py") if "__pycache__" not in path.parts)
    assert {"pipeline", "pipeline/cli", "pipeline/core", "pipeline/engines", "pipeline/offline", "pipeline/online",
            "pipeline/tuning", "pipeline/sample_data", "jobs"} <= set(packages)
    missing = [f"{package}/{module.name}" for package in packages for module in (ROOT / package).glob("*.py")
               if f"{package}/{module.name}" not in names]
    assert missing == []
    shipped = sorted(name for name in names if name.startswith("pipeline/sample_data/"))
    assert [n for n in shipped if not n.endswith(".py")] == [
        "pipeline/sample_data/README.md", "pipeline/sample_data/stdlib-docs-00000.parquet",
        "pipeline/sample_data/stdlib-docs-00001.parquet"]
    assert not [name for name in names if name.startswith(("tests/", "benchmarks/", "configs/"))]
    [entry_points] = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    assert "lengthwise = pipeline.cli:main" in wheel.read(entry_points).decode()


def test_lengthwise_version_names_the_installed_version():
    version = importlib.metadata.version("lengthwise")
    result = subprocess.run([LENGTHWISE, "--version"], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (0, f"lengthwise, version {version}\n")


def test_run_help_lists_every_exit_code():
    result = CliRunner().invoke(cli, ["run", "--help"])
    assert result.exit_code == 0
    lines = [line.strip() for line in result.output.split("Exit codes:")[1].split("Options:")[0].splitlines()]
    assert [line.split()[0] for line in lines if line and line[0].isdigit()] == ["0", "1", "2", "3", "4", "130", "143"]
    assert "4    the output's storage refused a write" in result.output


class Stream(io.StringIO):
    def __init__(self, terminal: bool):
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


@pytest.mark.parametrize("asked, terminal, shown", [
    (None, True, True), (None, False, False), (True, False, True), (False, True, False)])
def test_the_progress_bar_is_shown_on_a_terminal_unless_asked(asked, terminal, shown):
    assert show_progress(asked, Stream(terminal)) is shown


def test_a_stream_without_isatty_gets_no_bar():
    assert show_progress(None, object()) is False


def demo_args(output, model, *extra) -> list[str]:
    return ["run", "--demo", "--output", str(output), "--model", model, "--max-length", "32", "--no-probe",
            "--tokenize-workers", "0", *extra]


@pytest.mark.slow
def test_the_demo_runs_the_packaged_sample_and_a_log_gets_no_progress_bar(tmp_path, tiny_encoder_path):
    result = CliRunner().invoke(cli, demo_args(tmp_path / "demo", tiny_encoder_path))  # stderr: not a terminal
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "demo").glob("*.parquet")) == [
        "stdlib-docs-00000.parquet", "stdlib-docs-00001.parquet"]
    assert sum(pq.read_metadata(p).num_rows for p in (tmp_path / "demo").glob("*.parquet")) == 400
    recorded = json.loads((tmp_path / "demo" / ".lengthwise" / "run.json").read_text())["config"]
    assert recorded["input"] == [SAMPLE_DIR] and recorded["progress"] is False
    assert "rows/s]" not in result.stderr  # no tqdm bar in the log

    asked = CliRunner().invoke(cli, demo_args(tmp_path / "asked", tiny_encoder_path, "--progress"))
    assert asked.exit_code == 0, asked.output
    assert "rows/s]" in asked.stderr


def test_demo_with_an_input_is_a_usage_error(tmp_path, tiny_encoder_path):
    result = CliRunner().invoke(cli, demo_args(tmp_path / "demo", tiny_encoder_path, "--input", str(tmp_path)))
    assert result.exit_code == 2
    assert result.stderr == "error: --demo reads the packaged sample; drop --input (or `input` in the --config file)\n"
    assert not (tmp_path / "demo").exists()
