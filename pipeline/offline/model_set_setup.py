"""Opening a run's models: the one setup that `plan`, `plan --estimate` and the shard runner (a local run's, a Ray
actor's) share for several models (docs/jobs.md "Several models, one pass"), and a run's shard runner for one.
Each model is settled as a one-model run settles it and opened as one is (`open_chosen`: its dtype, compile,
limits and memory plan), with the one tokenizer they share; several are combined into one runtime whose job runs
every batch through each model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeline.core.clock import SetupClock
from pipeline.offline.config import RunConfig
from pipeline.offline.model_set import model_configs
from pipeline.runtime import InputRows, Runtime, open_chosen
from pipeline.runtime.choice import ModelChoice, choose_model
from pipeline.runtime.model import tokenizer_for
from pipeline.runtime.model_set import ModelSetChoice, choose_model_set, combine_runtimes, settled_models

ONE_MODEL = ""  # the name the model of a one-model run goes by among the opened models


def choose_models(config: RunConfig, dtype_source: str | None, trial_texts,
                  choose_one: Callable = choose_model) -> ModelSetChoice:
    """The run's models settled: each by `choose_one` (`choose_model`'s arguments; here, or for the Ray actors)."""
    configs = model_configs(config)
    return choose_model_set({name: each.model for name, each in configs.items()}, config.cache.plan_cache,
                            config.long_rows, dtype_source, trial_texts, choose_one)


def one_model_set(config: RunConfig, choice: ModelChoice) -> ModelSetChoice:
    """A one-model run's settled model as a set of one (`ONE_MODEL`), with its tokenizer loaded."""
    return ModelSetChoice({ONE_MODEL: choice}, tokenizer_for(config.model, choice, config.long_rows))


@dataclass
class OpenedModels:
    """A run's models opened, by name in the run's order: as they were settled, each one's config and runtime and
    the steps its opening took (the seconds its own run would spend on them), the one runtime that runs every
    batch, and the run's config with --compile auto settled (each model's), as run.json records it."""

    choice: ModelSetChoice
    configs: dict[str, RunConfig]
    runtimes: dict[str, Runtime]
    clocks: dict[str, SetupClock]
    runtime: Runtime
    config: RunConfig

    def settled(self) -> dict[str, dict]:
        """What each model settled, by name (`settled_models`)."""
        return settled_models(self.runtimes)


def open_models(config: RunConfig, clock: SetupClock | None = None) -> OpenedModels:
    """`config`'s models from its config alone (`plan`, the estimate): settled on the config's input, as a run
    settles them (--dtype auto's trial on its rows), and opened (`open_chosen_models`)."""
    rows = config.input_rows()
    return open_chosen_models(config, choose_models(config, None, rows.texts if rows else None), rows, clock)


def open_chosen_models(config: RunConfig, choice: ModelSetChoice, rows: InputRows | None = None,
                       clock: SetupClock | None = None) -> OpenedModels:
    """`config`'s models, as `choice` settled them (a one-model run's as `one_model_set`), opened with their one
    tokenizer. `rows`: the input whose work --compile auto weighs (None: a Ray actor's, which gets its shards
    later); `clock`: every model's steps, added up."""
    clock = clock or SetupClock()
    configs = model_configs(config) if config.models else {ONE_MODEL: config}
    clocks = {name: SetupClock() for name in choice.choices}
    runtimes = {name: open_chosen(configs[name], each, choice.tokenizer, rows, clocks[name])
                for name, each in choice.choices.items()}
    for each in clocks.values():
        clock.add_steps(each)
    if config.models:
        settled = config.with_settings(models={name: {**settings, "compile": compile_setting(runtimes[name])}
                                               for name, settings in config.models.items()})
        return OpenedModels(choice, configs, runtimes, clocks, combine_runtimes(runtimes), settled)
    runtime = runtimes[ONE_MODEL]
    settled = config.with_settings(compile=compile_setting(runtime))
    return OpenedModels(choice, configs, runtimes, clocks, runtime, settled)


def compile_setting(runtime: Runtime) -> str:
    return "on" if runtime.loaded.compile.compiled else "off"
