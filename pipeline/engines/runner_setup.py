"""Opening a shard runner: the one setup a local run and a Ray actor share, for one model or several (docs/jobs.md
"Several models, one pass"). The producer and its tokenizer pool start first (offline/producer.py; on CUDA in a
feeder process), so that their processes come up while the models load;
the models are opened as `plan` opens them (`open_chosen_models`)."""

from __future__ import annotations

from typing import NamedTuple

from pipeline.core.clock import SetupClock
from pipeline.core.settings import tokenize_workers_for
from pipeline.offline.carry import Carry
from pipeline.offline.config import RunConfig
from pipeline.offline.feeder import producer_for
from pipeline.offline.model_set_setup import one_model_set, open_chosen_models
from pipeline.offline.runner import ShardRunner
from pipeline.runtime import InputRows
from pipeline.runtime.choice import ModelChoice
from pipeline.runtime.model_set import ModelSetChoice


class OpenedRunner(NamedTuple):
    runner: ShardRunner
    config: RunConfig  # with --compile auto settled (each model's, for several), as run.json records it
    opened: dict[str, dict]  # what each model's runtime settled, by name (ONE_MODEL for a one-model run)


def open_shard_runner(config: RunConfig, choice: ModelChoice | ModelSetChoice, rows: InputRows | None,
                      clock: SetupClock, *, keep_pool: bool = False, carry: Carry | None = None) -> OpenedRunner:
    """The shard runner of `config`'s model, or models, as `choice` settled them. `rows`: the input its
    --compile auto weighs (None: a Ray actor, which gets its shards later); `keep_pool`: one tokenizer pool for
    every `run` (an actor's); `carry`: a change of models (offline/carry.py)."""
    with clock.step("tokenizer"):
        models = choice if config.models else one_model_set(config, choice)
        producer = producer_for(models.tokenizer, tokenize_workers_for(config.tokenize_workers, choice.device.type),
                                choice.device.type, keep_pool)
    try:
        opened = open_chosen_models(config, models, rows, clock)
        runner = ShardRunner(opened.config, opened.runtime, producer, clock, carry=carry)
    except BaseException:
        producer.close()
        raise
    return OpenedRunner(runner, opened.config, opened.settled())
