"""`--engine ray` on a real local Ray cluster (one, shared by these tests): equal outputs,
an actor killed mid-shard, a driver killed and rerun."""

from __future__ import annotations

import functools
import json
import logging
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
from pipeline.offline.config import RunConfig
from pipeline.core.errors import UsageError
from pipeline.engines.ray import RAY_AUTH_LOGGER, actor_layout
from pipeline.engines.ray_devices import actor_device_and_dtype
from tests.conftest import MODEL_SET_SETTINGS, assert_equal_outputs, read_outputs, three_models, write_shards

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
    config = RunConfig.of(input=(), output="", tokenize_workers=64)
    four_gpu_nodes = [{"GPU": 2.0, "CPU": 32.0}, {"GPU": 2.0, "CPU": 24.0}, {"CPU": 8.0}]  # and a CPU-only head
    # one actor per GPU, each with the smallest node's share of CPUs; its tokenizer pool is that share less one
    assert actor_layout(config, four_gpu_nodes, 100) == (4, {"num_gpus": 1, "num_cpus": 12}, 1, 11, "")
    assert actor_layout(config, four_gpu_nodes, 3).count == 3  # never more actors than shards
    assert actor_layout(RunConfig.of(input=(), output="", tokenize_workers=2), four_gpu_nodes, 100).tokenize_workers == 2
    assert actor_layout(config, [{"CPU": 8.0}], 100) == (8, {"num_cpus": 1}, 1, 0, "")
    four_threads = RunConfig.of(input=(), output="", threads_per_worker=4, tokenize_workers=64)
    assert actor_layout(four_threads, [{"CPU": 8.0}], 100) == (2, {"num_cpus": 4}, 4, 3, "")
    assert actor_layout(four_threads, [{"CPU": 6.0}, {"CPU": 6.0}], 100).count == 2  # 4 CPUs fit once per node
    assert actor_layout(RunConfig.of(input=(), output="", workers=3), [{"CPU": 8.0}], 100).count == 3
    cpu_only = RunConfig.of(input=(), output="", device="cpu")
    assert actor_layout(cpu_only, [{"GPU": 2.0, "CPU": 8.0}], 100)[:3] == (8, {"num_cpus": 1}, 1)


def test_auto_tokenizer_pools_leave_a_gpu_actor_cores_for_its_cuda_threads():
    auto = RunConfig.of(input=(), output="")
    # a share of 12 CPUs: 3 for the device loop, prefetch and writer threads; a CPU actor keeps one for its loop
    assert actor_layout(auto, [{"GPU": 2.0, "CPU": 24.0}], 100).tokenize_workers == 9
    assert actor_layout(RunConfig.of(input=(), output="", threads_per_worker=4), [{"CPU": 8.0}], 100).tokenize_workers == 3
    assert actor_layout(auto, [{"CPU": 8.0}], 100).tokenize_workers == 0
    assert actor_layout(auto, [{"GPU": 1.0, "CPU": 2.0}], 100).tokenize_workers == 0


def test_more_workers_than_the_cluster_places_are_capped_with_a_warning_not_left_waiting():
    layout = actor_layout(RunConfig.of(input=(), output="", workers=8), [{"GPU": 2.0, "CPU": 16.0}], 100)
    assert layout.count == 2 and layout.note == "--workers 8 is more than the cluster's 2 GPU(s); running 2 actor(s)"
    layout = actor_layout(RunConfig.of(input=(), output="", workers=5, threads_per_worker=2), [{"CPU": 8.0}], 100)
    assert layout.count == 4 and "cluster's 4 slot(s) of 2 CPU(s)" in layout.note


