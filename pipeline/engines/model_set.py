"""A run of several models on any engine (docs/jobs.md "Several models, one pass"): each model settled as a
one-model run's, a change of models since the output was made found before the claim, and the summary's `models`
object. The claim, resume, --reuse and commit are the one-model run's (`run_claimed`); what loads the models is the
engine's (`prepare`: this process, or the Ray actors), and each opens them with `open_shard_runner`."""

from __future__ import annotations

from collections.abc import Callable

from pipeline.core.errors import UsageError
from pipeline.engines.claim import run_claimed
from pipeline.engines.local import prepare_here
from pipeline.offline.carry import Carry, carry_of
from pipeline.offline.claim import output_fingerprint
from pipeline.offline.config import RunConfig
from pipeline.offline.manifest import RunManifest
from pipeline.offline.model_set import model_change, models_summary
from pipeline.offline.model_set_setup import choose_models
from pipeline.offline.sink import ShardSink
from pipeline.offline.source import WorkerSlot
from pipeline.offline.summary import RunSummary
from pipeline.runtime.model_set import ModelSetChoice


def run_model_set(config: RunConfig, slot: WorkerSlot, prepare=prepare_here,
                  choose: Callable[..., ModelSetChoice] | None = None) -> RunSummary:
    """`run_job` for several models: the summary with its `models` object. `prepare(config, choice, todo, clock,
    carry=)`: the engine's setup (`prepare_here`), whose runner puts what each model settled in the summary's
    `models`; `choose`: how the models are settled (`choose_models`; the Ray engine settles them for its actors)."""
    carrying: list[Carry] = []  # the change of models found before the claim, if any

    def prepare_models(config: RunConfig, choice: ModelSetChoice, todo, clock):
        carry = change_of_models(config, choice)
        carrying[:] = [carry] if carry is not None else []
        return prepare(config, choice, todo, clock, carry=carry)

    summary = run_claimed(config, slot, prepare_models, choose or choose_models)
    opened = summary.models  # what each model settled (nothing where no shard ran)
    summary.models = models_summary(config, summary.computed_rows, summary.reused_rows, summary.flagged_by_label,
                                    opened, summary.reuse.get("carried", 0),
                                    carrying[0].computed if carrying else tuple(config.models))
    if opened:
        summary.batch_plan = "; ".join(f"{name}: {each['batch_plan']}" for name, each in opened.items())
    return summary


def change_of_models(config: RunConfig, choice: ModelSetChoice) -> Carry | None:
    """A change of models since the output was made (offline/carry.py), which the shard runners carry; with
    --reuse a UsageError. Read before the claim, which records the new models."""
    if config.overwrite:
        return None
    output = ShardSink(config.output, config.source.storage_options)
    carry = carry_of(model_change(RunManifest(output.fs, output.output_dir).read_run(),
                                  output_fingerprint(config, choice)))
    if carry is not None and config.reuse:
        raise UsageError("--reuse with a change of models since the output was made: finish the change without "
                         "--reuse first, or drop --reuse")
    return carry
