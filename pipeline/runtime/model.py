"""The last step of the one setup (`pipeline.runtime.open_runtime`): the model of a settled
`ModelChoice` (`runtime/choice.py`) loaded once with its tokenizer, the max length checked
against it, the device prepared, and the compile decision (`runtime/compile_decision.py`) made."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.core.clock import SetupClock
from pipeline.core.compile import CompileChoice
from pipeline.core.device import keep_freed_host_memory
from pipeline.core.positions import PositionLimit, check_max_length, position_limit
from pipeline.core.settings import TRUNCATE, BatchSettings, CacheSettings, LongRowSettings, ModelSettings
from pipeline.core.tokenize import TokenizerSpec, count_prompt_tokens, load_tokenizer_spec
from pipeline.core.unpadded import settle_unpad
from pipeline.runtime.choice import ModelChoice, choose_model
from pipeline.runtime.compile_decision import settle_compile

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    choice: ModelChoice
    job: object  # jobs.base.Job
    model: torch.nn.Module  # what runs: compiled when `compile.compiled`
    tokenizer: TokenizerSpec
    compile: CompileChoice = CompileChoice(False, "eager")
    position_limit: PositionLimit | None = None  # the longest row the model takes
    unpad: str = "padded"  # which forward runs padded batches, and why (--unpad; core/unpadded.py)


def load_model(settings: ModelSettings, batch: BatchSettings, choice: ModelChoice | None = None,
               cache: CacheSettings = CacheSettings()) -> LoadedModel:
    """`load_chosen` of `settings` alone: the model settled here unless given, its tokenizer truncating long rows,
    no workload (a service's: counted as large)."""
    choice = choice or choose_model(settings, cache.plan_cache)
    return load_chosen(settings, batch, choice, tokenizer_for(settings, choice), cache=cache)


def load_chosen(settings: ModelSettings, batch: BatchSettings, choice: ModelChoice, tokenizer: TokenizerSpec,
                workload: Callable[[TokenizerSpec], float] | None = None, clock: SetupClock | None = None,
                cache: CacheSettings = CacheSettings()) -> LoadedModel:
    """The settled model (`choice`) loaded once, for `tokenizer` (`tokenizer_for`), the max length checked
    against the model, the host allocator set up for the device (see `keep_freed_host_memory`), and the forward
    compiled where `settings.compile` and a measurement say so. `workload(tokenizer)` estimates the job's tokens
    (None: unknown, a sweep or a service, counted as large). `clock` records the steps' seconds; `cache`: where
    the compile verdicts are kept."""
    clock = clock or SetupClock()
    if choice.device.type == "cuda":
        torch.cuda.set_device(choice.device)  # cuda:N current for the main thread (kernels, caches, streams)
    job = choice.job
    with clock.step("model load"):
        model = job.load(choice.path, choice.device, choice.dtype, prompt_tokens=count_prompt_tokens(tokenizer),
                         **choice.job_options, allow_pickle=settings.allow_pickle,
                         trust_remote_code=settings.trust_remote_code, attention=choice.attention)
    limit = position_limit(model)
    check_max_length(limit, choice.max_length, model.config.model_type)
    keep_freed_host_memory(choice.device)
    with clock.step("compile decision"):
        if tokenizer.pair_types:  # the package is exported with ids and mask only
            compile_choice = CompileChoice(False, "eager: a pair's token type ids (a compiled forward takes ids "
                                                  "and mask only)")
        else:
            model, compile_choice = settle_compile(settings, batch, cache, choice, job, model,
                                                   workload(tokenizer) if workload else None)
    log.info(compile_choice.reason + (f" ({compile_choice.compile_s:.1f} s to compile)" if compile_choice.compiled
                                      else ""))
    unpad = "padded: the forward runs compiled" if compile_choice.compiled else settle_unpad(
        settings.unpad, job, model, choice.device, choice.dtype)
    log.info(f"unpad {unpad}")
    return LoadedModel(choice, job, model, tokenizer, compile_choice, limit, unpad)


def tokenizer_for(settings: ModelSettings, choice: ModelChoice, long_rows: LongRowSettings = TRUNCATE) -> TokenizerSpec:
    """The run's tokenizer: the model's, truncating at the chosen max length, with its prompt;
    where `long_rows` splits this job's long rows, cutting them into segments (`LongRowSettings.split_length`)."""
    spec = load_tokenizer_spec(choice.path, choice.max_length, settings.trust_remote_code, choice.prompt,
                               choice.lowercase, pair="pair" in choice.job.inputs)
    segment_length = long_rows.split_length(settings.job, choice.max_length)
    if segment_length is not None:
        spec = dataclasses.replace(spec, segment_length=segment_length)
    return spec