def test_actors_settle_device_and_dtype_from_the_cluster_not_the_driver():
    h200s = {"CPU": 64.0, "GPU": 8.0, "accelerator_type:H200": 8.0}
    assert actor_device_and_dtype("auto", "auto", h200s) == ("cuda", "bfloat16",
                                                             "bfloat16: the default on the cluster's GPUs (H200)")
    assert actor_device_and_dtype("cuda", "auto", {"GPU": 4.0, "accelerator_type:T4": 4.0})[:2] == ("cuda", "float16")
    assert actor_device_and_dtype("auto", "float32", h200s) == ("cuda", "float32", "float32: --dtype")
    assert actor_device_and_dtype("cpu", "auto", h200s) == ("cpu", None, "")
    assert actor_device_and_dtype("auto", "auto", {"CPU": 8.0}) == ("cpu", None, "")
    with pytest.raises(UsageError, match="no GPU"):
        actor_device_and_dtype("cuda", "auto", {"CPU": 8.0})
    with pytest.raises(UsageError, match="use --device cuda or auto"):
        actor_device_and_dtype("cuda:1", "auto", h200s)
    with pytest.raises(UsageError, match="set --dtype"):
        actor_device_and_dtype("auto", "auto", {"GPU": 2.0, "accelerator_type:T4": 1.0, "accelerator_type:A100": 1.0})


def test_a_cpu_only_driver_records_the_gpu_actors_dtype_in_the_fingerprint(tiny_encoder_path):
    from pipeline.offline.claim import output_fingerprint
    from pipeline.engines.ray_devices import choose_on_cluster

    a100s = {"CPU": 16.0, "GPU": 2.0, "accelerator_type:A100": 2.0}
    config = RunConfig.of(input=("x",), output="y", model=tiny_encoder_path, device="cuda")  # refused locally here
    choice = choose_on_cluster(a100s, config.model, None)
    assert (choice.device.type, str(choice.dtype)) == ("cuda", "torch.bfloat16")
    assert output_fingerprint(config, choice)["dtype"] == "bfloat16"


def test_several_models_each_get_their_dtype_from_the_cluster_and_the_actors_are_handed_it(tiny_encoder_path):
    from pipeline.offline.model_set_setup import choose_models
    from pipeline.engines.ray_devices import actors_config, choose_on_cluster, said_dtypes, settled_dtypes
    from pipeline.offline.claim import output_fingerprint

    config = RunConfig.of(input=("x",), output="y", device="auto", models={
        "a": {"job": "embed", "model": tiny_encoder_path}, "b": {"job": "embed", "model": tiny_encoder_path,
                                                              "dtype": "float16"}})
    choose_one = functools.partial(choose_on_cluster, {"CPU": 16.0, "GPU": 2.0, "accelerator_type:H100": 2.0})
    choice = choose_models(config, None, None, choose_one=choose_one)
    assert choice.device.type == "cuda" and choice.dtype_reason == ("a: bfloat16: the default on the cluster's GPUs "
                                                                    "(H100); b: float16: --dtype")
    assert {name: each["dtype"] for name, each in output_fingerprint(config, choice)["models"].items()} == {
        "a": "bfloat16", "b": "float16"}
    handed = actors_config(config, choice)
    assert handed.model.device == "cuda" and handed.models["a"] == {"job": "embed", "model": tiny_encoder_path,
                                                                    "dtype": "bfloat16"}
    assert said_dtypes(settled_dtypes(handed)) == "a bfloat16, b float16"  # what each actor must report loading
    assert said_dtypes(settled_dtypes(actors_config(config.with_settings(models={}), choice.choices["a"]))) == \
        "bfloat16"


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
    # two actors start; one that loads its model first may run every small shard before the other is ready
    assert 1 <= len(summary["workers"]) <= 2 and sum(w["shards"] for w in summary["workers"]) == 6
    # an actor that came up after the other had taken every shard is listed with none, and one that ran only the
    # empty shard with no rows: neither has a speed
    working = [w for w in summary["workers"] if w["rows"]]
    assert all(w["rows_per_s"] == 0 for w in summary["workers"] if not w["rows"])
    assert sum(w["rows"] for w in working) == 200 and all(w["rows_per_s"] > 0 for w in working)
    assert len({w["pid"] for w in summary["workers"]}) == len(summary["workers"]) and os.getpid() not in {w["pid"] for w in
                                                                                     summary["workers"]}
    # the console reports the actors' model loading as the setup and their own device time, not the driver's
    assert summary["stage_s"]["setup"] == round(sum(w["setup_s"] for w in summary["workers"]), 3) > 0
    assert all(0 < w["device_busy_fraction"] <= 1 for w in working)
    assert "model loaded in" in result.output and "device busy" in result.output
    assert summary["dtype_reason"] == "float32: --dtype"
    assert logging.getLogger(RAY_AUTH_LOGGER).level == logging.ERROR  # Ray's token-auth notice is silenced
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


