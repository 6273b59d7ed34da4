"""Prometheus metrics (pipeline/offline/metrics.py): a run's textfile holds its real counts and
parses with prometheus_client's parser, an earlier success survives a failed night, the textfile
is rewritten during a run, `status --metrics` reads the same from the output alone, and a push
reaches a server on loopback that speaks the Pushgateway API."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from pipeline.cli import cli
from pipeline.offline.metrics import (ProgressTextfile, exposition, last_success_in, metric_labels,
                                      progress_figures, run_figures, write_textfile)
from tests.conftest import write_shards

LABELS = metric_labels("embed", "/models/minilm", "s3://bucket/out")


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(metric name, its own labels other than the common ones) → value, from Prometheus text."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            own = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in LABELS))
            found[(sample.name, own)] = sample.value
    return found


def named(got: dict, expected: dict) -> dict:
    """The samples of `got` that `expected` names, as "name{label=value}" (the exposition's own spelling)."""
    def key(sample: str) -> tuple:
        name, _, labels = sample.rstrip("}").partition("{")
        return name, tuple(sorted(tuple(pair.split("=")) for pair in labels.split(",") if pair))

    return {sample: got[key(sample)] for sample in expected}


def test_a_summary_becomes_gauges_with_its_counts_and_the_common_labels():
    summary = {"rows": 120, "error_rows": 3, "reused_rows": 40, "deduplicated_rows": 7, "truncated_rows": 2,
               "shards": 4, "shards_done_before": 1, "failed_shards": [], "real_tokens": 5000, "wall_s": 12.5,
               "rows_per_s": 9.6, "padding_efficiency": 0.91, "device_busy_fraction": 0.8, "peak_rss_bytes": 1 << 30}
    text = exposition(run_figures(summary, 1_700_000_000.0, None), LABELS).decode()
    got = samples(text)
    expected = {"lengthwise_run_rows{status=done}": 120, "lengthwise_run_rows{status=error}": 3,
                "lengthwise_run_rows{status=reused}": 40, "lengthwise_run_rows{status=deduplicated}": 7,
                "lengthwise_run_shards{state=failed}": 0, "lengthwise_run_tokens": 5000,
                "lengthwise_run_duration_seconds": 12.5, "lengthwise_run_padding_efficiency_ratio": 0.91,
                "lengthwise_run_peak_memory_bytes{kind=resident}": 1 << 30, "lengthwise_run_success": 1,
                "lengthwise_last_success_timestamp_seconds": 1_700_000_000.0}
    assert named(got, expected) == expected
    assert 'lengthwise_job="embed",model="/models/minilm",output="s3://bucket/out"' in text
    # a night with a failed shard keeps the last success an earlier run recorded, and says it failed
    failed = samples(exposition(run_figures({**summary, "failed_shards": [{"shard": "a", "error": "x"}]},
                                            1_700_086_400.0, 1_700_000_000.0), LABELS).decode())
    assert failed[("lengthwise_run_success", ())] == 0
    assert failed[("lengthwise_last_success_timestamp_seconds", ())] == 1_700_000_000.0
    assert failed[("lengthwise_last_run_timestamp_seconds", ())] == 1_700_086_400.0
    never = samples(exposition(run_figures({**summary, "failed_shards": [{}]}, 1.0, None), LABELS).decode())
    assert not any(name == "lengthwise_last_success_timestamp_seconds" for name, _ in never)


def test_a_run_of_several_models_is_labelled_models_and_counts_each_models_rows():
    labels = metric_labels("embed", None, "out", ("toxicity", "embed"))
    assert labels == {"lengthwise_job": "models", "model": "toxicity,embed", "output": "out"}
    summary = {"rows": 240, "shards": 2, "models": {
        "toxicity": {"job": "moderate", "computed_rows": 2, "reused_rows": 238, "flagged_rows": 31},
        "embed": {"job": "embed", "computed_rows": 240, "reused_rows": 0}}}
    got = samples(exposition(run_figures(summary, 1.0, None), labels).decode())
    per_model = {key: value for key, value in got.items() if key[0].startswith("lengthwise_run_model_")}
    assert per_model == {
        ("lengthwise_run_model_rows", (("model_name", "toxicity"), ("status", "computed"))): 2,
        ("lengthwise_run_model_rows", (("model_name", "toxicity"), ("status", "reused"))): 238,
        ("lengthwise_run_model_flagged_rows", (("model_name", "toxicity"),)): 31,
        ("lengthwise_run_model_rows", (("model_name", "embed"), ("status", "computed"))): 240,
        ("lengthwise_run_model_rows", (("model_name", "embed"), ("status", "reused"))): 0}
    status = {"done": 1, "failed": 0, "pending": 1, "shards": 2, "rows": 240, "rows_done": 100, "models": {
        "toxicity": {"shards_done": 1, "rows_done": 100}, "embed": {"shards_done": 0, "rows_done": 0}}}
    progress = samples(exposition(progress_figures(status, 5.0), labels).decode())
    assert {key: value for key, value in progress.items() if key[0].startswith("lengthwise_model_")} == {
        ("lengthwise_model_shards_done", (("model_name", "toxicity"),)): 1,
        ("lengthwise_model_rows_done", (("model_name", "toxicity"),)): 100,
        ("lengthwise_model_shards_done", (("model_name", "embed"),)): 0,
        ("lengthwise_model_rows_done", (("model_name", "embed"),)): 0}


def test_the_textfile_is_replaced_whole_and_its_last_success_read_back(tmp_path):
    path = tmp_path / "lengthwise.prom"
    assert last_success_in(str(path)) is None
    write_textfile(str(path), run_figures({"rows": 1}, 1234.0, None), LABELS)
    assert last_success_in(str(path)) == 1234.0
    assert [p.name for p in tmp_path.iterdir()] == ["lengthwise.prom"]  # no temporary left beside it
    path.write_text("not metrics {{{\n")
    assert last_success_in(str(path)) is None


def run_args(inputs: Path, output: Path, model: str, *extra: str) -> list[str]:
    return ["run", "--input", str(inputs), "--output", str(output), "--model", model, "--max-length", "64",
            "--no-progress", "--tokenize-workers", "0", "--dtype", "float32", "--no-probe", *extra]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, sample_table, tiny_encoder_path):
    """A run of 60 rows in 3 shards with a textfile and a summary."""
    folder = tmp_path_factory.mktemp("metrics-run")
    write_shards(folder / "in", sample_table.slice(0, 60), [20, 20, 20])
    result = CliRunner().invoke(cli, run_args(folder / "in", folder / "out", tiny_encoder_path,
                                              "--metrics-textfile", str(folder / "textfiles" / "lengthwise.prom"),
                                              "--summary-json", str(folder / "summary.json")))
    assert result.exit_code == 0, result.output
    return folder


