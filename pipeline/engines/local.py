"""The local engine: the shard runner in this process (or worker I of N with --num-shards)."""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Mapping

from pipeline.core import exit_codes
from pipeline.core.clock import SetupClock
from pipeline.engines.claim import ShardsRunner, run_claimed
from pipeline.engines.runner_setup import open_shard_runner
from pipeline.offline.carry import Carry
from pipeline.offline.config import RunConfig
from pipeline.offline.source import Shard, resolve_worker_slot
from pipeline.offline.summary import RunSummary
from pipeline.offline.workload import InputSample
from pipeline.runtime.choice import ModelChoice
from pipeline.runtime.model_set import ModelSetChoice


def run_job(config: RunConfig, environ: Mapping[str, str] = os.environ) -> RunSummary:
    """Run `config` over every shard not yet done, in this process, and return the summary.
    With --num-shards N this process is one worker of N and takes its share of the shards
    (index from --shard-index or the scheduler's variable in `environ`).

    Raises UsageError on bad settings (nothing written). A shard that fails is recorded in
    the summary and the manifest and the others go on; the caller decides the exit code.
    """
    refuse_while_a_worker_starts()
    slot = resolve_worker_slot(config.num_shards, config.shard_index, environ)
    if config.models:
        from pipeline.engines.model_set import run_model_set

        return run_model_set(config, slot)
    return run_claimed(config, slot, prepare_here)


def refuse_while_a_worker_starts() -> None:
    """A spawned tokenizer worker re-runs the main script while it starts; if that script
    calls lengthwise without a main guard, end the worker here (before any lock, model or
    output is touched) with what to do. It exits rather than raises, so a try/except around
    the call cannot swallow it: the parent's pool then fails with WorkerStartError."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        print("lengthwise was called while a tokenizer worker process was starting: the script that calls it has "
              "no `if __name__ == \"__main__\":` guard, so each worker runs it again. Put the call under that guard, "
              "or set tokenize_workers=0", file=sys.stderr, flush=True)
        os._exit(exit_codes.USAGE)


def prepare_here(config: RunConfig, choice: ModelChoice | ModelSetChoice, todo: list[Shard], clock: SetupClock,
                 carry: Carry | None = None) -> tuple[ShardsRunner, RunConfig]:
    """The local engine: the model, or models (`carry`: a change of models), loaded once in this process
    (compiled if that pays back over `todo`); one shard runner for all shards; the config with --compile
    settled."""
    opening = open_shard_runner(config, choice, InputSample(todo, config.source), clock, carry=carry)
    return opening.runner, opening.config
