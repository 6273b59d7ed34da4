"""The output's side of a run, for every engine: its fingerprint, what it was made with, which shards are
pending (a done marker its output does not back is not done) and the claim under the lock."""

from __future__ import annotations

import logging
import time

from pipeline.core.device import DTYPES, dtype_name
from pipeline.core.errors import UsageError
from pipeline.offline.config import RunConfig
from pipeline.offline.done_markers import listed_outputs, untrusted_done_markers
from pipeline.offline.manifest import (
    RunManifest,
    fingerprint_differences,
    fingerprint_digest,
    pending,
    recorded_config,
)
from pipeline.offline.reuse import recorded_dtype, recorded_long_text, remove_stale_hash_temporaries
from pipeline.offline.sink import ShardSink
from pipeline.offline.source import Shard, WorkerSlot
from pipeline.offline.summary import RunSummary, output_totals
from pipeline.offline.model_set import keep_recorded_model_choices, model_change, model_configs
from pipeline.runtime.choice import ModelChoice
from pipeline.runtime.model_set import ModelSetChoice

log = logging.getLogger(__name__)


def nothing_to_clean_or_wait_for(shards: list[Shard], sink: ShardSink, manifest: RunManifest) -> bool:
    """With every shard done, whether the run may end without the lock: run.json records the run
    (a deleted one is written anew on the locked path), no attempt left a temporary file of these
    shards (the locked path removes it), and no live process holds a lock on the output (the
    locked path refuses beside it, as ever: it may be an --overwrite)."""
    return manifest.read_run() is not None and not sink.stale_temporaries([shard.stem for shard in shards]) and \
        not any(holder.get("alive", True) for holder in manifest.read_locks())


def nothing_to_do(shards: list[Shard], config: RunConfig, manifest: RunManifest, started: float) -> RunSummary:
    """Every shard of this worker is done: the summary of a run that writes nothing, so no lock
    is taken and a complete output answers 0 even on read-only storage. Only a lock left by a
    process dead on this host goes, where the storage allows (a run killed after its last commit).
    (Done shards become pending again only under --overwrite, which never comes here.)"""
    log.info(f"nothing to do: {len(shards)} of {len(shards)} shards done")
    if manifest.remove_dead_locks():
        log.info("removed the lock of a run that is no longer running")
    summary = RunSummary(shards=len(shards), shards_done_before=len(shards), output=config.output,
                         nothing_to_do=True)
    summary.output_totals = output_totals(manifest.shard_markers().values())
    summary.wall_s = time.perf_counter() - started
    return summary


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
    if config.models:  # several models: each keeps its own (offline/model_set.py)
        if recorded is None and config.reuse:
            previous = ShardSink(config.reuse, config.source.storage_options)
            recorded = RunManifest(previous.fs, previous.output_dir).read_run()
        return keep_recorded_model_choices(config, recorded and recorded["fingerprint"],
                                           recorded and recorded.get("config")), None
    if recorded:
        dtype = recorded["fingerprint"].get("dtype")
        if config.model.dtype == "auto" and dtype in DTYPES:
            changes["dtype"], dtype_source = dtype, f"what {config.output} was made with (--dtype auto)"
        if config.long_rows.long_text == "auto":  # an output made before --long-text existed was truncated
            changes["long_text"] = recorded["fingerprint"].get("long_text", "truncate")
        compiled = recorded.get("config", {}).get("compile")
        if config.model.compile == "auto" and compiled in ("on", "off"):
            log.info(f"compile {compiled}: what {config.output} was made with (--compile auto)")
            changes["compile"] = compiled
    if config.reuse and changes.get("dtype", config.model.dtype) == "auto":
        dtype = recorded_dtype(config.reuse, config.source.storage_options)
        if dtype in DTYPES:
            changes["dtype"], dtype_source = dtype, f"what {config.reuse} was made with (--dtype auto, --reuse)"
    if config.reuse and changes.get("long_text", config.long_rows.long_text) == "auto":
        changes["long_text"] = recorded_long_text(config.reuse, config.source.storage_options) or "auto"
    return config.with_settings(**changes), dtype_source