@pytest.fixture(scope="module")
def longer_reference(tmp_path_factory, longer_rows, tiny_encoder_path) -> pa.Table:
    """A local run's output of `longer_rows` in six shards of 400 under SLOW_SETTINGS, which the kill tests
    compare with (computed once: 2,400 rows at 4 per batch)."""
    return local_reference(tmp_path_factory.mktemp("longer-reference"), longer_rows, [400] * 6, tiny_encoder_path,
                           *SLOW_SETTINGS)


@pytest.mark.slow
def test_an_actor_killed_mid_shard_loses_nothing(tmp_path, ray_cluster, longer_rows, longer_reference,
                                                 tiny_encoder_path):
    write_shards(tmp_path / "in", longer_rows, [400] * 6)
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
    assert_equal_outputs(read_outputs(output), longer_reference)
    marker = json.loads((output / ".lengthwise" / "shards" / shard.replace(".parquet", ".json")).read_text())
    assert marker["status"] == "done" and marker["pid"] != victim  # committed once, by the second attempt


@pytest.mark.slow
def test_a_ray_actor_starts_its_next_shard_before_the_current_one_commits(tmp_path, ray_cluster, longer_rows,
                                                                         longer_reference, tiny_encoder_path):
    write_shards(tmp_path / "in", longer_rows, [400] * 6)
    args = ray_args(tmp_path / "in", tmp_path / "out", tiny_encoder_path, *SLOW_SETTINGS,
                    "--summary-json", str(tmp_path / "s.json"))
    args[args.index("--workers") + 1] = "1"
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    [worker] = json.loads((tmp_path / "s.json").read_text())["workers"]
    # the driver keeps the next shard queued on the actor, which reads and tokenizes its first window while the
    # shard ahead of it still runs: every shard after the first
    assert (worker["shards"], worker["rows"], worker["started_early"]) == (6, 2400, 5)
    assert_equal_outputs(read_outputs(tmp_path / "out"), longer_reference)


@pytest.mark.slow
def test_a_killed_driver_is_resumed_by_a_rerun(tmp_path, ray_cluster, longer_rows, longer_reference, tiny_encoder_path):
    write_shards(tmp_path / "in", longer_rows, [400] * 6)
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
    assert_equal_outputs(read_outputs(tmp_path / "out"), longer_reference)
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


