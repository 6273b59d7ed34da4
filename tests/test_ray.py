"""`--engine ray` on a real local Ray cluster (one, shared by these tests): equal outputs,
an actor killed mid-shard, a driver killed and rerun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.core.settings import RunConfig
from pipeline.engines.ray import actor_layout
from tests.conftest import assert_equal_outputs, read_outputs, write_shards

BIN = Path(sys.executable).parent
SIX_SHARDS = [40, 30, 0, 50, 45, 35]


@pytest.fixture(scope="session")
def ray_cluster():
    """A real Ray head on this machine, 2 CPUs, no dashboard; `auto` finds it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)
    started = subprocess.run([str(BIN / "ray"), "start", "--head", "--num-cpus=2", "--num-gpus=0",
                              "--include-dashboard=false", "--disable-usage-stats", "--object-store-memory=100000000"],
                             env=env, capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, started.stdout + started.stderr
    yield "auto"
    subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)


def ray_args(inputs: Path, output: Path, model: str, *extra: str) -> list[str]:
    return ["run", "--engine", "ray", "--ray-address", "auto", "--workers", "2", "--threads-per-worker", "1",
            "--input", str(inputs), "--output", str(output), "--model", model, "--max-length", "128",
            "--no-progress", "--tokenize-workers", "0", "--dtype", "float32", *extra]


def local_reference(tmp_path: Path, table: pa.Table, sizes: list[int], model: str, *extra: str) -> pa.Table:
    write_shards(tmp_path / "local-in", table, sizes)
    result = CliRunner().invoke(cli, ["run", "--input", str(tmp_path / "local-in"), "--output",
                                      str(tmp_path / "local-out"), "--model", model, "--max-length", "128",
                                      "--no-progress", "--tokenize-workers", "0", "--dtype", "float32", *extra])
    assert result.exit_code == 0, result.output
    return read_outputs(tmp_path / "local-out")


def test_actors_follow_the_cluster():
    config = RunConfig(input=(), output="")
    assert actor_layout(config, {"GPU": 4.0, "CPU": 64.0}, 100) == (4, {"num_gpus": 1, "num_cpus": 1}, None)
    assert actor_layout(config, {"GPU": 4.0, "CPU": 64.0}, 3)[0] == 3  # never more actors than shards
    assert actor_layout(config, {"CPU": 8.0}, 100) == (8, {"num_cpus": 1}, 1)
    four_threads = RunConfig(input=(), output="", threads_per_worker=4)
    assert actor_layout(four_threads, {"CPU": 8.0}, 100) == (2, {"num_cpus": 4}, 4)
    assert actor_layout(RunConfig(input=(), output="", workers=3), {"CPU": 8.0}, 100)[0] == 3
    cpu_only = RunConfig(input=(), output="", device="cpu")
    assert actor_layout(cpu_only, {"GPU": 2.0, "CPU": 8.0}, 100) == (8, {"num_cpus": 1}, 1)


