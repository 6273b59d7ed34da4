"""Run a RunConfig on its engine, diagnose what limited it and write --summary-json: what the
CLI's `run` and `pipeline.api.run` both call. Every path a run writes besides its output is
checked first against what it reads and its output (`check_run_paths`)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from pipeline.core.errors import UsageError, as_storage_error
from pipeline.core.settings import torch_threads_restored
from pipeline.offline.config import RunConfig
from pipeline.offline.locations import check_written_paths
from pipeline.offline.metrics import (ProgressTextfile, in_progress_figure, metric_labels, progress_figures, push,
                                      push_grouping, run_figures, write_textfile)


def execute_run(config: RunConfig):
    """Run `config` on its engine, read what limited it (the diagnosis), write --summary-json;
    the RunSummary."""
    from pipeline.core.findings import as_dicts
    from pipeline.offline.diagnosis import diagnose_run

    from pipeline.offline.machine import machine_load

    check_run_paths(config)
    if config.metrics_interval_s <= 0:
        raise UsageError("--metrics-interval must be more than 0s (e.g. 30s)")
    before = machine_load()
    labels = metric_labels(config.model.job, config.model.model, config.output, tuple(config.models))
    textfile = ProgressTextfile(config.metrics_textfile, config.output, config.source.storage_options, labels,
                                config.metrics_interval_s) if config.metrics_textfile else contextlib.nullcontext()
    with textfile, torch_threads_restored():
        if config.engine == "ray":
            if config.num_shards > 1:
                raise UsageError("--engine ray hands out the shards itself; drop --num-shards")
            from pipeline.engines.ray import run_on_ray

            summary = run_on_ray(config)
        else:
            from pipeline.engines.local import run_job

            summary = run_job(config)
    after = machine_load()  # other jobs seen at the start or the end, and the load average at the end
    summary.settings = {**summary.settings, "load_average": after["load_average"],
                        "other_jobs": sorted(set(before["other_jobs"]) | set(after["other_jobs"]))}
    if not summary.nothing_to_do:
        summary.diagnosis = as_dicts(diagnose_run(summary))
    if config.summary_json:
        write_summary_json(summary, config.summary_json)
    if config.metrics_textfile or config.pushgateway:
        report_metrics(config, summary, labels, textfile)
    return summary


def report_metrics(config: RunConfig, summary, labels: dict, textfile) -> None:
    """The finished run's metrics and the output's state: into --metrics-textfile (keeping an earlier
    run's last success when this one failed shards) and to --pushgateway."""
    import dataclasses

    from pipeline.offline.manifest import run_status

    finished_at = time.time()
    last_success = textfile.last_success if config.metrics_textfile else None
    figures = run_figures(dataclasses.asdict(summary), finished_at, last_success)
    figures += progress_figures(run_status(config.output, config.source.storage_options), finished_at)
    figures.append(in_progress_figure(False))
    if config.metrics_textfile:
        try:
            write_textfile(config.metrics_textfile, figures, labels)
        except OSError as error:
            raise as_storage_error(error, config.metrics_textfile) or error
    if config.pushgateway:
        push(config.pushgateway, figures, labels, push_grouping(config.num_shards, config.shard_index))


def written_paths(config: RunConfig) -> list[tuple[str, str | None]]:
    """Every path a run (or `plan`) writes besides its output shards, by the flag that names it; a
    flag that writes a path is one line here."""
    return [("--summary-json", config.summary_json), ("--plan-cache", config.cache.plan_cache),
            ("--metrics-textfile", config.metrics_textfile)]


def read_paths(config: RunConfig) -> dict[str, list[str | None]]:
    """What a run reads, by flag: no path it writes may lie there."""
    return {"--input": list(config.source.input), "--reuse": [config.reuse], "--model": [config.model.model]}


def check_run_paths(config: RunConfig) -> None:
    """Refuse (exit 2, nothing written) a path the run writes that lies in what it reads or in its
    output (only a name starting with `.` directly in the output is allowed, as OUT/.summary.json)."""
    check_written_paths(written_paths(config), read_paths(config), config.output, config.source.storage_options)


def write_summary_json(summary, path: str) -> None:
    """--summary-json; storage that refuses it is exit 4, as for the outputs (it often lies inside --output)."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(summary.to_json() + "\n")
    except OSError as error:
        raise as_storage_error(error, path) or error
