"""Prometheus metrics of a run and of an output, for the people who watch a nightly job only
through its alerts: a node_exporter textfile (`--metrics-textfile`, rewritten atomically during
the run and at its end), a Pushgateway push (`--pushgateway`) and `status --metrics`.

Names follow Prometheus's conventions: the `lengthwise_` prefix, base units in the name
(`_seconds`, `_bytes`, `_ratio`), one metric per quantity with a label for its kinds (rows by
`status`, shards by `state`). Every metric carries `lengthwise_job` (embed, classify, …), `model`
and `output`; not `job` or `instance`, which Prometheus sets itself from the scrape or the push. A run
of several models carries `lengthwise_job="models"` and `model` its names, and adds figures per model,
labelled `model_name`.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field

from pipeline.core.errors import UsageError
from pipeline.core.redact import redact_url

log = logging.getLogger(__name__)

PREFIX = "lengthwise"
PUSH_JOB = "lengthwise"  # the Pushgateway's `job` grouping label


@dataclass(frozen=True)
class Figure:
    """One sample: a metric's name (without the prefix), its help, its value and its own labels."""

    name: str
    help: str
    value: float
    labels: dict = field(default_factory=dict)


def metric_labels(job: str, model: str, output: str, models=()) -> dict:
    """The labels every metric of a run or an output carries (the output without credentials); `models`:
    the names of a run of several models."""
    if models:
        job, model = "models", ",".join(models)
    return {"lengthwise_job": job or "", "model": model or "", "output": redact_url(output or "")}


def model_run_figures(models: dict) -> list[Figure]:
    """A run of several models (the summary's `models` object): each model's rows computed and carried over
    (reused or kept from the output), and the rows it flagged."""
    figures = []
    for name, each in models.items():
        figures += [Figure("run_model_rows", "Rows each model of a run of several computed, or took from an "
                                             "earlier output, by model and status.", each.get(f"{status}_rows", 0),
                           {"model_name": name, "status": status}) for status in ("computed", "reused")]
        if "flagged_rows" in each:
            figures.append(Figure("run_model_flagged_rows", "Rows each model of a run of several flagged.",
                                  each["flagged_rows"], {"model_name": name}))
    return figures


def last_success_figure(timestamp: float) -> Figure:
    return Figure("last_success_timestamp_seconds", "When a run last ended with no failed shard (Unix time).",
                  timestamp)


def in_progress_figure(running: bool) -> Figure:
    return Figure("run_in_progress", "1 while a run goes on (the textfile's rewrites), 0 at its end.",
                  1 if running else 0)


def run_figures(summary: dict, finished_at: float, last_success: float | None) -> list[Figure]:
    """A finished run's figures from its summary (`RunSummary`'s keys). The run succeeded when no
    shard failed: `last_success_timestamp_seconds` is then `finished_at`, else the `last_success`
    an earlier run recorded (None: never), so an alert on its age keeps firing across failed nights."""
    succeeded = not summary.get("failed_shards")
    success = finished_at if succeeded else last_success
    rows = {"done": summary.get("rows", 0), "error": summary.get("error_rows", 0),
            "reused": summary.get("reused_rows", 0), "deduplicated": summary.get("deduplicated_rows", 0),
            "truncated": summary.get("truncated_rows", 0)}
    shards = {"failed": len(summary.get("failed_shards", [])), "done_before": summary.get("shards_done_before", 0),
              "total": summary.get("shards", 0)}
    figures = [Figure("run_rows", "Rows this run wrote, by status (error, reused, deduplicated and truncated are "
                                  "among the done ones).", value, {"status": status}) for status, value in rows.items()]
    figures += [Figure("run_shards", "Input shards: named, failed in this run, committed by an earlier run.", value,
                       {"state": state}) for state, value in shards.items()]
    figures += [
        Figure("run_tokens", "Real (unpadded) tokens this run ran through the model.", summary.get("real_tokens", 0)),
        Figure("run_duration_seconds", "Wall time of the run, setup included.", summary.get("wall_s", 0.0)),
        Figure("run_rows_per_second", "Rows written per second of wall time.", summary.get("rows_per_s", 0.0)),
        Figure("run_padding_efficiency_ratio", "Real tokens over padded tokens in the batches.",
               summary.get("padding_efficiency", 1.0)),
        Figure("run_device_busy_ratio", "Share of the run's time (after setup) the device ran forwards.",
               summary.get("device_busy_fraction", 0.0)),
        Figure("run_peak_memory_bytes", "Peak memory of the run's process, by kind.",
               summary.get("peak_rss_bytes", 0), {"kind": "resident"}),
        Figure("run_peak_memory_bytes", "Peak memory of the run's process, by kind.",
               summary.get("peak_device_bytes", 0), {"kind": "device"}),
        Figure("run_success", "1 when the last run ended with no failed shard, else 0.", 1 if succeeded else 0),
        Figure("last_run_timestamp_seconds", "When the last run ended (Unix time).", finished_at),
    ]
    figures += model_run_figures(summary.get("models") or {})
    if success is not None:
        figures.append(last_success_figure(success))
    return figures