def actor_pids(title: str) -> list[int]:
    """The processes whose title (Ray sets `ray::ShardWorker.__init__` while an actor loads) starts with `title`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(title.encode()):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def every_id_once(output: Path, table: pa.Table) -> None:
    ids = read_outputs(output)["id"].to_pylist()
    assert sorted(ids, key=str) == sorted(table["id"].to_pylist(), key=str)
    assert not list(output.glob(".*.tmp")), "a temporary file is visible"


@pytest.mark.slow
def test_an_actor_killed_while_loading_the_model_is_replaced(tmp_path, ray_cluster, sample_table,
                                                             tiny_encoder_path):
    """SIGKILL of a `ray::ShardWorker.__init__` process (its probe runs: --no-plan-cache); the
    ids repeat across shards, and duplicates are counted across them as a local run counts them."""
    table = pa.concat_tables([sample_table.slice(0, 60), sample_table.slice(0, 60)])  # 60 ids twice
    write_shards(tmp_path / "in", table, [30, 30, 30, 30])
    driver = Driver(ray_args(tmp_path / "in", tmp_path / "out", tiny_encoder_path, "--no-plan-cache",
                             "--summary-json", str(tmp_path / "s.json")))
    deadline = time.monotonic() + 120
    while not (loading := actor_pids("ray::ShardWorker.__init__")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert loading, "no actor was seen loading its model"
    os.kill(loading[0], signal.SIGKILL)
    assert driver.finish() == 0, "".join(driver.lines)
    assert any("died while loading the model" in line for line in driver.lines), "".join(driver.lines)
    every_id_once(tmp_path / "out", table)
    summary = json.loads((tmp_path / "s.json").read_text())
    assert (summary["rows"], summary["duplicate_ids"]) == (120, 60)
    examples = summary["duplicate_id_examples"]
    assert len(examples) == 5 and set(examples) <= set(sample_table["id"].to_pylist()[:60])


@pytest.mark.slow
def test_an_actor_killed_while_writing_is_replaced_and_the_new_attempt_commits(tmp_path, ray_cluster, longer_rows,
                                                                                tiny_encoder_path):
    write_shards(tmp_path / "in", longer_rows.slice(0, 1200), [400, 400, 400])
    output = tmp_path / "out"
    driver = Driver(ray_args(tmp_path / "in", output, tiny_encoder_path, *SLOW_SETTINGS))
    deadline = time.monotonic() + 180
    while not (writing := list(output.glob(".*.parquet.*.tmp"))) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert writing, "no temporary output was seen"
    shard = writing[0].name[1:writing[0].name.index(".parquet.")]  # .part-00001.parquet.<random>.tmp
    took = driver.wait_for(f"{shard}.parquet (attempt ")
    victim, first_attempt = int(took.split("(pid ")[1].split(")")[0]), took.split("(attempt ")[1].split(")")[0]
    os.kill(victim, signal.SIGKILL)
    assert driver.finish() == 0, "".join(driver.lines)
    assert any(f"(pid {victim}) died running" in line for line in driver.lines), "".join(driver.lines)
    every_id_once(output, longer_rows.slice(0, 1200))
    marker = json.loads((output / ".lengthwise" / "shards" / f"{shard}.json").read_text())
    assert marker["status"] == "done" and marker["pid"] != victim and marker["attempt"] != first_attempt


@pytest.mark.slow
def test_the_same_load_error_in_two_actors_is_a_usage_error(tmp_path, ray_cluster, sample_table, tiny_encoder_path):
    import shutil

    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_encoder_path, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors at all")  # the config still reads
    write_shards(tmp_path / "in", sample_table.slice(0, 20), [10, 10])
    result = CliRunner().invoke(cli, ray_args(tmp_path / "in", tmp_path / "out", str(broken)))
    assert result.exit_code == 2, result.output
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: the Ray actors could not load the model: SafetensorError: Error while "
                           "deserializing header")
    assert not list((tmp_path / "out").glob("*.parquet"))


@pytest.mark.slow
def test_ray_actors_reuse_yesterdays_rows(tmp_path, ray_cluster, rows_with_bad_ones, tiny_encoder_path):
    """--reuse on --engine ray: each actor indexes the previous output once and reads the results it needs."""
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
    # computed: row 0 (a null text, no hash), 150 (a text tonight) and 160 (edited); the blank rows reuse their error
    assert (summary["reused_rows"], summary["computed_rows"]) == (200 - 3, 3)
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


def assert_same_cells(ours: pa.Table, theirs: pa.Table) -> None:
    assert ours.schema == theirs.schema
    for column in theirs.column_names:
        assert ours[column].to_pylist() == theirs[column].to_pylist(), column


@pytest.mark.slow
def test_ray_runs_several_models_as_a_local_run_does_and_an_added_model_alone(
        tmp_path, ray_cluster, model_set_rows, tiny_multilabel_path, tiny_classifier_path, tiny_encoder_path):
    """Three models (two classifiers and an embedder, sharing MiniLM's tokenizer) on two actors give the
    local run's output cell for cell (one torch thread and the same windows and batches in both) and its
    `models` object; a model added to an output of two computes its columns alone on the actors."""
    from pipeline.api import run

    write_shards(tmp_path / "in", model_set_rows, [100, 140])
    models = three_models(tiny_multilabel_path, tiny_classifier_path, tiny_encoder_path)
    settings = {**MODEL_SET_SETTINGS, "keep_columns": ["lang"], "torch_threads": 1, "window_rows": 20,
                "max_batch_rows": 8, "probe": False}
    on_ray = {"engine": "ray", "ray_address": ray_cluster, "workers": 2, "threads_per_worker": 1}

    def into(output: str, chosen: dict, **engine) -> dict:
        return run(str(tmp_path / "in"), str(tmp_path / output), models=chosen, **settings, **engine)

    local = into("local", models)
    ours = into("ray", models, **on_ray)
    assert_same_cells(read_outputs(tmp_path / "ray"), read_outputs(tmp_path / "local"))
    assert ours["models"] == local["models"]
    assert local["models"]["toxicity"]["flagged_rows"] > 0 and local["models"]["embed"]["computed_rows"] == 240
    assert (ours["split_rows"], ours["deduplicated_rows"]) == (local["split_rows"], local["deduplicated_rows"])
    assert ours["batch_plan"] == local["batch_plan"] and ours["compile"] == local["compile"]
    assert sum(worker["shards"] for worker in ours["workers"]) == 2

    into("added", {name: models[name] for name in ("toxicity", "topic")})
    added = into("added", models, **on_ray)  # embed added: only its columns are computed
    carried = added["reuse"]["carried"]
    assert carried == 239  # every row but the one with a null text (no text hash to recognise it by)
    assert added["models"]["embed"]["computed_rows"] == 240 and added["models"]["embed"]["reused_rows"] == 0
    for name in ("toxicity", "topic"):
        assert (added["models"][name]["computed_rows"], added["models"][name]["reused_rows"]) == (240 - carried,
                                                                                                  carried)
    assert added["models"]["toxicity"]["flagged_rows"] == local["models"]["toxicity"]["flagged_rows"]
    assert_same_cells(read_outputs(tmp_path / "added"), read_outputs(tmp_path / "local"))


def spawned_children(pid: int) -> set[int]:
    """The tokenizer processes (multiprocessing spawn workers) of process `pid`."""
    import psutil

    return {child.pid for child in psutil.Process(pid).children()
            if "spawn_main" in " ".join(child.cmdline()) and "resource_tracker" not in " ".join(child.cmdline())}


@pytest.mark.slow
def test_a_ray_actor_starts_its_tokenizer_pool_once_for_all_its_shards(tmp_path, ray_cluster, sample_table,
                                                                       tiny_encoder_path):
    import ray

    from pipeline.engines.ray import ShardWorker
    from pipeline.offline.source import list_shards

    write_shards(tmp_path / "in", sample_table.slice(0, 60), [20, 20, 20])
    config = RunConfig.of(input=(str(tmp_path / "in"),), output=str(tmp_path / "out"), model=tiny_encoder_path,
                          max_length=64, device="cpu", dtype="float32", probe=False, progress=False,
                          tokenize_workers=1, torch_threads=1)
    ray.init(address=ray_cluster, logging_level=logging.WARNING)
    try:
        actor = ray.remote(ShardWorker).options(num_cpus=1).remote(config)
        where = ray.get(actor.where.remote())
        assert where["start_error"] is None
        pools = []
        for number, shard in enumerate(list_shards(config.source.input, "id", "text")):
            result = ray.get(actor.run_shard.remote(shard, f"test.{number}"))
            assert result["summary"]["rows"] == 20
            pools.append(spawned_children(where["pid"]))
        assert len(pools[0]) == 1 and pools == [pools[0]] * 3  # the same one process, alive between shards
        ray.kill(actor)
    finally:
        ray.shutdown()
