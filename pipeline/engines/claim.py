"""The claim-and-run shell every engine shares: settle the model, check the output's settings, let
the engine load what it runs, then lock and claim the output and run the pending shards. What the
output holds and how it is claimed is `offline/claim.py`'s; an engine moves shard lists and summaries."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Protocol

from pipeline.core.clock import SetupClock
from pipeline.offline.claim import (
    claim_output,
    done_with,
    keep_recorded_choices,
    nothing_to_clean_or_wait_for,
    nothing_to_do,
    output_fingerprint,
    pending_shards,
    refuse_other_settings,
)
from pipeline.offline.config import RunConfig, check_named_inputs
from pipeline.offline.locations import check_locations
from pipeline.offline.manifest import RunManifest
from pipeline.offline.reuse import check_reusable
from pipeline.offline.sink import ShardSink
from pipeline.offline.source import Shard, WorkerSlot, list_source_shards
from pipeline.offline.summary import RunSummary, output_totals
from pipeline.offline.workload import InputSample
from pipeline.runtime.choice import ModelChoice, choose_model

log = logging.getLogger(__name__)


class ShardsRunner(Protocol):
    """What an engine runs a list of shards with, once the output is claimed. One with a `close()`
    holds something started ahead (the local engine's tokenizer pool): run_claimed closes it when the
    run is over, or when it never comes (the claim failed, or another worker did every shard meanwhile)."""

    def __call__(self, todo: list[Shard], sink: ShardSink, manifest: RunManifest, summary: RunSummary,
                 started: float) -> None:
        """Run `todo` into `sink`, marking each shard in `manifest` and adding to `summary`; time
        since `started` counts as setup."""


class PrepareEngine(Protocol):
    """An engine's setup: load and check what it runs before the output is touched."""

    def __call__(self, config: RunConfig, choice: ModelChoice, todo: list[Shard],
                 clock: SetupClock) -> tuple[ShardsRunner, RunConfig]:
        """The shards runner for `todo` (its setup steps timed on `clock`) and the config as the
        engine settled it (e.g. --compile auto → on or off), as run.json records it."""


def run_claimed(config: RunConfig, slot: WorkerSlot, prepare_engine: PrepareEngine,
                choose: Callable[..., ModelChoice] | None = None) -> RunSummary:
    """What every engine shares: list this slot's shards, settle the model (`choose`: the Ray
    engine settles it for its actors) and check the output's recorded settings, let
    `prepare_engine(config, choice, todo)` load and check what it runs, and only then create the
    output, hold this slot's lock and claim the output; run the pending shards with what the
    engine prepared and record this worker's summary.
    Every usage error comes before the first write, so it leaves the output untouched."""
    started, clock = time.perf_counter(), SetupClock()
    check_named_inputs(config.model.job, config.source.pair_column, config.long_rows.long_text)
    check_locations(config.source.input, config.output, config.source.storage_options, config.reuse)
    with clock.step("shards"):
        shards = list_source_shards(config.source, slot, config.keep_columns)
    if slot.count > 1:
        log.info(f"{slot.describe()}: {len(shards)} shard(s)")
    sink = ShardSink(config.output, config.source.storage_options)
    manifest = RunManifest(sink.fs, sink.output_dir)
    config, dtype_source = keep_recorded_choices(config, manifest)
    trial_texts = InputSample(shards, config.source).texts  # the bf16 trial of --dtype auto runs on the job's rows
    with clock.step("model code and dtype"):  # importing the architecture's code is most of it
        choice = (choose or choose_here)(config, dtype_source, trial_texts)
    with clock.step("output check"):
        fingerprint = output_fingerprint(config, choice)
        refuse_other_settings(config, manifest.read_run(), fingerprint)
        if config.reuse:
            check_reusable(config.reuse, config.output, config.source.storage_options, fingerprint)
        todo = shards if config.overwrite else pending_shards(shards, manifest, sink,
                                                              done_with(config, fingerprint))
    if not todo and nothing_to_clean_or_wait_for(shards, sink, manifest):
        return nothing_to_do(shards, config, manifest, started)
    with contextlib.ExitStack() as cleanup:
        run_shards = None
        if todo:
            run_shards, config = prepare_engine(config, choice, todo, clock)
            cleanup.callback(close_runner, run_shards)
        sink.create()
        lock_note = manifest.acquire_lock(slot, config.lock_lease_s)
        cleanup.callback(manifest.release_lock, slot)
        if lock_note:
            log.warning(lock_note)
        with clock.step("output claim"):
            todo = claim_output(config, fingerprint, shards, sink, manifest, slot)
        summary = RunSummary(shards=len(shards), shards_done_before=len(shards) - len(todo), output=config.output,
                             nothing_to_do=not todo)
        if todo:
            if run_shards is None:  # done shards can only become pending again under --overwrite
                run_shards, config = prepare_engine(config, choice, todo, clock)
                cleanup.callback(close_runner, run_shards)
            run_shards(todo, sink, manifest, summary, started)
        summary.wall_s = time.perf_counter() - started
        summary.output_totals = output_totals(manifest.shard_markers().values())
        manifest.write_worker_summary(slot, dataclasses.asdict(summary))
        return summary


def choose_here(config: RunConfig, dtype_source: str | None, trial_texts,
                choose_one: Callable[..., ModelChoice] = choose_model) -> ModelChoice:
    """The run's model settled by `choose_one` (`choose_model`'s arguments): in this process, or for the Ray
    actors by the cluster's resources."""
    return choose_one(config.model, config.cache.plan_cache, dtype_source, trial_texts)


def close_runner(run_shards: ShardsRunner) -> None:
    close = getattr(run_shards, "close", None)
    if close is not None:
        close()