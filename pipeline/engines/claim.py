"""The claim-and-run shell every engine shares: settle the model, check the output's settings, let
the engine load what it runs, then lock and claim the output and run the pending shards."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Protocol

from pipeline.core.clock import SetupClock
from pipeline.core.device import DTYPES, dtype_name
from pipeline.core.errors import UsageError
from pipeline.runtime.model import ModelChoice, choose_model, model_content_hash
from pipeline.offline.config import RunConfig
from pipeline.offline.locations import check_locations
from pipeline.offline.manifest import (
    RunManifest,
    done_marker_problem,
    fingerprint_differences,
    pending,
    recorded_config,
)
from pipeline.offline.reuse import check_reusable, recorded_dtype, recorded_long_text, remove_stale_hash_temporaries
from pipeline.offline.sink import ShardSink
from pipeline.offline.source import Shard, WorkerSlot, list_shards
from pipeline.offline.summary import RunSummary, output_totals
from pipeline.offline.workload import sample_texts

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
    check_locations(config.source.input, config.output, config.source.storage_options, config.reuse)
    with clock.step("shards"):
        shards = list_shards(config.source.input, config.source.id_column, config.source.text_column, config.source.storage_options, slot,
                             config.keep_columns, config.source.split)
    if slot.count > 1:
        log.info(f"{slot.describe()}: {len(shards)} shard(s)")
    sink = ShardSink(config.output, config.source.storage_options)
    manifest = RunManifest(sink.fs, sink.output_dir)
    config, dtype_source = keep_recorded_choices(config, manifest)
    # the bf16 trial of --dtype auto runs on the job's own rows
    trial_texts = functools.partial(sample_texts, shards, config.source.id_column, config.source.text_column, config.source.storage_options)
    with clock.step("model code and dtype"):  # importing the architecture's code is most of it
        choice = (choose or choose_here)(config, dtype_source, trial_texts)
    with clock.step("output check"):
        fingerprint = output_fingerprint(config, choice)
        refuse_other_settings(config, manifest.read_run(), fingerprint)
        if config.reuse:
            check_reusable(config.reuse, config.output, config.source.storage_options, fingerprint)
        todo = shards if config.overwrite else pending_shards(shards, manifest, sink)
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


def choose_here(config: RunConfig, dtype_source: str | None, trial_texts) -> ModelChoice:
    """The run's model settled in this process (a local run; the Ray engine settles it for its actors)."""
    return choose_model(config.model, config.batch.plan_cache, dtype_source, trial_texts)


def nothing_to_clean_or_wait_for(shards: list[Shard], sink: ShardSink, manifest: RunManifest) -> bool:
    """With every shard done, whether the run may end without the lock: run.json records the run
    (a deleted one is written anew on the locked path), no attempt left a temporary file of these
    shards (the locked path removes it), and no live process holds a lock on the output (the
    locked path refuses beside it, as ever: it may be an --overwrite)."""
    return manifest.read_run() is not None and not sink.stale_temporaries([shard.stem for shard in shards]) and \
        not any(holder.get("alive", True) for holder in manifest.read_locks())


def nothing_to_do(shards: list[Shard], config: RunConfig, manifest: RunManifest, started: float) -> RunSummary:
    """Every shard of this worker is done: the summary of a run that writes nothing, so no lock
    is taken and a complete output answers 0 even on read-only storage. (Done shards become
    pending again only under --overwrite, which never comes here.)"""
    log.info(f"nothing to do: {len(shards)} of {len(shards)} shards done")
    summary = RunSummary(shards=len(shards), shards_done_before=len(shards), output=config.output,
                         nothing_to_do=True)
    summary.output_totals = output_totals(manifest.shard_markers().values())
    summary.wall_s = time.perf_counter() - started
    return summary


def close_runner(run_shards: ShardsRunner) -> None:
    close = getattr(run_shards, "close", None)
    if close is not None:
        close()


def keep_recorded_choices(config: RunConfig, manifest: RunManifest) -> tuple[RunConfig, str | None]:
    """`--dtype auto`, `--compile auto` and `--long-text auto` on an output that already holds
    results keep what they were made with: a rerun on another node, or a trial landing on the other side of its
    threshold, must not turn a resume into a refusal, split one output across two dtypes, or
    compile a resume of a few rows (or not compile a long one). With --reuse, `auto` dtype and long text
    take what the previous output was made with, so that the two fingerprints agree (an explicit setting
    that differs is refused by check_reusable). Returns the config, changed once, and where its dtype came
    from (None: from the user's settings)."""
    changes, dtype_source = {}, None
    recorded = manifest.read_run() if not config.overwrite else None
    if recorded:
        dtype = recorded["fingerprint"].get("dtype")
        if config.model.dtype == "auto" and dtype in DTYPES:
            changes["dtype"], dtype_source = dtype, f"what {config.output} was made with (--dtype auto)"
        if config.long_text == "auto":  # an output made before --long-text existed was truncated
            changes["long_text"] = recorded["fingerprint"].get("long_text", "truncate")
        compiled = recorded.get("config", {}).get("compile")
        if config.model.compile == "auto" and compiled in ("on", "off"):
            log.info(f"compile {compiled}: what {config.output} was made with (--compile auto)")
            changes["compile"] = compiled
    if config.reuse and changes.get("dtype", config.model.dtype) == "auto":
        dtype = recorded_dtype(config.reuse, config.source.storage_options)
        if dtype in DTYPES:
            changes["dtype"], dtype_source = dtype, f"what {config.reuse} was made with (--dtype auto, --reuse)"
    if config.reuse and changes.get("long_text", config.long_text) == "auto":
        changes["long_text"] = recorded_long_text(config.reuse, config.source.storage_options) or "auto"
    return config.with_settings(**changes), dtype_source