def progress_figures(status: dict, now: float) -> list[Figure]:
    """The output's state (`run_status`'s keys): shards by state, rows done, the output's totals;
    what a run writes every interval and `status --metrics` prints. The output's last success is
    when its last shard was committed, if every shard is done."""
    figures = [Figure("shards", "Input shards of the output's run, by state.", status[state], {"state": state})
               for state in ("done", "failed", "pending")]
    totals = status.get("totals") or {}
    rows = {"input": status["rows"], "done": status["rows_done"], "error": totals.get("error_rows", 0),
            "truncated": totals.get("truncated_rows", 0)}
    figures += [Figure("rows", "Rows of the output's input shards, and rows in its done shards.", value,
                       {"status": kind}) for kind, value in rows.items()]
    figures += [
        Figure("complete", "1 when every shard of the output is done, else 0.",
               1 if status["done"] == status["shards"] else 0),
        Figure("status_timestamp_seconds", "When these figures were read (Unix time).", now),
    ]
    for name, each in (status.get("models") or {}).items():
        figures += [Figure("model_shards_done", "Input shards whose output holds the model's columns, by model.",
                           each["shards_done"], {"model_name": name}),
                    Figure("model_rows_done", "Rows in the shards whose output holds the model's columns, by model.",
                           each["rows_done"], {"model_name": name})]
    if status["done"] == status["shards"] and status.get("completed_at"):
        figures.append(Figure("output_last_success_timestamp_seconds",
                              "When the output's last shard was committed, once every shard is done (Unix time).",
                              iso_timestamp(status["completed_at"])))
    return figures


def iso_timestamp(text: str) -> float:
    """Unix time of a marker's ISO 8601 time."""
    return datetime.datetime.fromisoformat(text).timestamp()


def exposition(figures: list[Figure], labels: dict) -> bytes:
    """The figures in Prometheus's text format (what a textfile, a push and `status --metrics` carry)."""
    from prometheus_client import CollectorRegistry, generate_latest

    return generate_latest(registry_of(figures, labels, CollectorRegistry))


def registry_of(figures: list[Figure], labels: dict, registry_class):
    """A prometheus_client registry holding `figures` as gauges, each with `labels` and its own."""
    from prometheus_client.core import GaugeMetricFamily

    families: dict[str, GaugeMetricFamily] = {}
    for figure in figures:
        own = {**labels, **figure.labels}
        family = families.get(figure.name)
        if family is None:
            family = families[figure.name] = GaugeMetricFamily(f"{PREFIX}_{figure.name}", figure.help,
                                                               labels=list(own))
        family.add_metric([str(value) for value in own.values()], float(figure.value))

    class Figures:
        def collect(self):
            return list(families.values())

    registry = registry_class(auto_describe=False)
    registry.register(Figures())
    return registry


def write_textfile(path: str, figures: list[Figure], labels: dict) -> None:
    """Write node_exporter's textfile collector format atomically: a temporary file beside `path`,
    then a rename, so the collector never reads half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    temporary = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(temporary, "wb") as file:
        file.write(exposition(figures, labels))
    os.replace(temporary, path)


def last_success_in(path: str) -> float | None:
    """The `last_success_timestamp_seconds` a textfile at `path` holds from an earlier run, or None."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = open(path, encoding="utf-8").read()
    except OSError:
        return None
    try:
        for family in text_string_to_metric_families(text):
            if family.name == f"{PREFIX}_last_success_timestamp_seconds":
                return max((sample.value for sample in family.samples), default=None)
    except ValueError:  # not a textfile of ours: the run overwrites it with one
        return None
    return None


def push(url: str, figures: list[Figure], labels: dict, grouping: dict) -> None:
    """Replace this run's group on a Pushgateway (`job` lengthwise, `grouping`: instance and worker);
    a gateway that cannot be reached is a usage error naming it, after the run's output is committed."""
    from prometheus_client import CollectorRegistry, push_to_gateway

    try:
        push_to_gateway(url, job=PUSH_JOB, registry=registry_of(figures, labels, CollectorRegistry),
                        grouping_key=grouping, timeout=30)
    except OSError as error:
        raise UsageError(f"--pushgateway {redact_url(url)}: the push failed ({error}); the run's output is "
                         "committed, only its metrics are missing") from None


def push_grouping(num_shards: int, shard_index: int | None) -> dict:
    """The push's grouping key: this host, and the worker of N where a run is one of several, so
    that the workers of one output do not replace each other's group."""
    grouping = {"instance": socket.gethostname()}
    if num_shards > 1:
        grouping["worker"] = f"{shard_index}-of-{num_shards}"
    return grouping


class ProgressTextfile:
    """Rewrites --metrics-textfile every `interval_s` while a run goes on, from the output's state
    (`run_status`, once the run has claimed the output), so that a stuck run shows as one. A
    figure that cannot be read this time is tried again at the next interval, never fails the run."""

    def __init__(self, path: str, output: str, storage_options: dict, labels: dict, interval_s: float):
        self.path, self.output, self.storage_options = path, output, storage_options
        self.labels, self.interval_s = labels, interval_s
        self.last_success = last_success_in(path)  # kept in every rewrite: an alert on its age holds during the run
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lengthwise-metrics", daemon=True)

    def __enter__(self) -> ProgressTextfile:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def progress(self) -> list[Figure]:
        """The output's state now, or no figures before the run has recorded the output."""
        from pipeline.offline.manifest import run_status

        try:
            figures = progress_figures(run_status(self.output, self.storage_options), time.time())
        except UsageError:  # no run.json yet: the run has not claimed the output
            figures = []
        if self.last_success is not None:
            figures.append(last_success_figure(self.last_success))
        return figures

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                figures = self.progress()
                write_textfile(self.path, figures + [in_progress_figure(True)], self.labels)
            except Exception as error:  # noqa: BLE001 - storage hiccup: the next interval tries again
                log.warning(f"--metrics-textfile {self.path}: could not update it ({type(error).__name__}: {error})")
