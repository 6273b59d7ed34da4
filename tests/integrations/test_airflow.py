"""The Airflow operators on a real Airflow 3 (`.venv-airflow`, made by `./run.sh test`), as
processes: `airflow dags test` on DAG files in a dags folder, with its own AIRFLOW_HOME and SQLite
database, running the real `lengthwise` (this venv's, `python -m pipeline.cli`) on the tiny model.
Task states, try numbers and XCom values are read back from Airflow's database."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import run_in_this_process, write_shards
from tests.test_layers import ROOT

AIRFLOW_VENV = ROOT / ".venv-airflow"
AIRFLOW = AIRFLOW_VENV / "bin" / "airflow"
AIRFLOW_PYTHON = AIRFLOW_VENV / "bin" / "python"
LENGTHWISE = [sys.executable, "-m", "pipeline.cli"]  # the venv with torch; Airflow's has none
DAGS_TEST_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def migrated_database(tmp_path_factory) -> Path:
    """One `airflow db migrate` for the module; each test copies the database it made."""
    if not AIRFLOW.exists():
        pytest.fail(f"{AIRFLOW} is missing: `./run.sh test` creates .venv-airflow (Airflow 3, pinned in run.sh)")
    home = tmp_path_factory.mktemp("airflow-template")
    subprocess.run([str(AIRFLOW), "db", "migrate"], env=airflow_env(home), check=True, capture_output=True,
                   timeout=180)
    return home / "airflow.db"


def airflow_env(home: Path) -> dict:
    """Airflow's settings for a test: its home and SQLite database under tmp_path, no examples, the
    dags folder in the home, and this checkout importable (the operators, not lengthwise's deps)."""
    environ = {name: value for name, value in os.environ.items() if not name.startswith(("AIRFLOW", "LENGTHWISE_"))}
    return {**environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


class AirflowHome:
    """A fresh AIRFLOW_HOME: a dags folder to write DAG files into, `airflow dags test`, and the
    database's task instances and XComs."""

    def __init__(self, path: Path, database: Path):
        self.path = path
        (path / "dags").mkdir(parents=True)
        shutil.copy(database, path / "airflow.db")
        self.env = airflow_env(path)

    def write_dag(self, name: str, source: str) -> Path:
        file = self.path / "dags" / f"{name}.py"
        file.write_text(textwrap.dedent(source))
        return file

    def start_dags_test(self, dag_id: str) -> tuple[subprocess.Popen, Path]:
        log = self.path / f"{dag_id}.log"
        with open(log, "w") as sink:
            process = subprocess.Popen([str(AIRFLOW), "dags", "test", dag_id], env=self.env, cwd=self.path,
                                       stdout=sink, stderr=subprocess.STDOUT)
        return process, log

    def dags_test(self, dag_id: str) -> str:
        """Run one DagRun of `dag_id` to its end; the command's log."""
        process, log = self.start_dags_test(dag_id)
        process.wait(timeout=DAGS_TEST_TIMEOUT_S)
        return log.read_text()

    def query(self, sql: str, *parameters) -> list[tuple]:
        with sqlite3.connect(self.path / "airflow.db") as db:
            return list(db.execute(sql, parameters))

    def task_states(self, dag_id: str) -> dict[tuple[str, int], tuple[str, int]]:
        """(task_id, map_index) → (state, try_number) of the DAG's task instances."""
        rows = self.query("select task_id, map_index, state, try_number from task_instance where dag_id = ?", dag_id)
        return {(task, index): (state, tries) for task, index, state, tries in rows}

    def earlier_tries(self, dag_id: str, task_id: str) -> list[tuple[int, str]]:
        """(try_number, state) of the tries before the current one, from task_instance_history."""
        return sorted(self.query("select try_number, state from task_instance_history where dag_id = ? and task_id = ?",
                                 dag_id, task_id))

    def xcom(self, dag_id: str, task_id: str, map_index: int = -1):
        rows = self.query("select value from xcom where dag_id = ? and task_id = ? and map_index = ? and "
                          "key = 'return_value'", dag_id, task_id, map_index)
        assert len(rows) == 1, f"{task_id}[{map_index}]: {len(rows)} return values"
        return json.loads(rows[0][0])


@pytest.fixture
def airflow_home(tmp_path, migrated_database) -> AirflowHome:
    return AirflowHome(tmp_path / "airflow", migrated_database)


@pytest.fixture
def shards(tmp_path, sample_table) -> Path:
    """300 rows (id, text) in 3 shards."""
    folder = tmp_path / "in"
    write_shards(folder, sample_table.select(["id", "text"]).slice(0, 300), [120, 100, 80])
    return folder


def dag_header(dag_id: str, tiny_encoder_path: str) -> str:
    """The top of a test DAG: Airflow 3 imports, the operators, and the run settings every task shares."""
    return f"""
        from datetime import timedelta

        import pendulum
        from airflow.sdk import DAG, task

        from pipeline.integrations.airflow import (LengthwiseCompleteSensor, LengthwiseRunOperator,
                                                   LengthwiseVerifyOperator)

        LENGTHWISE = {LENGTHWISE!r}
        SETTINGS = dict(model={tiny_encoder_path!r}, tokenize_workers=0, dtype="float32", progress=False)
        dag = DAG({dag_id!r}, schedule=None, start_date=pendulum.datetime(2026, 11, 1), catchup=False,
                  default_args={{"retry_delay": timedelta(seconds=1)}})
        """


def docs_dags() -> list[str]:
    """The Airflow DAGs of docs/operations.md: its python blocks that make a DAG."""
    text = (ROOT / "docs" / "operations.md").read_text()
    return [block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "with DAG(" in block]


@pytest.mark.slow  # it starts Airflow twice (its database, then the parse): 8 s of the quick loop
def test_the_docs_dags_parse_on_airflow_3_with_no_import_error_and_no_warning(tmp_path, migrated_database):
    blocks = docs_dags()
    assert len(blocks) == 2
    home = AirflowHome(tmp_path / "airflow", migrated_database)
    for index, block in enumerate(blocks):
        home.write_dag(f"docs_dag_{index}", block)
    script = ("import json, sys\nfrom airflow.dag_processing.dagbag import DagBag\n"
              "bag = DagBag(dag_folder=sys.argv[1])\n"
              "print(json.dumps({'dags': sorted(bag.dag_ids), 'errors': bag.import_errors,"
              " 'warnings': {k: list(v) for k, v in bag.captured_warnings.items()},"
              " 'tasks': {d: sorted(bag.dags[d].task_ids) for d in bag.dag_ids}}))\n")
    completed = subprocess.run([str(AIRFLOW_PYTHON), "-c", script, str(home.path / "dags")], env=home.env,
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    parsed = json.loads(completed.stdout.strip().splitlines()[-1])
    assert parsed["errors"] == {} and parsed["warnings"] == {}
    assert parsed["dags"] == ["moderate_posts", "moderation_complete", "nightly_moderation"]
    assert parsed["tasks"]["nightly_moderation"] == ["estimate", "moderate", "verify", "worker_settings"]


@pytest.mark.slow
def test_one_dagrun_maps_workers_verifies_senses_retries_a_failed_shard_alone_and_not_a_usage_error(
        airflow_home, shards, tmp_path, tiny_encoder_path):
    """One DagRun (each `airflow dags test` costs its start), three branches:
    - `worker_settings` → `embed` mapped over two workers → `verify` → `complete` (the sensor);
    - `retried`: shard 1 of its input arrives with its text column misnamed (exit 1: the other shards commit);
      the upstream export is fixed before the retry, which redoes only shard 1;
    - `usage`: an impossible setting (exit 2) fails its one try although it has retries, and writes nothing."""
    output, retried_output, usage_output = tmp_path / "out", tmp_path / "retried-out", tmp_path / "usage-out"
    retried_input = tmp_path / "retried-in"
    shutil.copytree(shards, retried_input)
    broken = retried_input / "part-00001.parquet"
    (tmp_path / "fixed.parquet").write_bytes(broken.read_bytes())
    pq.write_table(pq.read_table(broken).rename_columns(["id", "body"]), broken)
    airflow_home.write_dag("night", dag_header("lengthwise_night", tiny_encoder_path) + f"""
        import shutil

        def reexport(context):  # the upstream fix that lands between the two tries
            shutil.copy({str(tmp_path / "fixed.parquet")!r}, {str(broken)!r})

        with dag:
            @task
            def worker_settings() -> list[dict]:
                return [{{"num_shards": 2, "shard_index": index}} for index in range(2)]

            run = LengthwiseRunOperator.partial(
                task_id="embed", executable=LENGTHWISE, input={str(shards)!r}, output={str(output)!r}, retries=2,
                **SETTINGS,
            ).expand_kwargs(worker_settings())
            audit = LengthwiseVerifyOperator(task_id="verify", output={str(output)!r}, executable=LENGTHWISE)
            complete = LengthwiseCompleteSensor(task_id="complete", output={str(output)!r}, executable=LENGTHWISE,
                                                poke_interval=1, timeout=120)
            run >> audit >> complete
            LengthwiseRunOperator(task_id="retried", executable=LENGTHWISE, input={str(retried_input)!r},
                                  output={str(retried_output)!r}, retries=2, on_retry_callback=reexport, **SETTINGS)
            LengthwiseRunOperator(task_id="usage", executable=LENGTHWISE, input={str(shards)!r},
                                  output={str(usage_output)!r}, retries=2, **{{**SETTINGS, "max_length": 0}})
        """)
    log = airflow_home.dags_test("lengthwise_night")
    assert airflow_home.task_states("lengthwise_night") == {
        ("worker_settings", -1): ("success", 1), ("embed", 0): ("success", 1), ("embed", 1): ("success", 1),
        ("verify", -1): ("success", 1), ("complete", -1): ("success", 1), ("retried", -1): ("success", 2),
        ("usage", -1): ("failed", 1)}, log[-4000:]

    summaries = [airflow_home.xcom("lengthwise_night", "embed", index) for index in (0, 1)]
    assert sorted(s["shards"] for s in summaries) == [1, 2]  # worker 0 of 2: shards 0 and 2; worker 1: shard 1
    assert sum(s["rows"] for s in summaries) == 300 and all(not s["failed_shards"] for s in summaries)
    report = airflow_home.xcom("lengthwise_night", "verify")
    assert report["complete"] is True and [s["output_rows"] for s in report["shards"]] == [120, 100, 80]
    status = airflow_home.xcom("lengthwise_night", "complete")
    assert (status["shards"], status["done"], status["rows_done"]) == (3, 3, 300)
    assert sum(pq.read_metadata(f).num_rows for f in output.glob("*.parquet")) == 300

    assert airflow_home.earlier_tries("lengthwise_night", "retried") == [(1, "failed")]  # try 1 as history keeps it
    assert "1 shard(s) failed" in log and "has no column 'text'" in log
    summary = airflow_home.xcom("lengthwise_night", "retried")
    assert (summary["rows"], summary["shards_done_before"], summary["failed_shards"]) == (100, 2, [])  # shard 1 only
    assert summary["output_totals"]["rows"] == 300

    assert airflow_home.earlier_tries("lengthwise_night", "usage") == []
    assert "usage error" in log and "0 is not in the range" in log
    assert not usage_output.exists()  # a usage error writes nothing


@pytest.mark.slow
def test_the_deferrable_sensor_defers_to_its_trigger_and_completes_when_the_run_is_done(airflow_home, shards, tmp_path,
                                                                                      tiny_encoder_path):
    output = tmp_path / "out"
    airflow_home.write_dag("sensor", dag_header("lengthwise_sensor", tiny_encoder_path) + f"""
        with dag:
            LengthwiseCompleteSensor(task_id="complete", output={str(output)!r}, executable=LENGTHWISE,
                                     poke_interval=1, timeout=200)
        """)
    process, log = airflow_home.start_dags_test("lengthwise_sensor")
    try:
        deadline = time.monotonic() + 120
        while "not complete yet" not in log.read_text():  # the trigger polled an output with no run yet
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        run_in_this_process([*LENGTHWISE, "run", "--input", str(shards), "--output", str(output), "--model",
                             tiny_encoder_path, "--tokenize-workers", "0", "--dtype", "float32", "--no-progress", "-q"])
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text()
    assert airflow_home.task_states("lengthwise_sensor") == {("complete", -1): ("success", 1)}, text[-4000:]
    assert "running trigger in line" in text and "has no lengthwise run" in text
    status = airflow_home.xcom("lengthwise_sensor", "complete")
    assert (status["shards"], status["done"], status["pending"], status["rows_done"]) == (3, 3, 0, 300)


KILLED_TASK = """
import json, signal, sys
from airflow.sdk.exceptions import AirflowException
from pipeline.integrations.airflow import LengthwiseRunOperator

settings = json.loads(sys.argv[1])
operator = LengthwiseRunOperator(task_id="embed", **settings)
signal.signal(signal.SIGTERM, lambda *_: operator.on_kill())  # what Airflow's task runner does on SIGTERM
try:
    operator.execute({})
except AirflowException as error:
    print(json.dumps({"error": str(error), "child_pid": operator._child.pid, "code": operator._child.returncode}))
"""


@pytest.mark.slow
def test_killing_the_task_stops_lengthwise_cleanly_and_a_rerun_resumes(tmp_path, sample_table, tiny_encoder_path,
                                                                     migrated_database):
    table = sample_table.select(["id", "text"])
    import pyarrow as pa

    rows = pa.concat_tables([table.set_column(0, "id", pa.array([f"{i}-{n}" for n in table["id"].to_pylist()]))
                             for i in range(20)])
    write_shards(tmp_path / "in", rows, [80] * 100)
    output = tmp_path / "out"
    settings = {"input": str(tmp_path / "in"), "output": str(output), "executable": LENGTHWISE,
                "model": tiny_encoder_path, "tokenize_workers": 0, "dtype": "float32", "progress": False}
    task = subprocess.Popen([str(AIRFLOW_PYTHON), "-c", KILLED_TASK, json.dumps(settings)],
                            env=airflow_env(tmp_path / "airflow"), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(output.glob("part-*.parquet")):  # a shard is committed: the run is under way
        assert task.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    task.send_signal(signal.SIGTERM)
    answer = json.loads(task.communicate(timeout=120)[0].strip().splitlines()[-1])
    assert answer["code"] == 143 and "exited 143" in answer["error"]  # lengthwise's clean stop, not a SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(answer["child_pid"], 0)
    done = len(list(output.glob("part-*.parquet")))
    assert 0 < done < 100, f"{done} of 100 shards done when the task was killed"
    run_in_this_process([*LENGTHWISE, "run", "--input", str(tmp_path / "in"), "--output", str(output), "--model",
                         tiny_encoder_path, "--tokenize-workers", "0", "--dtype", "float32", "--no-progress", "-q",
                         "--summary-json", str(tmp_path / "rerun.json")])
    summary = json.loads((tmp_path / "rerun.json").read_text())
    assert summary["shards_done_before"] == done and summary["output_totals"]["rows"] == 8000
    assert not list(output.glob(".*.tmp"))  # the abandoned shard's partial file is gone after the rerun
