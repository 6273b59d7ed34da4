"""Two Ray nodes on one machine: a head and a second raylet, each its own `ray start` with its own
CPUs, custom resource, ports and temp folder. Neither this cluster nor the suite's session cluster
(test_ray.py, which runs `ray stop --force` at its start and end) touches the other: this one is
stopped by killing the process groups it started, never by `ray stop`, and is gone before the next
module runs. An actor on the second node commits only under its driver's live lock; then the
second node's raylet is SIGKILLed mid-shard (its object store and its actor go with it) and the job
completes exactly once on the head."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.offline.config import RunConfig
from tests.conftest import assert_equal_outputs, read_outputs, write_shards
from tests.engines.test_ray import SLOW_SETTINGS, Driver, local_reference

BIN = Path(sys.executable).parent
# the head notices a lost node within ~2 s instead of Ray's ~30 s default
FAST_NODE_DEATH = {"RAY_health_check_initial_delay_ms": "0", "RAY_health_check_period_ms": "500",
                   "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}


def free_ports(count: int) -> list[int]:
    held = [socket.socket() for _ in range(count)]
    for sock in held:
        sock.bind(("", 0))
    ports = [sock.getsockname()[1] for sock in held]
    for sock in held:
        sock.close()
    return ports


class Node:
    """One `ray start --block` in a process group of its own, with every port it binds chosen free
    (none of the defaults, which the session cluster holds) and its own temp folder."""

    def __init__(self, name: str, root: Path, resource: str, *args: str):
        self.name, self.temp_dir = name, root / name
        self.log_path = root / f"{name}.log"
        agent, grpc, runtime_env, metrics, manager, objects = free_ports(6)
        command = [str(BIN / "ray"), "start", "--block", f"--temp-dir={self.temp_dir}", "--num-cpus=1",
                   "--num-gpus=0", f"--resources={json.dumps({resource: 1})}", "--disable-usage-stats",
                   "--object-store-memory=80000000", f"--dashboard-agent-listen-port={agent}",
                   f"--dashboard-agent-grpc-port={grpc}", f"--runtime-env-agent-port={runtime_env}",
                   f"--metrics-export-port={metrics}", f"--node-manager-port={manager}",
                   f"--object-manager-port={objects}", "--min-worker-port=0", "--max-worker-port=0", *args]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0", **FAST_NODE_DEATH}
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def wait_started(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in self.log_path.read_text():
            assert self.process.poll() is None and time.monotonic() < deadline, \
                f"ray start of the {self.name} node failed:\n{self.log_path.read_text()[-3000:]}"
            time.sleep(0.2)

    def processes(self) -> list[psutil.Process]:
        """Every process this node started and that still runs (its workers included)."""
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def raylet(self) -> psutil.Process:
        return next(p for p in self.processes() if p.name() == "raylet")

    def stop(self) -> None:
        """SIGKILL this node's process group and whatever it started outside it."""
        survivors = self.processes()
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for process in survivors:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        self.process.wait(timeout=30)
        psutil.wait_procs(survivors, timeout=30)


@pytest.fixture(scope="module")
def two_nodes():
    """A head and a second node; the head's GCS address. Stopped, every process of both, after the module."""
    import ray

    root = Path(tempfile.mkdtemp(prefix="lw-nodes-", dir="/tmp"))  # short: Ray's socket paths live under it
    [port] = free_ports(1)
    head = Node("head", root, "head-node", "--head", f"--port={port}", "--include-dashboard=false")
    nodes = [head]
    try:
        head.wait_started()
        cluster_file = head.temp_dir / "ray_current_cluster"  # IP:PORT of its GCS, written around "started"
        deadline = time.monotonic() + 60
        while not cluster_file.exists():
            assert time.monotonic() < deadline, f"the head node wrote no {cluster_file.name}"
            time.sleep(0.2)
        address = cluster_file.read_text().strip()
        second = Node("second", root, "second-node", f"--address={address}")
        nodes.append(second)
        second.wait_started()
        ray.init(address=address, logging_level=logging.WARNING)
        try:
            deadline = time.monotonic() + 60
            while sum(node["Alive"] for node in ray.nodes()) < 2:
                assert time.monotonic() < deadline, "the second node did not join"
                time.sleep(0.2)
        finally:
            ray.shutdown()
        yield address, head, second
    finally:
        for node in reversed(nodes):
            node.stop()
        shutil.rmtree(root, ignore_errors=True)


