"""Opening a shard runner: the one setup a local run and a Ray actor share, for one model or several (docs/jobs.md
"Several models, one pass"). The tokenizer pool starts first, so that its processes come up while the models load;
each model's runtime is opened as a one-model run opens it (its dtype, compile, limits and memory plan); several
are combined into one runtime whose job runs every batch through each model."""

from __future__ import annotations

from typing import NamedTuple

from pipeline.core.clock import SetupClock
from pipeline.core.device import dtype_name
from pipeline.core.probe import describe_plan
from pipeline.core.settings import tokenize_workers_for
from pipeline.core.tokenize import TokenizerPool
from pipeline.offline.carry import Carry
from pipeline.offline.config import RunConfig
from pipeline.offline.model_set import model_configs
from pipeline.offline.runner import ShardRunner
from pipeline.runtime import InputRows, Runtime, open_runtime
from pipeline.runtime.choice import ModelChoice
from pipeline.runtime.model import tokenizer_for
from pipeline.runtime.model_set import ModelSetChoice, combine_runtimes

ONE_MODEL = ""  # the name `OpenedRunner.opened` gives the model of a one-model run


class OpenedRunner(NamedTuple):
    runner: ShardRunner
    config: RunConfig  # with --compile auto settled (each model's, for several), as run.json records it
    opened: dict[str, dict]  # what each model's runtime settled, by name (ONE_MODEL for a one-model run)


def open_shard_runner(config: RunConfig, choice: ModelChoice | ModelSetChoice, rows: InputRows | None,
                      clock: SetupClock, *, keep_pool: bool = False, carry: Carry | None = None) -> OpenedRunner:
    """The shard runner of `config`'s model, or models, as `choice` settled them. `rows`: the input its
    --dtype and --compile auto weigh (None: a Ray actor, which gets its shards later); `keep_pool`: one
    tokenizer pool for every `run` (an actor's); `carry`: a change of models (offline/carry.py)."""
    several = isinstance(choice, ModelSetChoice)
    configs = model_configs(config) if several else {ONE_MODEL: config}
    choices = choice.choices if several else {ONE_MODEL: choice}
    with clock.step("tokenizer"):
        tokenizer = choice.tokenizer if several else tokenizer_for(config.model, choice,
                                                                   config.runtime_needs().long_rows)
        pool = TokenizerPool(tokenizer, tokenize_workers_for(config.tokenize_workers, choice.device.type), wait=False)
    try:
        runtimes = {name: open_runtime(configs[name], rows, choice=each, tokenizer=tokenizer, clock=clock)
                    for name, each in choices.items()}
        if several:
            runtime = combine_runtimes(runtimes)
            settled = config.with_settings(models={name: {**settings, "compile": compile_setting(runtimes[name])}
                                                   for name, settings in config.models.items()})
        else:
            runtime = runtimes[ONE_MODEL]
            settled = config.with_settings(compile=compile_setting(runtime))
        runner = ShardRunner(settled, runtime, pool, clock, keep_pool=keep_pool, carry=carry)
    except BaseException:
        pool.close()
        raise
    return OpenedRunner(runner, settled, {name: settled_model(each) for name, each in runtimes.items()})


def compile_setting(runtime: Runtime) -> str:
    return "on" if runtime.loaded.compile.compiled else "off"


def settled_model(runtime: Runtime) -> dict:
    """What the summary says of one model of a run of several: its folder, dtype, compile and batch limits."""
    return {"model": runtime.loaded.choice.path, "dtype": dtype_name(runtime.loaded.choice.dtype),
            "compile": runtime.loaded.compile.reason, "batch_setting": runtime.batch_setting,
            "batch_plan": describe_plan(runtime.plan)}
