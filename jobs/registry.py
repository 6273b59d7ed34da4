"""Job names the CLI and configs accept."""

from __future__ import annotations

from jobs.classify import ClassifyJob
from jobs.embed import EmbedJob
from jobs.moderate import ModerateJob
from jobs.pair import PairJob
from pipeline.core.errors import UsageError
from pipeline.core.settings import ModelSettings

JOBS = {job.name: job for job in (EmbedJob(), ClassifyJob(), ModerateJob(), PairJob())}


def get_job(name: str):
    try:
        return JOBS[name]
    except KeyError:
        raise UsageError(f"unknown job {name!r}; set --job to one of: {', '.join(sorted(JOBS))}") from None


def job_options(settings: ModelSettings, model_path: str) -> dict:
    """The job's own settings that change its outputs (moderate: the thresholds), resolved and
    checked against the model before anything runs; {} for a job that has none. They go to
    the job's `load` and into the output fingerprint."""
    job = get_job(settings.job)
    resolve = getattr(job, "options", None)
    if resolve is None:
        if settings.thresholds or settings.flag_labels:
            raise UsageError(f"--threshold and --flag-labels are for --job moderate or pair, not --job {settings.job}")
        return {}
    return resolve(settings, model_path)
