"""Two jobs on one machine: other lengthwise jobs are found (real processes), the diagnosis
says the machine is oversubscribed, and `run --torch-threads` / LENGTHWISE_TORCH_THREADS
sets the forward's threads."""

import json
import subprocess
import sys

import torch
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.offline.diagnosis import diagnose_run
from pipeline.offline.machine import is_lengthwise_job, machine_load, other_jobs
from tests.conftest import write_shards


def test_lengthwise_jobs_are_told_by_their_command_line():
    assert is_lengthwise_job(["/venv/bin/python", "/venv/bin/lengthwise", "run", "--input", "x"])
    assert is_lengthwise_job(["python", "-m", "pipeline.cli", "sweep", "--vary", "max-batch-tokens"])
    assert not is_lengthwise_job(["/venv/bin/lengthwise", "status", "--output", "x"])
    assert not is_lengthwise_job(["python", "-m", "pytest", "tests/run.py"])
    assert not is_lengthwise_job(["ray::ShardWorker.run_shard"])


def test_other_jobs_leave_out_this_process_its_ancestors_and_descendants():
    job = ["lengthwise", "run"]
    argvs = {1: ["init"], 10: job, 11: job, 12: ["python", "tokenizer"], 20: job, 30: job}
    parents = {10: 1, 11: 10, 12: 11, 20: 1, 30: 20}  # 11 is me, run by 10; 30 is another job's child
    assert other_jobs(argvs, parents, me=11) == [20, 30]


def test_another_lengthwise_job_on_this_machine_is_found():
    started = subprocess.run(["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(60)' lengthwise run "
                                          ">/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True)
    other = int(started.stdout)  # not a child of this process: its shell has exited
    try:
        load = machine_load()
        assert other in load["other_jobs"] and load["load_average"] >= 0
    finally:
        subprocess.run(["kill", str(other)])


def summary_with(**settings) -> dict:
    return {"rows": 1000, "settings": {"cores": 2, "torch_threads": 2, "tokenize_workers": 2, **settings}}


def test_oversubscription_is_diagnosed_with_each_jobs_share_of_the_cores():
    [finding] = diagnose_run(summary_with(other_jobs=[4242], load_average=5.3))
    assert finding.code == "oversubscribed"
    assert finding.evidence == ("1 other lengthwise job(s) ran on this machine (pid 4242); load average 5.3 on 2 "
                                "cores, this run's own threads 4 (2 torch, 2 tokenizer workers)")
    assert "--torch-threads 1 and --tokenize-workers 0" in finding.action
    [busy] = diagnose_run(summary_with(other_jobs=[], load_average=6.5))  # 6.5 > own 4 + 2 cores
    assert busy.evidence.startswith("other work ran on this machine; load average 6.5")
    assert diagnose_run(summary_with(other_jobs=[], load_average=5.9)) == []  # this run alone can load it so
    assert diagnose_run({**summary_with(other_jobs=[1]), "rows": 0}) == []  # nothing ran


def test_torch_threads_of_a_run_come_from_the_flag_or_its_environment_variable(tmp_path, sample_table,
                                                                               tiny_encoder_path, monkeypatch):
    """... and hold for the run only: a script's later forwards run on its own thread count again (a run through
    the API that left one thread behind made an in-process run after it differ from a fresh process in the
    last bits)."""
    write_shards(tmp_path / "in", sample_table.slice(0, 10), [10])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setenv("LENGTHWISE_TORCH_THREADS", "1")
    try:
        result = CliRunner().invoke(cli, ["run", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                                          "--model", tiny_encoder_path, "--no-progress", "--tokenize-workers", "0",
                                          "--no-probe", "--summary-json", str(tmp_path / "s.json")])
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    assert after == 2
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["settings"]["torch_threads"] == 1
    assert json.loads((tmp_path / "out" / ".lengthwise" / "run.json").read_text())["config"]["torch_threads"] == 1
