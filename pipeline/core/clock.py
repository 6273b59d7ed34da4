"""Where a run's time goes: its setup's named steps in the order they ran, so the summary can say
what a slow start spent its seconds on (importing model code, loading, probing, claiming), and
the seconds of each stage after it (`StageTimes`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass


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


@dataclass
class StageTimes:
    """Seconds per stage. read/tokenize/collate overlap the device; wait is the device idle."""

    setup: float = 0.0  # listing shards, loading tokenizer and model
    read: float = 0.0
    tokenize: float = 0.0  # summed over worker processes
    collate: float = 0.0
    wait_for_batch: float = 0.0
    forward: float = 0.0
    write: float = 0.0


def timed(items: Iterable, times: StageTimes, stage: str) -> Iterator:
    """Yield from `items`, adding the time spent producing each item to `times.<stage>`."""
    iterator = iter(items)
    while True:
        started = time.perf_counter()
        try:
            item = next(iterator)
        except StopIteration:
            return
        finally:
            setattr(times, stage, getattr(times, stage) + time.perf_counter() - started)
        yield item
