"""The local engine for a run of several models (docs/jobs.md "Several models, one pass"): each model settled
and opened as a one-model run's, one tokenizer pool for all, and one shard runner whose job runs every batch
through each model. The claim, resume, --reuse and commit are the one-model run's (`run_claimed`)."""

from __future__ import annotations

import functools

from pipeline.core.clock import SetupClock
from pipeline.core.device import dtype_name
from pipeline.core.probe import describe_plan
from pipeline.core.settings import tokenize_workers_for
from pipeline.core.tokenize import TokenizerPool
from pipeline.engines.claim import run_claimed
from pipeline.offline.config import RunConfig
from pipeline.offline.model_set import model_configs, models_summary
from pipeline.offline.runner import ShardRunner
from pipeline.offline.source import Shard, WorkerSlot
from pipeline.offline.summary import RunSummary
from pipeline.offline.workload import InputSample
from pipeline.runtime import open_runtime
from pipeline.runtime.model_set import ModelSetChoice, choose_model_set, combine_runtimes


def run_model_set(config: RunConfig, slot: WorkerSlot) -> RunSummary:
    """`run_job` for several models: the summary with its `models` object."""
    opened: dict[str, dict] = {}
    summary = run_claimed(config, slot, functools.partial(prepare_model_set, opened=opened), choose_models_here)
    summary.models = models_summary(config, summary.computed_rows, summary.reused_rows, summary.flagged_by_label,
                                    opened)
    if opened:
        summary.batch_plan = "; ".join(f"{name}: {each['batch_plan']}" for name, each in opened.items())
    return summary


def choose_models_here(config: RunConfig, dtype_source: str | None, trial_texts) -> ModelSetChoice:
    configs = model_configs(config)
    return choose_model_set({name: each.model for name, each in configs.items()}, config.cache.plan_cache,
                            config.runtime_needs().long_rows, dtype_source, trial_texts)


def prepare_model_set(config: RunConfig, choice: ModelSetChoice, todo: list[Shard], clock: SetupClock,
                      opened: dict) -> tuple[ShardRunner, RunConfig]:
    """The pool started first, then each model's runtime opened as a one-model run opens it (its dtype,
    compile, limits and memory plan), combined (`combine_runtimes`); the config with each model's --compile
    settled. `opened` receives what each model settled, for the summary."""
    configs = model_configs(config)
    pool = TokenizerPool(choice.tokenizer, tokenize_workers_for(config.tokenize_workers, choice.device.type),
                         wait=False)
    try:
        sample = InputSample(todo, config.source)
        runtimes = {name: open_runtime(configs[name], sample, choice=each, tokenizer=choice.tokenizer, clock=clock)
                    for name, each in choice.choices.items()}
        opened.update({name: {"model": runtime.loaded.choice.path,
                              "dtype": dtype_name(runtime.loaded.choice.dtype),
                              "compile": runtime.loaded.compile.reason, "batch_setting": runtime.batch_setting,
                              "batch_plan": describe_plan(runtime.plan)} for name, runtime in runtimes.items()})
        models = {name: {**settings, "compile": "on" if runtimes[name].loaded.compile.compiled else "off"}
                  for name, settings in config.models.items()}
        settled = config.with_settings(models=models)
        return ShardRunner(settled, combine_runtimes(runtimes), pool, clock), settled
    except BaseException:
        pool.close()
        raise