def test_engine_ray_without_ray_is_a_usage_error_saying_what_to_install(tmp_path, monkeypatch, sample_table,
                                                                          tiny_encoder_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    write_shards(tmp_path / "in", sample_table.slice(0, 10), [10])
    result = CliRunner().invoke(cli, ray_args(tmp_path / "in", tmp_path / "out", tiny_encoder_path))
    assert result.exit_code == 2 and "pip install 'lengthwise[ray]'" in result.output


@pytest.mark.slow
def test_two_ray_actors_give_the_outputs_of_a_local_run(tmp_path, ray_cluster, rows_with_bad_ones,
                                                         tiny_encoder_path):
    expected = local_reference(tmp_path, rows_with_bad_ones, SIX_SHARDS, tiny_encoder_path)
    write_shards(tmp_path / "in", rows_with_bad_ones, SIX_SHARDS)
    result = CliRunner().invoke(cli, ray_args(tmp_path / "in", tmp_path / "out", tiny_encoder_path,
                                              "--summary-json", str(tmp_path / "s.json")))
    assert result.exit_code == 0, result.output
    assert_equal_outputs(read_outputs(tmp_path / "out"), expected)
    assert not list((tmp_path / "out").glob(".*.tmp"))
    summary = json.loads((tmp_path / "s.json").read_text())
    assert (summary["rows"], summary["error_rows"], summary["shards"]) == (200, 4, 6)
    assert len(summary["workers"]) == 2 and sum(w["shards"] for w in summary["workers"]) == 6
    assert sum(w["rows"] for w in summary["workers"]) == 200 and all(w["rows_per_s"] > 0 for w in summary["workers"])
    assert len({w["pid"] for w in summary["workers"]}) == 2 and os.getpid() not in {w["pid"] for w in
                                                                                     summary["workers"]}
    markers = [json.loads(p.read_text()) for p in (tmp_path / "out" / ".lengthwise" / "shards").glob("*.json")]
    assert sorted(m["status"] for m in markers) == ["done"] * 6
    status = json.loads(CliRunner().invoke(cli, ["status", "--output", str(tmp_path / "out"), "--json"]).output)
    assert (status["done"], status["pending"], status["rows_done"]) == (6, 0, 200)


class Driver:
    """`lengthwise run --engine ray` as a real process, its stderr read line by line."""

    def __init__(self, args: list[str]):
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.process = subprocess.Popen([str(BIN / "lengthwise"), *args], env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, timeout_s: float = 180) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = next((line for line in self.lines if text in line), None)
            if found:
                return found
            if self.process.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} in the driver's output:\n{''.join(self.lines)}")

    def finish(self, timeout_s: float = 300) -> int:
        code = self.process.wait(timeout=timeout_s)
        self.reader.join(timeout=10)
        return code


@pytest.fixture(scope="module")
def longer_rows(sample_table) -> pa.Table:
    """2,400 rows, so a shard takes long enough to be killed in the middle of it."""
    table = pa.concat_tables([sample_table] * 6)
    return table.set_column(0, "id", pa.array([f"row-{i}" for i in range(table.num_rows)]))


SLOW_SETTINGS = ("--window-rows", "64", "--max-batch-rows", "4", "--no-probe")


@pytest.mark.slow
def test_an_actor_killed_mid_shard_loses_nothing(tmp_path, ray_cluster, longer_rows, tiny_encoder_path):
    sizes = [400] * 6
    expected = local_reference(tmp_path, longer_rows, sizes, tiny_encoder_path, *SLOW_SETTINGS)
    write_shards(tmp_path / "in", longer_rows, sizes)
    driver = Driver(ray_args(tmp_path / "in", tmp_path / "out", tiny_encoder_path, *SLOW_SETTINGS))
    took = driver.wait_for(" took ")  # "actor 1 (pid 1234) took …/part-00003.parquet"
    victim = int(took.split("(pid ")[1].split(")")[0])
    time.sleep(0.5)
    os.kill(victim, signal.SIGKILL)
    assert driver.finish() == 0, "".join(driver.lines)
    died = next((line for line in driver.lines if f"(pid {victim}) died running" in line), None)
    assert died, "".join(driver.lines)
    shard = died.split(" died running ")[1].split(";")[0].rsplit("/", 1)[-1]
    output = tmp_path / "out"
    assert sorted(p.name for p in output.glob("*.parquet")) == [f"part-{i:05d}.parquet" for i in range(6)]
    assert not list(output.glob(".*.tmp")), "a temporary file is visible"
    assert_equal_outputs(read_outputs(output), expected)
    marker = json.loads((output / ".lengthwise" / "shards" / shard.replace(".parquet", ".json")).read_text())
    assert marker["status"] == "done" and marker["pid"] != victim  # committed once, by the second attempt


