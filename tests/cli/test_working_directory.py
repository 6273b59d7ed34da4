"""`status` and `verify` from any working directory (an Airflow task runs in a temporary one):
run.json records the input and output as absolute URLs, whatever the run was given."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.offline.manifest import absolute_url
from tests.conftest import write_shards

LENGTHWISE = str(Path(sys.executable).parent / "lengthwise")


def test_a_local_path_is_made_absolute_and_other_urls_are_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_url("night1") == f"{tmp_path}/night1"
    assert absolute_url("in/*.parquet") == f"{tmp_path}/in/*.parquet"
    assert absolute_url("./out/") == f"{tmp_path}/out"
    assert absolute_url("file://rel") == f"{tmp_path}/rel"
    assert absolute_url("/data/in") == "/data/in"
    for url in ("s3://bucket/in/", "memory://out", "simplecache::s3://bucket/in"):
        assert absolute_url(url) == url


def lengthwise(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([LENGTHWISE, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


@pytest.fixture
def relative_run(tmp_path, monkeypatch, sample_table, tiny_encoder_path):
    """A run given relative --input and --output in tmp_path/job; the run.json it wrote."""
    job = tmp_path / "job"
    write_shards(job / "night1", sample_table.slice(0, 30), [10, 20])
    monkeypatch.chdir(job)
    result = CliRunner().invoke(cli, ["run", "--input", "night1", "--output", "out", "--model", tiny_encoder_path,
                                      "--max-length", "32", "--no-probe", "--tokenize-workers", "0"])
    assert result.exit_code == 0, result.output
    return job, json.loads((job / "out" / ".lengthwise" / "run.json").read_text())


@pytest.mark.slow
def test_status_and_verify_answer_from_another_directory_with_only_the_output(tmp_path, relative_run):
    job, recorded = relative_run
    assert recorded["config"]["input"] == [str(job / "night1")]
    assert recorded["config"]["output"] == str(job / "out")
    elsewhere = tmp_path / "airflow-task-dir"
    elsewhere.mkdir()
    status = lengthwise("status", "--output", str(job / "out"), cwd=elsewhere)
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[0] == f"{job / 'out'}: 2 of 2 shards done, 0 failed, 0 pending; 30 of 30 rows done"
    as_json = json.loads(lengthwise("status", "--output", str(job / "out"), "--json", cwd=elsewhere).stdout)
    assert (as_json["done"], as_json["shards"]) == (2, 2)  # the documented sensor sees "done"
    verify = lengthwise("verify", "--output", str(job / "out"), cwd=elsewhere)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert verify.stdout.startswith(f"{job / 'out'}: complete: 2 of 2 shards agree with the input; 30 rows")


@pytest.mark.slow
def test_a_run_json_of_an_older_version_with_a_relative_input_says_where_to_run(tmp_path, relative_run):
    job, recorded = relative_run
    recorded["config"]["input"] = ["night1"]  # as lengthwise recorded it before
    (job / "out" / ".lengthwise" / "run.json").write_text(json.dumps(recorded))
    status = lengthwise("status", "--output", str(job / "out"), cwd=tmp_path)
    assert status.returncode == 2
    assert status.stderr == ("error: input 'night1' does not exist; check --input; run.json records the input "
                             "'night1' relative to the directory of the run that wrote it: run this from that "
                             "directory, or give --input (verify)\n")
    assert lengthwise("status", "--output", str(job / "out"), cwd=job).returncode == 0
    verify = lengthwise("verify", "--output", str(job / "out"), "--input", str(job / "night1"), cwd=tmp_path)
    assert verify.returncode == 0, verify.stdout + verify.stderr
