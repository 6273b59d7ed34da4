"""Run a RunConfig on its engine, diagnose what limited it and write --summary-json: what the
CLI's `run` and `pipeline.api.run` both call."""

from __future__ import annotations

from pathlib import Path

from pipeline.core.errors import UsageError, as_storage_error
from pipeline.offline.config import RunConfig


def execute_run(config: RunConfig):
    """Run `config` on its engine, read what limited it (the diagnosis), write --summary-json;
    the RunSummary."""
    from pipeline.core.findings import as_dicts
    from pipeline.offline.diagnosis import diagnose_run

    from pipeline.offline.machine import machine_load

    before = machine_load()
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
    return summary


def write_summary_json(summary, path: str) -> None:
    """--summary-json; storage that refuses it is exit 4, as for the outputs (it often lies inside --output)."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(summary.to_json() + "\n")
    except OSError as error:
        raise as_storage_error(error, path) or error