def refuse_other_settings(config: RunConfig, recorded: dict | None, fingerprint: dict) -> None:
    """An output holding results of other settings is resumed only with --overwrite; but for a change of
    models (`model_change`: the run-wide settings as recorded, a model kept), which computes only the added
    and changed models' columns."""
    if not recorded or recorded["fingerprint"] == fingerprint or config.overwrite:
        return
    change = model_change(recorded, fingerprint)
    if change is not None and config.reuse:
        raise UsageError(f"--reuse with a change of models ({change.describe()}): make the change without --reuse "
                         "first, or drop --reuse")
    if change is None:
        raise UsageError(f"{config.output} holds results made with other settings "
                         f"({'; '.join(fingerprint_differences(recorded['fingerprint'], fingerprint))}); "
                         "rerun with the same settings, choose another --output, or add --overwrite to redo it")


def pending_shards(shards: list[Shard], manifest: RunManifest, sink: ShardSink,
                   made_with: str | None = None) -> list[Shard]:
    """The shards not yet done, in input order: failed ones are retried, and so is a shard whose
    done marker its output does not back (untrusted_done_markers); `made_with`: see pending_of."""
    markers = manifest.shard_markers()
    return pending_of(shards, markers, untrusted_done_markers(sink.fs, shards, markers,
                                                              listed_outputs(sink.fs, sink.output_dir)), made_with)


def done_with(config: RunConfig, fingerprint: dict) -> str | None:
    """Several models: the digest a done marker must hold for its shard to be done (one committed before a
    change of models is still to do); None for one model, whose done markers are done whatever they hold."""
    return fingerprint_digest(fingerprint) if config.models else None


def pending_of(shards: list[Shard], markers: dict[str, dict], untrusted: dict[str, str],
               made_with: str | None = None) -> list[Shard]:
    """`shards` less those whose done marker is trusted (and, given `made_with`, holds that fingerprint digest
    or none), in input order."""
    done = {stem for stem, marker in markers.items() if marker["status"] == "done" and stem not in untrusted
            and (made_with is None or marker.get("fingerprint") in (None, made_with))}
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
    if (sink.remove_stale_temporaries(stems) + remove_stale_hash_temporaries(manifest, stems)
            + manifest.remove_stale_temporaries(stems)):
        log.info("removed temporary files of an interrupted run")
    markers = manifest.shard_markers()
    listed = listed_outputs(sink.fs, sink.output_dir)
    untrusted = untrusted_done_markers(sink.fs, shards, markers, listed)
    for shard in shards:
        if shard.stem in untrusted:
            log.warning(f"{shard.url} is marked done but {untrusted[shard.stem]}; redoing it")
    manifest.clear_markers(list(untrusted))
    sink.remove_outputs([stem for stem in untrusted if stem in listed])  # a folder in its place would take the commit
    change = None if config.overwrite else model_change(recorded, fingerprint)
    if change is not None and recorded["fingerprint"] != fingerprint:
        log.info(f"models changed since {config.output} was made: {change.describe()}")
    if recorded is None or recorded["fingerprint"] != fingerprint or slot.count == 1:
        manifest.write_run(fingerprint, recorded_config(config),  # once for N workers: they all check it
                           change and change.source)
    todo = pending_of(shards, markers, untrusted, done_with(config, fingerprint))  # one listing, not two
    if not todo:
        log.info(f"nothing to do: {len(shards)} of {len(shards)} shards done")
    elif len(todo) < len(shards):
        log.info(f"{len(shards) - len(todo)} of {len(shards)} shards already done, resuming")
    return todo


def output_fingerprint(config: RunConfig, choice: ModelChoice | ModelSetChoice) -> dict:
    """Everything that changes the output values. Batch sizes, workers and memory settings
    are left out on purpose: they must not change results. Several models: each one's, by name in
    the run's order (which orders the output's columns)."""
    if config.models:
        configs = model_configs(config)
        return {"models": {name: output_fingerprint(configs[name], each) for name, each in choice.choices.items()},
                "model_order": list(choice.choices)}
    return {"job": config.model.job, "model": choice.content_hash,
            "max_length": choice.max_length,
            "dtype": dtype_name(choice.dtype), "attention": choice.attention, "prompt": choice.prompt,
            "id_column": config.source.id_column, "text_column": config.source.text_column,
            **({"pair_column": config.source.pair_column} if config.source.pair_column else {}), **choice.job_options,
            **({"keep_columns": list(config.keep_columns)} if config.keep_columns else {}),
            **long_text_fingerprint(config, choice.max_length)}


def long_text_fingerprint(config: RunConfig, max_length: int) -> dict:
    """Nothing for truncate (so outputs made before --long-text existed still match); split and
    its segment length for split."""
    segment_length = config.long_rows.split_length(config.model.job, max_length)
    return {} if segment_length is None else {"long_text": "split", "segment_length": segment_length}


