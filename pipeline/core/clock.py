"""Where a run's setup time goes: named steps in the order they ran, so the summary can say
what a slow start spent its seconds on (importing model code, loading, probing, claiming)."""

from __future__ import annotations

import contextlib
import time


class SetupClock:
    def __init__(self) -> None:
        self.steps: dict[str, float] = {}

    @contextlib.contextmanager
    def step(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        self.steps[name] = self.steps.get(name, 0.0) + seconds

    def add_steps(self, other: SetupClock) -> None:
        """Another clock's steps added to this one's (several models opened one by one)."""
        for name, seconds in other.steps.items():
            self.add(name, seconds)

    def breakdown(self, setup_s: float) -> dict[str, float]:
        """Every step in order, and the rest of `setup_s` as `other`, in seconds rounded to
        milliseconds: they add up to `setup_s`."""
        steps = {name: round(seconds, 3) for name, seconds in self.steps.items()}
        steps["other"] = round(max(0.0, setup_s - sum(self.steps.values())), 3)
        return steps