def wait_for_free_cpus(address: str, cpus: float, timeout_s: float = 60) -> None:
    """Until the cluster has `cpus` CPUs free: an actor of an earlier test releases its node's CPU
    only once its process has gone, and an actor that cannot be placed would never get a shard."""
    import ray

    ray.init(address=address, logging_level=logging.WARNING)
    try:
        deadline = time.monotonic() + timeout_s
        while ray.available_resources().get("CPU", 0) < cpus:
            assert time.monotonic() < deadline, f"the cluster's CPUs are not free: {ray.available_resources()}"
            time.sleep(0.2)
    finally:
        ray.shutdown()


def runs_on(pid: int, node: Node) -> bool:
    return pid in {process.pid for process in node.processes()}


def gone(pid: int, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def shard_rows(sample_table) -> pa.Table:
    table = pa.concat_tables([sample_table] * 6)
    return table.set_column(0, "id", pa.array([f"row-{i}" for i in range(table.num_rows)]))


@pytest.mark.slow
def test_an_actor_on_the_second_node_commits_only_while_its_drivers_lock_holds(tmp_path, two_nodes, shard_rows,
                                                                               tiny_encoder_path):
    """The driver's lock is read by the actor, on its own node, before each commit: committed while
    the lease runs; refused (StorageError, the shard's temporary file removed) once another driver
    took the lock over in the middle of the shard."""
    import ray

    from pipeline.core.errors import StorageError
    from pipeline.engines.ray import ShardWorker
    from pipeline.offline.lock import LockStore, encode, new_record
    from pipeline.offline.manifest import RunManifest
    from pipeline.offline.sink import ShardSink
    from pipeline.offline.source import WorkerSlot, list_shards

    address, _, second = two_nodes
    write_shards(tmp_path / "in", shard_rows.slice(0, 600), [300, 300])
    output = tmp_path / "out"
    config = RunConfig.of(input=(str(tmp_path / "in"),), output=str(output), model=tiny_encoder_path,
                          max_length=128, device="cpu", dtype="float32", probe=False, progress=False,
                          tokenize_workers=0, torch_threads=1, window_rows=64, max_batch_rows=4)
    sink = ShardSink(str(output))
    sink.create()
    driver = RunManifest(sink.fs, sink.output_dir)
    driver.acquire_lock(WorkerSlot(), 300.0)
    ray.init(address=address, logging_level=logging.WARNING)
    try:
        actor = ray.remote(ShardWorker).options(num_cpus=1, resources={"second-node": 1}).remote(config)
        where = ray.get(actor.where.remote())
        assert where["start_error"] is None and runs_on(where["pid"], second)
        first, late = list_shards(config.source.input, "id", "text")
        driver.grant_attempt(first.stem, "driver-a.1")
        result = ray.get(actor.run_shard.remote(first, "driver-a.1", driver.lock_token()))
        assert result["committed"] and result["summary"]["rows"] == 300

        driver.grant_attempt(late.stem, "driver-a.2")
        running = actor.run_shard.remote(late, "driver-a.2", driver.lock_token())
        deadline = time.monotonic() + 60
        while not list(output.glob(".part-00001.parquet.*.tmp")):  # mid-shard: its rows are being written
            assert time.monotonic() < deadline, "the actor never started writing the second shard"
            time.sleep(0.02)
        lock = output / ".lengthwise" / "lock"
        taken = {**new_record(0, 1, 300.0), "host": "driver-b", "pid": 77}  # its lease ran out elsewhere
        assert LockStore(sink.fs).replace(str(lock), lock.read_bytes(), encode(taken))
        with pytest.raises(ray.exceptions.RayTaskError) as refused:
            ray.get(running)
        assert isinstance(refused.value.cause, StorageError)
        assert "was taken over by pid 77 on driver-b; this run stopped before committing more shards" in \
            str(refused.value.cause)
        ray.kill(actor)
    finally:
        ray.shutdown()
        driver.release_lock()
    assert sorted(p.name for p in output.glob("*.parquet")) == ["part-00000.parquet"]
    assert not list(output.glob(".*.tmp")), "the refused attempt left its temporary file"
    assert json.loads(lock.read_text())["host"] == "driver-b"  # the old driver's release left the new lock alone


@pytest.mark.slow
def test_the_second_nodes_raylet_killed_mid_shard_loses_nothing(tmp_path, two_nodes, shard_rows, tiny_encoder_path):
    address, head, second = two_nodes
    wait_for_free_cpus(address, 2)  # one actor on each node
    sizes = [150] * 16  # more shards than the head's actor runs before the second node's has loaded its model
    expected = local_reference(tmp_path, shard_rows, sizes, tiny_encoder_path, *SLOW_SETTINGS)
    write_shards(tmp_path / "in", shard_rows, sizes)
    output = tmp_path / "out"
    args = ["run", "--engine", "ray", "--ray-address", address, "--workers", "2", "--threads-per-worker", "1",
            "--input", str(tmp_path / "in"), "--output", str(output), "--model", tiny_encoder_path,
            "--max-length", "128", "--no-progress", "--tokenize-workers", "0", "--dtype", "float32",
            "--summary-json", str(tmp_path / "s.json"), *SLOW_SETTINGS]
    driver = Driver(args)
    raylet = second.raylet()
    paused: set[int] = set()  # the head's actor waits (SIGSTOP) until the second node's has a shard
    try:
        deadline = time.monotonic() + 120
        while True:
            pids = [int(line.split("(pid ")[1].split(")")[0]) for line in driver.lines if " took " in line]
            for pid in set(pids) - paused:
                if runs_on(pid, head):
                    os.kill(pid, signal.SIGSTOP)
                    paused.add(pid)
            if taken := [pid for pid in pids if runs_on(pid, second)]:
                break
            assert time.monotonic() < deadline and driver.process.poll() is None, "".join(driver.lines)
            time.sleep(0.05)
        victim = taken[0]
        time.sleep(0.3)  # into the shard; with the head's actor paused, the victim holds two shards at any moment
        # the node is lost: its raylet with its object store, and at the same instant its actor and agents (a
        # worker outlives its raylet by up to a second and could finish its shards otherwise)
        for process in [raylet, *second.processes()]:
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
    finally:
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
    assert driver.finish() == 0, "".join(driver.lines)
    assert gone(victim), f"the lost node's actor (pid {victim}) still runs"
    assert second.process.wait(timeout=30) != 0  # the node's `ray start` saw its raylet die and stopped
    lost = [line.split(" died running ")[1].split(";")[0].rsplit("/", 1)[-1].removesuffix(".parquet")
            for line in driver.lines if f"(pid {victim}) died running" in line]
    assert lost, "".join(driver.lines)

    assert sorted(p.name for p in output.glob("*.parquet")) == [f"part-{i:05d}.parquet" for i in range(16)]
    assert_equal_outputs(read_outputs(output), expected)  # every row once, ids in order, values within tolerance
    assert not list(output.rglob("*.tmp")), "a temporary file is left"
    assert not list((output / ".lengthwise").glob("lock*")), "a lock is left"
    for stem in lost:  # committed once, by the head's actor
        marker = json.loads((output / ".lengthwise" / "shards" / f"{stem}.json").read_text())
        assert marker["status"] == "done" and marker["pid"] != victim
    summary = json.loads((tmp_path / "s.json").read_text())
    assert (summary["rows"], summary["failed_shards"]) == (2400, [])
    verify = CliRunner().invoke(cli, ["verify", "--output", str(output)])
    assert verify.exit_code == 0, verify.output
