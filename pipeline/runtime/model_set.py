"""Several models' runtimes, each opened as a one-model run opens its own (`open_chosen`: its dtype, compile,
limits and memory plan), combined into one `Runtime` whose job runs every batch through each model
(`jobs.model_set`). A batch is planned once, under the tightest of the models' limits, so that every model
runs the same batches (docs/jobs.md "Several models, one pass")."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jobs.model_set import ModelSet, ModelSetJob
from pipeline.core.compile import CompileChoice
from pipeline.core.device import dtype_name
from pipeline.core.errors import UsageError
from pipeline.core.buckets import BatchLimits
from pipeline.core.probe import describe_plan
from pipeline.core.settings import BatchSettings, LongRowSettings, ModelSettings
from pipeline.core.tokenize import TokenizerSpec
from pipeline.runtime import Runtime
from pipeline.runtime.choice import ModelChoice, choose_model
from pipeline.runtime.model import LoadedModel, tokenizer_for


@dataclass(frozen=True)
class ModelSetChoice:
    """The models of a run settled but not loaded, by name in the run's order, and the one tokenizer they share."""

    choices: dict[str, ModelChoice]
    tokenizer: TokenizerSpec
    seconds: dict[str, float] = field(default_factory=dict, compare=False)  # each model's settling took

    @property
    def device(self):
        return next(iter(self.choices.values())).device

    @property
    def dtype_reason(self) -> str:
        return per_model(self.choices, lambda choice: choice.dtype_reason)


TOKENIZING = {"tokenizer_json": "tokenizer", "max_length": "max length", "prompt": "prompt",
              "lowercase": "lower-casing", "segment_length": "long-text segments", "pair": "pair input"}


def choose_model_set(settings: dict[str, ModelSettings], plan_cache: str | None, long_rows: LongRowSettings,
                     dtype_source: str | None = None, trial_texts: Callable | None = None,
                     choose_one: Callable[..., ModelChoice] = choose_model) -> ModelSetChoice:
    """Each model settled as a one-model run settles it (`choose_one`, with `choose_model`'s arguments: the Ray
    engine settles each for its actors), and their tokenizers loaded: they must be one (by content: vocabulary,
    max length, prompt, long-text mode), else a UsageError naming the models that differ."""
    choices, seconds = {}, {}
    for name, each in settings.items():
        started = time.perf_counter()
        try:
            choices[name] = choose_one(each, plan_cache, dtype_source, trial_texts)
        except UsageError as error:
            raise UsageError(f"models.{name}: {error}") from None
        seconds[name] = time.perf_counter() - started
    tokenizers = {name: tokenizer_for(settings[name], choice, long_rows) for name, choice in choices.items()}
    first_name, first = next(iter(tokenizers.items()))
    for name, spec in tokenizers.items():
        differ = [said for field, said in TOKENIZING.items() if getattr(spec, field) != getattr(first, field)]
        if len(differ) > 1 and "tokenizer" in differ:
            differ.remove("tokenizer")  # its serialized form holds the max length and the prompt's handling
        if differ:
            raise UsageError(f"models {first_name} and {name} tokenize differently ({', '.join(differ)}); the models "
                             "of one run must share one tokenizer, --max-length and --long-text (a current limit): "
                             "give them the same or run them separately")
    return ModelSetChoice(choices, first, seconds)


class TightestLimits(BatchLimits):
    """Rows per padded length: the fewest any model's plan allows; an out-of-memory split lowers every model's."""

    def __init__(self, limits: dict[str, BatchLimits]):
        super().__init__(None)
        self.members = limits

    def rows_for(self, padded_length: int) -> int:
        return min([limits.rows_for(padded_length) for limits in self.members.values()] or [np.iinfo(np.int64).max])

    def lower(self, padded_length: int, rows: int) -> None:
        for limits in self.members.values():
            limits.lower(padded_length, rows)
        super().lower(padded_length, rows)


def tightest(batches: list[BatchSettings]) -> BatchSettings:
    """The first of `batches` with the fewest rows and tokens any of them allows (None: no limit)."""
    def fewest(name: str) -> int | None:
        given = [getattr(batch, name) for batch in batches if getattr(batch, name) is not None]
        return min(given) if given else None

    return dataclasses.replace(batches[0], max_batch_rows=fewest("max_batch_rows"),
                               max_batch_tokens=fewest("max_batch_tokens"))


def per_model(models: dict, describe) -> str:
    """One line of `describe(each)` per model (its runtime or choice), as `NAME: …; NAME: …` (or one, where all
    agree)."""
    said = {name: describe(each) for name, each in models.items()}
    if len(set(said.values())) == 1:
        return next(iter(said.values()))
    return "; ".join(f"{name}: {text}" for name, text in said.items())


def settled_models(runtimes: dict[str, Runtime]) -> dict[str, dict]:
    """What each model settled, by name: its folder, dtype, compile and batch limits (the summary's `models`)."""
    return {name: {"model": runtime.loaded.choice.path, "dtype": dtype_name(runtime.loaded.choice.dtype),
                   "compile": runtime.loaded.compile.reason, "batch_setting": runtime.batch_setting,
                   "batch_plan": describe_plan(runtime.plan)} for name, runtime in runtimes.items()}


def combine_runtimes(runtimes: dict[str, Runtime]) -> Runtime:
    """One runtime for several models sharing one tokenizer and max length: the models' job and model sets,
    the tightest of their batch limits and memory plans. Its choice is the first model's, with the path,
    dtype reason and compile said per model."""
    first = next(iter(runtimes.values()))
    loaded = {name: runtime.loaded for name, runtime in runtimes.items()}
    choice = dataclasses.replace(
        first.loaded.choice, path=per_model(runtimes, lambda r: r.loaded.choice.path),
        dtype_reason=per_model(runtimes, lambda r: r.loaded.choice.dtype_reason))
    compile_choice = CompileChoice(any(each.compile.compiled for each in loaded.values()),
                                   per_model(runtimes, lambda r: r.loaded.compile.reason),
                                   sum(each.compile.compile_s for each in loaded.values()))
    limits = [each.position_limit for each in loaded.values() if each.position_limit is not None]
    combined = LoadedModel(choice, ModelSetJob({name: each.job for name, each in loaded.items()}),
                           ModelSet({name: each.model for name, each in loaded.items()}), first.loaded.tokenizer,
                           compile_choice, min(limits, key=lambda limit: limit.tokens, default=None),
                           per_model(runtimes, lambda r: r.loaded.unpad))
    return Runtime(combined, tightest([runtime.batch for runtime in runtimes.values()]),
                   per_model(runtimes, lambda r: r.batch_setting), first.plan,
                   TightestLimits({name: runtime.limits for name, runtime in runtimes.items()}), {},
                   first.resolved, first.input, runtimes)
