"""The one model-and-batch setup every product calls once: `open_runtime` → `Runtime`.

It sits above `core/` (the pieces: device, memory plan, batch setting) and `jobs/` (what a model
computes), and below the products (`offline/` runs, `online/` batcher, `tuning/` sweep, load test and
estimate), so that a run, `plan`, `plan --estimate`, the batcher and the load test settle the same
model, max length, batch limits and memory plan the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Protocol

from pipeline.core.batch_setting import resolve_batch_setting, saved_recommendations, sweep_reference
from pipeline.core.clock import SetupClock
from pipeline.core.forward import BatchLimits
from pipeline.core.memory import MemoryPlan
from pipeline.core.probe import memory_plan_for
from pipeline.core.settings import BATCH_LIMITS, BatchSettings, CacheSettings, ModelSettings, RuntimeNeeds
from pipeline.core.tokenize import TokenizerSpec
from pipeline.runtime.choice import ModelChoice, choose_model
from pipeline.runtime.model import LoadedModel, load_model

log = logging.getLogger(__name__)

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


class InputRows(Protocol):
    """The input a product runs on, read by the setup only where it needs it (`offline.workload.InputSample`)."""

    def texts(self) -> list | None:
        """A sample of the input's texts: what --dtype auto's bf16 trial runs on."""

    def tokens(self, tokenizer: TokenizerSpec) -> float:
        """The input's real tokens, estimated: what --compile auto weighs a compile against."""


def open_runtime(config: ProductConfig, rows: InputRows | None = None, *, choice: ModelChoice | None = None,
                 tokenizer: TokenizerSpec | None = None, clock: SetupClock | None = None) -> Runtime:
    """Settle the model (`choice`: already settled, as a run settles it before checking its output;
    else here, --dtype auto's trial on the input's `rows` where the product reads them) and load it
    (`tokenizer`: already loaded, as a run starts its pool with it; `clock`: the steps' seconds), with
    the product's long-row setting and, for --compile auto, its input's work. Then settle the limits the
    product settles (None = auto: the sweep's saved recommendation for this model, device, dtype, max
    length and long-row setting where one applies, else the device's default for this model's size) and
    make the memory plan for the settled limits, or for the largest of the product's levels."""
    model, batch, cache, needs = config.model, config.batch, config.cache, config.runtime_needs()
    rows = rows if needs.input_rows else None
    clock = clock or SetupClock()
    choice = choice or choose_model(model, cache.plan_cache, trial_texts=rows.texts if rows else None)
    loaded = load_model(model, batch, choice, rows.tokens if rows else None, tokenizer, clock, needs.long_rows, cache)
    with clock.step("batch plan"):
        saved_for = saved_recommendations(cache.plan_cache, model.job, choice.max_length,
                                          loaded.tokenizer.segment_length or None, choice.path, choice.device_key,
                                          loaded.model) if needs.recommended else {}
        device, shape = choice.device.type, loaded.model.config
        settled, setting = resolve_batch_setting(batch, device, saved_for, needs.limits, model_config=shape)
        log.info(f"batch setting: {setting}")
        levels = [resolve_batch_setting(level, device, saved_for, needs.limits, model_config=shape)[0]
                  for level in needs.levels]
        plan = memory_plan_for(largest_of(levels or [settled]), cache, model.job, choice.max_length, loaded.job,
                               loaded.model, choice.path, choice.device) if batch.probe else None
    return Runtime(loaded, settled, setting, plan, BatchLimits(plan), saved_for, needs.limits)


def largest_of(batches: list[BatchSettings]) -> BatchSettings:
    """The first of `batches` with the most rows and tokens any of them allows (None: no limit)."""
    def most(name: str) -> int | None:
        values = [getattr(batch, name) for batch in batches]
        return None if None in values else max(values)

    return replace(batches[0], max_batch_rows=most("max_batch_rows"), max_batch_tokens=most("max_batch_tokens"))