def test_a_runs_textfile_holds_its_real_counts(finished_run):
    summary = json.loads((finished_run / "summary.json").read_text())
    got = samples((finished_run / "textfiles" / "lengthwise.prom").read_text())
    assert summary["rows"] == 60 and summary["real_tokens"] > 0 and summary["peak_rss_bytes"] > 0
    expected = {"lengthwise_run_rows{status=done}": 60, "lengthwise_run_rows{status=error}": summary["error_rows"],
                "lengthwise_run_tokens": summary["real_tokens"], "lengthwise_run_shards{state=total}": 3,
                "lengthwise_shards{state=done}": 3, "lengthwise_shards{state=pending}": 0,
                "lengthwise_rows{status=done}": 60, "lengthwise_complete": 1, "lengthwise_run_in_progress": 0,
                "lengthwise_run_peak_memory_bytes{kind=resident}": summary["peak_rss_bytes"]}
    assert named(got, expected) == expected
    assert abs(got[("lengthwise_last_success_timestamp_seconds", ())] - time.time()) < 600


def test_status_metrics_read_the_same_from_the_output_alone(finished_run):
    result = CliRunner().invoke(cli, ["status", "--output", str(finished_run / "out"), "--metrics"])
    assert result.exit_code == 0, result.output
    got = samples(result.output)
    assert got[("lengthwise_shards", (("state", "done"),))] == 3
    assert got[("lengthwise_rows", (("status", "input"),))] == got[("lengthwise_rows", (("status", "done"),))] == 60
    assert got[("lengthwise_complete", ())] == 1
    marker = json.loads(next((finished_run / "out" / ".lengthwise" / "shards").glob("*.json")).read_text())
    assert abs(got[("lengthwise_output_last_success_timestamp_seconds", ())] - time.time()) < 600, marker