def refuse_other_settings(config: RunConfig, recorded: dict | None, fingerprint: dict) -> None:
    """An output holding results of other settings is resumed only with --overwrite."""
    if recorded and recorded["fingerprint"] != fingerprint and not config.overwrite:
        raise UsageError(f"{config.output} holds results made with other settings "
                         f"({'; '.join(fingerprint_differences(recorded['fingerprint'], fingerprint))}); "
                         "rerun with the same settings, choose another --output, or add --overwrite to redo it")


def pending_shards(shards: list[Shard], manifest: RunManifest, sink: ShardSink) -> list[Shard]:
    """The shards not yet done, in input order: failed ones are retried, and so is a shard whose
    done marker its output does not back (untrusted_done_markers)."""
    markers = manifest.shard_markers()
    return pending_of(shards, markers, untrusted_done_markers(shards, markers, sink))


def pending_of(shards: list[Shard], markers: dict[str, dict], untrusted: dict[str, str]) -> list[Shard]:
    """`shards` less those whose done marker is trusted, in input order."""
    done = {stem for stem, marker in markers.items() if marker["status"] == "done" and stem not in untrusted}
    todo_stems = set(pending([s.stem for s in shards], done))
    return [shard for shard in shards if shard.stem in todo_stems]


def untrusted_done_markers(shards: list[Shard], markers: dict[str, dict], sink: ShardSink) -> dict[str, str]:
    """Stem → why its done marker is not backed by its output (a file deleted or replaced by hand, an input
    shard rewritten since): such a shard is redone."""
    done = [shard for shard in shards if markers.get(shard.stem, {}).get("status") == "done"]
    if not done:
        return {}
    sizes = sink.output_bytes()
    problems = {shard.stem: done_marker_problem(markers[shard.stem], shard.num_rows, sizes.get(shard.stem),
                                                lambda stem=shard.stem: sink.output_rows(stem)) for shard in done}
    return {stem: problem for stem, problem in problems.items() if problem}


def claim_output(config: RunConfig, fingerprint: dict, shards: list[Shard], sink: ShardSink,
                 manifest: RunManifest, slot: WorkerSlot = WorkerSlot()) -> list[Shard]:
    """Under this worker's lock: check the output holds results of these settings (or clear
    this worker's shards for --overwrite), record the run, and return the shards still to do,
    in input order. Only `shards` (this worker's) are touched: other workers may be writing
    theirs."""
    recorded = manifest.read_run()
    refuse_other_settings(config, recorded, fingerprint)
    stems = [shard.stem for shard in shards]
    if config.overwrite:
        manifest.clear_markers(stems)
        sink.remove_outputs(stems)
    if (sink.remove_stale_temporaries(stems) + remove_stale_hash_temporaries(manifest, stems)
            + manifest.remove_stale_temporaries(stems)):
        log.info("removed temporary files of an interrupted run")
    markers = manifest.shard_markers()
    untrusted = untrusted_done_markers(shards, markers, sink)
    for shard in shards:
        if shard.stem in untrusted:
            log.warning(f"{shard.url} is marked done but {untrusted[shard.stem]}; redoing it")
    manifest.clear_markers(list(untrusted))
    if recorded is None or recorded["fingerprint"] != fingerprint or slot.count == 1:
        manifest.write_run(fingerprint, recorded_config(config))  # once for N workers: they all check it
    todo = pending_of(shards, markers, untrusted)  # one listing of the markers and the output, not two
    if not todo:
        log.info(f"nothing to do: {len(shards)} of {len(shards)} shards done")
    elif len(todo) < len(shards):
        log.info(f"{len(shards) - len(todo)} of {len(shards)} shards already done, resuming")
    return todo


def output_fingerprint(config: RunConfig, choice: ModelChoice) -> dict:
    """Everything that changes the output values. Batch sizes, workers and memory settings
    are left out on purpose: they must not change results."""
    return {"job": config.model.job, "model": model_content_hash(choice.path, config.batch.plan_cache),
            "max_length": choice.max_length,
            "dtype": dtype_name(choice.dtype), "attention": choice.attention, "prompt": choice.prompt,
            "id_column": config.source.id_column, "text_column": config.source.text_column, **choice.job_options,
            **({"keep_columns": list(config.keep_columns)} if config.keep_columns else {}),
            **long_text_fingerprint(config, choice.max_length)}


def long_text_fingerprint(config: RunConfig, max_length: int) -> dict:
    """Nothing for truncate (so outputs made before --long-text existed still match); split and
    its segment length for split."""
    segment_length = config.split_length(max_length)
    return {} if segment_length is None else {"long_text": "split", "segment_length": segment_length}

