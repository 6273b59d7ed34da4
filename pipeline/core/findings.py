"""A diagnosis finding (code, evidence, action) and how findings print: shared by the run's, the
sweep's and the load test's diagnoses."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    code: str  # stable: scripts and alerts match on it
    evidence: str  # the numbers that triggered it
    action: str  # what to change, and to what

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def as_dicts(findings: Sequence[Finding]) -> list[dict]:
    return [finding.to_dict() for finding in findings]


def diagnosis_lines(findings: Sequence[dict]) -> list[str]:
    """How run, sweep and load-test output show findings: the code and its evidence, then the action."""
    lines = []
    for finding in findings:
        lines.append(f"diagnosis       {finding['code']}: {finding['evidence']}")
        lines.append(f"                → {finding['action']}")
    return lines


def as_record(value) -> dict:
    """A dataclass (RunSummary, LevelResult, Recommendation) or its dict, as a dict."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else dict(value)