def test_the_textfile_is_rewritten_while_a_run_goes_on(finished_run, tmp_path):
    path = tmp_path / "live.prom"
    write_textfile(str(path), run_figures({"rows": 1}, 4321.0, None), LABELS)  # last night's success
    with ProgressTextfile(str(path), str(finished_run / "out"), {}, LABELS, 0.05):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "run_in_progress" not in path.read_text():
            time.sleep(0.02)
    got = samples(path.read_text())
    assert got[("lengthwise_run_in_progress", ())] == 1
    assert got[("lengthwise_shards", (("state", "done"),))] == 3
    assert got[("lengthwise_last_success_timestamp_seconds", ())] == 4321.0  # kept: an alert on its age holds


class Pushgateway(http.server.BaseHTTPRequestHandler):
    """The Pushgateway API's push: PUT /metrics/job/J/LABEL/VALUE… with a text-format body, 200."""

    received: list[tuple[str, str, str]] = []

    def do_PUT(self):
        body = self.rfile.read(int(self.headers["Content-Length"])).decode()
        self.received.append(("PUT", self.path, body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_push_reaches_a_pushgateway_on_loopback_and_parses(tmp_path, sample_table, tiny_encoder_path):
    server = http.server.HTTPServer(("127.0.0.1", 0), Pushgateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        write_shards(tmp_path / "in", sample_table.slice(0, 30), [15, 15])
        result = CliRunner().invoke(cli, run_args(tmp_path / "in", tmp_path / "out", tiny_encoder_path,
                                                  "--pushgateway", f"http://127.0.0.1:{server.server_port}"))
        assert result.exit_code == 0, result.output
    finally:
        server.shutdown()
    [(method, path, body)] = Pushgateway.received
    assert path == f"/metrics/job/lengthwise/instance/{socket.gethostname()}"
    got = samples(body)
    assert got[("lengthwise_run_rows", (("status", "done"),))] == 30
    assert got[("lengthwise_shards", (("state", "done"),))] == 2


def test_an_unreachable_pushgateway_says_so_after_the_output_is_committed(tmp_path, sample_table, tiny_encoder_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    write_shards(tmp_path / "in", sample_table.slice(0, 10), [10])
    result = CliRunner().invoke(cli, run_args(tmp_path / "in", tmp_path / "out", tiny_encoder_path,
                                              "--pushgateway", f"http://127.0.0.1:{port}"))
    assert result.exit_code == 2
    assert f"--pushgateway http://127.0.0.1:{port}: the push failed" in result.output
    assert "the run's output is committed" in result.output
    assert (tmp_path / "out" / "part-00000.parquet").exists()


def test_a_metrics_textfile_inside_the_input_is_refused_before_anything_is_written(tmp_path, sample_table,
                                                                                    tiny_encoder_path):
    write_shards(tmp_path / "in", sample_table.slice(0, 10), [10])
    before = sorted(p.name for p in (tmp_path / "in").iterdir())
    result = CliRunner().invoke(cli, run_args(tmp_path / "in", tmp_path / "out", tiny_encoder_path,
                                              "--metrics-textfile", str(tmp_path / "in" / "part-00000.parquet")))
    assert result.exit_code == 2 and "--metrics-textfile" in result.output
    assert sorted(p.name for p in (tmp_path / "in").iterdir()) == before and not (tmp_path / "out").exists()
