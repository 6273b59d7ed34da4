"""The online batcher's settings: requests that arrive one by one, gathered into batches under a deadline."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.core.settings import BatchSettings, CacheSettings, ModelSettings, RuntimeNeeds, SettingsTree


@dataclass(frozen=True)
class BatcherConfig(SettingsTree):
    """`batch.max_batch_rows` is the batcher's max batch size (`max_batch_size` as a flag): requests per batch,
    and a trigger: a batch runs as soon as this many are queued. `batch.max_batch_tokens` (padded tokens per
    batch) is the other trigger; None = the device's default, as `run` without a sweep recommendation."""

    ALIASES = {"max_batch_size": "max_batch_rows"}

    model: ModelSettings = field(default_factory=ModelSettings)
    batch: BatchSettings = field(default_factory=lambda: BatchSettings(max_batch_rows=32))
    cache: CacheSettings = field(default_factory=CacheSettings)
    batch_timeout_ms: float = 20.0  # the oldest queued request waits at most this long for company
    request_timeout_ms: float = 1000.0  # a request's deadline unless submit gives one; > batch_timeout_ms
    max_queue: int = 2000  # requests waiting (tokenizing or queued); one more fails at once with QueueFull
    max_queue_tokens: int = 2**18  # padded tokens waiting; the same

    def runtime_needs(self) -> RuntimeNeeds:
        """The token budget only (the batch size is its own setting), never a sweep's recommendation (a sweep
        measures offline batches)."""
        return RuntimeNeeds(limits=("max_batch_tokens",), recommended=False)

    def input_rows(self) -> None:
        """No input: requests come one by one (random ids for the dtype trial, a workload counted as large)."""
        return None

    @property
    def max_batch_size(self) -> int:
        return self.batch.max_batch_rows
