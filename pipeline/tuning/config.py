"""The settings of the two load tests: the offline batch-setting sweep and the online batcher's load test."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pipeline.core.settings import (
    BatchSettings,
    CacheSettings,
    InputSettings,
    LongRowSettings,
    ModelSettings,
    RuntimeNeeds,
    SettingsTree,
    VARIED_SETTINGS,
)
from pipeline.online.config import BatcherConfig


@dataclass(frozen=True)
class SweepConfig(SettingsTree):
    """One batch-setting sweep: a single variable stepped over `values` on sampled real rows.
    `batch.max_batch_tokens` is held fixed when varying rows (None: no token budget);
    `batch.max_batch_rows` when varying tokens (None: the device's default, as in run)."""

    vary: str  # max-batch-tokens | max-batch-rows
    values: tuple[int, ...]  # the levels, run in ascending order
    out: str  # the CSV; the settings and the recommendation go beside it as <out>.json
    source: InputSettings = field(default_factory=InputSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    batch: BatchSettings = field(default_factory=lambda: BatchSettings(probe=False))  # no memory plan: each level
    # is measured
    cache: CacheSettings = field(default_factory=CacheSettings)  # where the recommendation is saved
    long_rows: LongRowSettings = field(default_factory=LongRowSettings)  # as the run's: its rows are measured
    rows: int = 2000  # measured rows per level
    warmup_rows: int = 200  # run before each level, not counted
    seed: int = 0  # which rows the sample takes
    max_p99_ms: float | None = None  # recommendation: p99 row latency limit
    memory_headroom: float = 0.10  # recommendation: share of the memory budget left free
    tokenize_workers: int | None = None  # as RunConfig's
    prefetch_batches: int = 4
    save_recommendation: bool = True

    def runtime_needs(self) -> RuntimeNeeds:
        """Rows as the run has them (the token budget is the varied or fixed level), its recommendation
        saved, not taken."""
        return RuntimeNeeds(limits=("max_batch_rows",), recommended=False, long_rows=self.long_rows)

    def input_rows(self):
        """The input's rows for the dtype trial and the compile, as the run's."""
        from pipeline.offline.workload import InputSample

        return InputSample.listed(self.source)


@dataclass(frozen=True)
class OnlineLoadtestConfig(SettingsTree):
    """The online load test: real texts sent at a Poisson rate; one batcher setting stepped over `values`."""

    vary: str  # max-batch-size | batch-timeout-ms | max-batch-tokens
    values: tuple[int, ...]
    out: str  # the CSV; the settings and the recommendation go beside it as <out>.json
    source: InputSettings = field(default_factory=InputSettings)
    batcher: BatcherConfig = field(default_factory=BatcherConfig)  # the fixed settings
    qps: float = 40.0  # mean arrival rate (Poisson)
    concurrency: int = 64  # requests in flight at most; a later arrival waits for a slot (its wait counts)
    duration_s: float = 30.0  # measured seconds of arrivals per level
    warmup_s: float = 3.0  # arrivals before the measured ones, not counted
    sample_rows: int = 5000  # texts sampled from the input, sent in random order
    seed: int = 0
    max_p99_ms: float | None = None  # recommendation: p99 latency limit
    memory_headroom: float = 0.10

    @property
    def model(self) -> ModelSettings:
        return self.batcher.model

    @property
    def batch(self) -> BatchSettings:
        return self.batcher.batch

    @property
    def cache(self) -> CacheSettings:
        return self.batcher.cache

    def runtime_needs(self) -> RuntimeNeeds:
        """The batcher's, with one memory plan for the largest batches its levels may form."""
        return dataclasses.replace(self.batcher.runtime_needs(), levels=tuple(level.batch for level in self.levels()))

    def input_rows(self) -> None:
        """The batcher's: none (its texts are a service's requests, not a job's input)."""
        return self.batcher.input_rows()

    def levels(self) -> list[BatcherConfig]:
        """The batcher setting of each level, smallest first."""
        return [self.batcher.with_settings(**{VARIED_SETTINGS[self.vary]: value}) for value in sorted(set(self.values))]
