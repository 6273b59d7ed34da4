"""The claim-and-run shell every engine shares: settle the model, check the output's settings, let
the engine load what it runs, then lock and claim the output and run the pending shards."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from pipeline.core.device import DTYPES, dtype_name
from pipeline.core.errors import UsageError
from pipeline.core.model import ModelChoice, choose_model, model_content_hash
from pipeline.core.settings import RunConfig
from pipeline.offline.manifest import RunManifest, fingerprint_differences, pending, recorded_config
from pipeline.offline.reuse import check_reusable, recorded_dtype
from pipeline.offline.sink import ShardSink
from pipeline.offline.source import Shard, WorkerSlot, list_shards
from pipeline.offline.summary import RunSummary

log = logging.getLogger(__name__)


# Runs a list of shards into the sink: (todo, sink, manifest, summary, started) → None
ShardsRunner = Callable[[list[Shard], ShardSink, RunManifest, RunSummary, float], None]
# An engine: loads and checks what it runs for (config, model choice), before the output is touched
PrepareEngine = Callable[[RunConfig, ModelChoice], ShardsRunner]


def run_claimed(config: RunConfig, slot: WorkerSlot, prepare_engine: PrepareEngine) -> RunSummary:
    """What every engine shares: list this slot's shards, settle the model and check the
    output's recorded settings, let `prepare_engine(config, choice)` load and check what it
    runs, and only then create the output, hold this slot's lock and claim the output; run
    the pending shards with what the engine prepared and record this worker's summary.
    Every usage error comes before the first write, so it leaves the output untouched."""
    started = time.perf_counter()
    shards = list_shards(config.input, config.id_column, config.text_column, config.storage_options, slot,
                         config.keep_columns, config.split)
    if slot.count > 1:
        log.info(f"{slot.describe()}: {len(shards)} shard(s)")
    sink = ShardSink(config.output, config.storage_options)
    manifest = RunManifest(sink.fs, sink.output_dir)
    config = keep_recorded_dtype(config, manifest)
    config = keep_reused_dtype(config)
    choice = choose_model(config)
    fingerprint = output_fingerprint(config, choice)
    refuse_other_settings(config, manifest.read_run(), fingerprint)
    if config.reuse:
        check_reusable(config.reuse, config.output, config.storage_options, fingerprint)
    run_shards = prepare_engine(config, choice) if config.overwrite or pending_shards(shards, manifest) else None
    sink.create()
    lock_note = manifest.acquire_lock(slot)
    if lock_note:
        log.warning(lock_note)
    try:
        todo = claim_output(config, fingerprint, shards, sink, manifest, slot)
        summary = RunSummary(shards=len(shards), shards_done_before=len(shards) - len(todo), output=config.output)
        if todo:
            run_shards = run_shards or prepare_engine(config, choice)
            run_shards(todo, sink, manifest, summary, started)
        summary.wall_s = time.perf_counter() - started
        manifest.write_worker_summary(slot, dataclasses.asdict(summary))
        return summary
    finally:
        manifest.release_lock(slot)


def keep_recorded_dtype(config: RunConfig, manifest: RunManifest) -> RunConfig:
    """`--dtype auto` on an output that already holds results keeps the dtype they were made
    with: a rerun on another node, or a bf16 trial landing on the other side of its threshold,
    must not turn a resume into a refusal or split one output across two dtypes."""
    recorded = manifest.read_run()
    dtype = recorded and recorded["fingerprint"].get("dtype")
    if config.dtype != "auto" or config.overwrite or dtype not in DTYPES:
        return config
    log.info(f"dtype {dtype}: what {config.output} was made with (--dtype auto)")
    return dataclasses.replace(config, dtype=dtype)


def keep_reused_dtype(config: RunConfig) -> RunConfig:
    """`--dtype auto` with --reuse takes the dtype the previous output was made with, so that
    the two fingerprints agree (an explicit --dtype that differs is refused by check_reusable)."""
    if not config.reuse or config.dtype != "auto":
        return config
    dtype = recorded_dtype(config.reuse, config.storage_options)
    return dataclasses.replace(config, dtype=dtype) if dtype in DTYPES else config


def refuse_other_settings(config: RunConfig, recorded: dict | None, fingerprint: dict) -> None:
    """An output holding results of other settings is resumed only with --overwrite."""
    if recorded and recorded["fingerprint"] != fingerprint and not config.overwrite:
        raise UsageError(f"{config.output} holds results made with other settings "
                         f"({'; '.join(fingerprint_differences(recorded['fingerprint'], fingerprint))}); "
                         "rerun with the same settings, choose another --output, or add --overwrite to redo it")


def pending_shards(shards: list[Shard], manifest: RunManifest) -> list[Shard]:
    """The shards not yet done, in input order (failed ones are retried)."""
    done = {stem for stem, marker in manifest.shard_markers().items() if marker["status"] == "done"}
    todo_stems = set(pending([s.stem for s in shards], done))
    return [shard for shard in shards if shard.stem in todo_stems]


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
    if sink.remove_stale_temporaries(stems):
        log.info("removed temporary files of an interrupted run")
    if recorded is None or recorded["fingerprint"] != fingerprint or slot.count == 1:
        manifest.write_run(fingerprint, recorded_config(config))  # once for N workers: they all check it
    todo = pending_shards(shards, manifest)
    if not todo:
        log.info(f"nothing to do: {len(shards)} of {len(shards)} shards done")
    elif len(todo) < len(shards):
        log.info(f"{len(shards) - len(todo)} of {len(shards)} shards already done, resuming")
    return todo


def output_fingerprint(config: RunConfig, choice: ModelChoice) -> dict:
    """Everything that changes the output values. Batch sizes, workers and memory settings
    are left out on purpose: they must not change results."""
    return {"job": config.job, "model": model_content_hash(choice.path), "max_length": choice.max_length,
            "dtype": dtype_name(choice.dtype), "attention": choice.attention, "prompt": choice.prompt,
            "id_column": config.id_column, "text_column": config.text_column, **choice.job_options,
            **({"keep_columns": list(config.keep_columns)} if config.keep_columns else {})}
