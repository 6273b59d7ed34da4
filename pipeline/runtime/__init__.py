"""The one model-and-batch setup every product calls once: `open_runtime` → `Runtime`.

It sits above `core/` (the pieces: device, memory plan, batch setting) and `jobs/` (what a model
computes), and below the products (`offline/` runs, `online/` batcher, `tuning/` sweep, load test and
estimate), so that a run, `plan`, `plan --estimate`, the batcher and the load test settle the same
model, max length, batch limits and memory plan the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from pipeline.core.batch_setting import resolve_batch_setting, saved_recommendations, sweep_reference
from pipeline.core.clock import SetupClock
from pipeline.core.buckets import BatchLimits
from pipeline.core.memory import MemoryPlan
from pipeline.core.probe import memory_plan_for
from pipeline.core.settings import BATCH_LIMITS, BatchSettings, CacheSettings, ModelSettings, RuntimeNeeds
from pipeline.core.tokenize import TokenizerSpec
from pipeline.runtime.choice import ModelChoice, choose_model
from pipeline.runtime.model import LoadedModel, load_chosen, tokenizer_for

log = logging.getLogger(__name__)


class InputRows(Protocol):
    """The input a product runs on, read by the setup only where it needs it (`offline.workload.InputSample`)."""

    shards: Sequence  # the input's shards, listed once: the sweep and the estimate read their sample from them

    def texts(self) -> list | None:
        """A sample of the input's texts: what --dtype auto's bf16 trial runs on."""

    def tokens(self, tokenizer: TokenizerSpec) -> float:
        """The input's real tokens, estimated: what --compile auto weighs a compile against."""


@dataclass
class Runtime:
    """A loaded model with its batch limits settled: what a product runs batches with."""

    loaded: LoadedModel
    batch: BatchSettings  # the limits named in `resolved` are numbers: given, recommended or the device's default
    batch_setting: str  # where each limit came from, in words
    plan: MemoryPlan | None  # made for these limits, or the largest `levels` (None: --no-probe)
    limits: BatchLimits  # the plan's rows per length, lowered after an out-of-memory split
    saved_for: dict[str, dict | None]  # the sweep's saved recommendations for this model, device and dtype
    resolved: tuple[str, ...] = BATCH_LIMITS
    input: InputRows | None = None  # the input the setup read (`ProductConfig.input_rows`: an `InputSample`, its
    # shards listed), for the product to reuse
    members: dict[str, Runtime] = field(default_factory=dict)  # several models: each one's (`combine_runtimes`)

    @property
    def max_length(self) -> int:
        return self.loaded.choice.max_length

    @property
    def sweep_reference(self) -> dict:
        return sweep_reference(self.saved_for)

    def resolve(self, batch: BatchSettings) -> tuple[BatchSettings, str]:
        """Other limits (a load test's level) settled as this runtime's were (`resolve_batch_setting`)."""
        return resolve_batch_setting(batch, self.loaded.choice.device.type, self.saved_for, self.resolved,
                                     model_config=self.loaded.model.config)


class ProductConfig(Protocol):
    """A product's config (run, sweep, batcher, load test): its model and batch settings and what it needs."""

    model: ModelSettings
    batch: BatchSettings
    cache: CacheSettings

    def runtime_needs(self) -> RuntimeNeeds:
        """What this product asks of the setup."""

    def input_rows(self) -> InputRows | None:
        """The input whose rows --dtype auto's trial runs on and whose work --compile auto weighs; None where the
        product has none (a service: random ids, and a workload counted as large)."""


def open_runtime(config: ProductConfig, clock: SetupClock | None = None) -> Runtime:
    """A product's runtime from its config alone: its input (`config.input_rows()`), the model settled (--dtype
    auto's trial on the input's rows) and its tokenizer loaded, then the rest as every run opens it
    (`open_chosen`). `clock`: the steps' seconds. A run settles its model earlier, to check its output with it, and
    opens it on the shards it has to do (`offline.model_set_setup.open_chosen_models`)."""
    needs, clock = config.runtime_needs(), clock or SetupClock()
    with clock.step("shards"):
        rows = config.input_rows()
    choice = choose_model(config.model, config.cache.plan_cache, trial_texts=rows.texts if rows else None)
    with clock.step("tokenizer"):
        tokenizer = tokenizer_for(config.model, choice, needs.long_rows)
    return open_chosen(config, choice, tokenizer, rows, clock)


def open_chosen(config: ProductConfig, choice: ModelChoice, tokenizer: TokenizerSpec, rows: InputRows | None = None,
                clock: SetupClock | None = None) -> Runtime:
    """The runtime of a settled model with its tokenizer loaded (several models share one): the model loaded
    (for --compile auto, weighing `rows`' work: None, a workload counted as large), then the limits the product
    settles (None = auto: the sweep's saved recommendation for this model, device, dtype, max length and long-row
    setting where one applies, else the device's default for this model's size) and the memory plan for the
    settled limits, or for the largest of the product's levels."""
    model, batch, cache, needs = config.model, config.batch, config.cache, config.runtime_needs()
    clock = clock or SetupClock()
    loaded = load_chosen(model, batch, choice, tokenizer, rows.tokens if rows else None, clock, cache)
    with clock.step("batch plan"):
        saved_for = saved_recommendations(cache.plan_cache, model.job, choice.max_length,
                                          tokenizer.segment_length or None, choice.path, choice.device_key,
                                          loaded.model) if needs.recommended else {}
        device, shape = choice.device.type, loaded.model.config
        settled, setting = resolve_batch_setting(batch, device, saved_for, needs.limits, model_config=shape)
        log.info(f"batch setting: {setting}")
        levels = [resolve_batch_setting(level, device, saved_for, needs.limits, model_config=shape)[0]
                  for level in needs.levels]
        plan = memory_plan_for(largest_of(levels or [settled]), cache, model.job, choice.max_length, loaded.job,
                               loaded.model, choice.path, choice.device) if batch.probe else None
    return Runtime(loaded, settled, setting, plan, BatchLimits(plan), saved_for, needs.limits, rows)


def largest_of(batches: list[BatchSettings]) -> BatchSettings:
    """The first of `batches` with the most rows and tokens any of them allows (None: no limit)."""
    def most(name: str) -> int | None:
        values = [getattr(batch, name) for batch in batches]
        return None if None in values else max(values)

    return replace(batches[0], max_batch_rows=most("max_batch_rows"), max_batch_tokens=most("max_batch_tokens"))
