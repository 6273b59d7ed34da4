"""Job names the CLI and configs accept."""

from __future__ import annotations

from jobs.classify import ClassifyJob
from jobs.embed import EmbedJob
from pipeline.errors import UsageError

JOBS = {job.name: job for job in (EmbedJob(), ClassifyJob())}


def get_job(name: str):
    try:
        return JOBS[name]
    except KeyError:
        raise UsageError(f"unknown job {name!r}; set --job to one of: {', '.join(sorted(JOBS))}") from None
