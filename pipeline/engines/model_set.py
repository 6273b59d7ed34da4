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
from pipeline.core.errors import UsageError
from pipeline.offline.carry import Carry, carry_of
from pipeline.offline.claim import output_fingerprint
from pipeline.offline.config import RunConfig
from pipeline.offline.manifest import RunManifest
from pipeline.offline.model_set import model_change, model_configs, models_summary
from pipeline.offline.runner import ShardRunner
from pipeline.offline.sink import ShardSink
from pipeline.offline.source import Shard, WorkerSlot
from pipeline.offline.summary import RunSummary
from pipeline.offline.workload import InputSample
from pipeline.runtime import open_runtime
from pipeline.runtime.model_set import ModelSetChoice, choose_model_set, combine_runtimes


def run_model_set(config: RunConfig, slot: WorkerSlot) -> RunSummary:
    """`run_job` for several models: the summary with its `models` object."""
    opened: dict[str, dict] = {}
    carrying: list[Carry] = []
    summary = run_claimed(config, slot, functools.partial(prepare_model_set, opened=opened, carrying=carrying),
                          choose_models_here)
    summary.models = models_summary(config, summary.computed_rows, summary.reused_rows, summary.flagged_by_label,
                                    opened, summary.reuse.get("carried", 0),
                                    carrying[0].computed if carrying else tuple(config.models))
    if opened:
        summary.batch_plan = "; ".join(f"{name}: {each['batch_plan']}" for name, each in opened.items())
    return summary


def choose_models_here(config: RunConfig, dtype_source: str | None, trial_texts) -> ModelSetChoice:
    configs = model_configs(config)
    return choose_model_set({name: each.model for name, each in configs.items()}, config.cache.plan_cache,
                            config.runtime_needs().long_rows, dtype_source, trial_texts)


def prepare_model_set(config: RunConfig, choice: ModelSetChoice, todo: list[Shard], clock: SetupClock,
                      opened: dict, carrying: list) -> tuple[ShardRunner, RunConfig]:
    """The pool started first, then each model's runtime opened as a one-model run opens it (its dtype,
    compile, limits and memory plan), combined (`combine_runtimes`); the config with each model's --compile
    settled. `opened` receives what each model settled, for the summary; `carrying`, a change of models
    since the output was made (offline/carry.py), which the runner carries."""
    configs = model_configs(config)
    output = ShardSink(config.output, config.source.storage_options)
    carry = None if config.overwrite else carry_of(model_change(RunManifest(output.fs, output.output_dir).read_run(),
                                                                output_fingerprint(config, choice)))
    if carry is not None and config.reuse:
        raise UsageError("--reuse with a change of models since the output was made: finish the change without "
                         "--reuse first, or drop --reuse")
    carrying[:] = [carry] if carry is not None else []
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
        return ShardRunner(settled, combine_runtimes(runtimes), pool, clock, carry=carry), settled
    except BaseException:
        pool.close()
        raise