@pytest.mark.slow
def test_a_killed_driver_is_resumed_by_a_rerun(tmp_path, ray_cluster, longer_rows, tiny_encoder_path):
    sizes = [400] * 6
    expected = local_reference(tmp_path, longer_rows, sizes, tiny_encoder_path, *SLOW_SETTINGS)
    write_shards(tmp_path / "in", longer_rows, sizes)
    args = ray_args(tmp_path / "in", tmp_path / "out", tiny_encoder_path, *SLOW_SETTINGS)
    driver = Driver(args)
    driver.wait_for("part-00002.parquet")  # the third shard handed out: the run is under way
    driver.process.send_signal(signal.SIGKILL)
    driver.finish()
    markers = tmp_path / "out" / ".lengthwise" / "shards"
    done_before = len(list(markers.glob("*.json"))) if markers.exists() else 0
    assert done_before < 6, "the driver finished before it was killed"
    rerun = Driver(args)
    assert rerun.finish() == 0, "".join(rerun.lines)
    assert done_before == 0 or any(f"{done_before} of 6 shards already done" in line for line in rerun.lines)
    assert_equal_outputs(read_outputs(tmp_path / "out"), expected)
    assert not list((tmp_path / "out").glob(".*.tmp"))


@pytest.mark.slow
def test_sigterm_to_the_driver_stops_the_actors_and_exits_143(tmp_path, ray_cluster, longer_rows, tiny_encoder_path):
    write_shards(tmp_path / "in", longer_rows, [400] * 6)
    driver = Driver(ray_args(tmp_path / "in", tmp_path / "out", tiny_encoder_path, *SLOW_SETTINGS))
    took = driver.wait_for(" took ")
    actor = int(took.split("(pid ")[1].split(")")[0])
    driver.process.send_signal(signal.SIGTERM)
    assert driver.finish() == 143, "".join(driver.lines)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and Path(f"/proc/{actor}").exists():
        time.sleep(0.2)
    assert not Path(f"/proc/{actor}").exists() or "zombie" in Path(f"/proc/{actor}/status").read_text().lower()
    assert not (tmp_path / "out" / ".lengthwise" / "lock").exists()


@pytest.mark.slow
def test_ray_actors_reuse_yesterdays_rows(tmp_path, ray_cluster, rows_with_bad_ones, tiny_encoder_path):
    """--reuse on --engine ray: each actor reads the previous output of its own shards."""
    local_reference(tmp_path, rows_with_bad_ones, [100, 100], tiny_encoder_path, "--max-batch-rows", "1")
    edited = rows_with_bad_ones.to_pylist()
    edited[150]["text"] = "an edited text"  # row 150 had a null text: an error yesterday, a result tonight
    edited[160]["text"] += " (edited)"
    write_shards(tmp_path / "night2", pa.Table.from_pylist(edited, schema=rows_with_bad_ones.schema), [100, 100])
    summary_path = tmp_path / "summary.json"
    result = CliRunner().invoke(cli, ray_args(tmp_path / "night2", tmp_path / "ray-out", tiny_encoder_path,
                                              "--reuse", str(tmp_path / "local-out"), "--max-batch-rows", "1",
                                              "--summary-json", str(summary_path)))
    assert result.exit_code == 0, result.output
    summary = json.loads(summary_path.read_text())
    assert (summary["reused_rows"], summary["computed_rows"]) == (200 - 4 - 1, 4 + 1)  # 4 error rows yesterday
    full = CliRunner().invoke(cli, ["run", "--input", str(tmp_path / "night2"), "--output", str(tmp_path / "full"),
                                    "--model", tiny_encoder_path, "--max-length", "128", "--no-progress",
                                    "--tokenize-workers", "0", "--dtype", "float32", "--max-batch-rows", "1"])
    assert full.exit_code == 0, full.output
    ours, yesterday = read_outputs(tmp_path / "ray-out"), read_outputs(tmp_path / "local-out")
    # the actors compute on one torch thread, the local runs on several: the computed rows agree within float
    # tolerance, the reused rows are yesterday's bit for bit
    assert_equal_outputs(ours, read_outputs(tmp_path / "full"))
    reused = [i for i in range(200) if i not in (0, 17, 99, 150, 160)]
    assert ours.take(reused).equals(yesterday.take(reused))
