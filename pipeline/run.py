"""The executor: one job run, wired stage by stage. Read top to bottom to see the whole flow:

    shards ─read─▶ row blocks ─window─▶ windows ─tokenize pool─▶ encoded windows
      ─plan (buckets)─▶ batches ─collate, prefetch thread─▶ device forward
      ─scatter by row position─▶ window outputs ─write, in input order─▶ output shards

`run_job` claims the output and loads the model once; a `ShardRunner` then turns a list of
input shards into committed output shards and a summary. Every engine (this process, one
indexed worker of N, a Ray actor) calls a ShardRunner; only the hand-out of shards differs.
Reading, tokenizing, planning and collating run on a background thread (tokenizing on worker
processes) while `run_on_device`, the one device loop that `run` and `sweep` share, keeps
the device busy.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from tqdm import tqdm

from pipeline.buckets import bucket_bounds, padding_efficiency, plan_batches
from pipeline.config import RunConfig, usable_cores
from pipeline.device import (DTYPES, DeviceFeeder, HostCopy, SplitForward, collate, dtype_name,
                             forward_splitting_on_oom, padding_multiple, prefetch)
from pipeline.errors import UsageError
from pipeline.memory import MemoryPlan, describe_plan, memory_plan_for
from pipeline.model import LoadedModel, ModelChoice, choose_model, load_model, model_content_hash
from pipeline.sink import (BackgroundWriter, RunManifest, ShardSink, WindowWriter, fingerprint_differences, pending,
                           recorded_config)
from pipeline.source import Shard, WorkerSlot, list_shards, read_blocks, resolve_worker_slot
from pipeline.summary import RunSummary, StageTimes, timed
from pipeline.sweep import resolve_batch_setting, saved_recommendations, sweep_reference
from pipeline.tokenize import EncodedRows, TokenizerPool
from pipeline.windows import Window, group_into_windows, tokenize_windows

log = logging.getLogger(__name__)

# Runs a list of shards into the sink: (todo, sink, manifest, summary, started) → None
ShardsRunner = Callable[[list[Shard], ShardSink, RunManifest, RunSummary, float], None]
# An engine: loads and checks what it runs for (config, model choice), before the output is touched
PrepareEngine = Callable[[RunConfig, ModelChoice], ShardsRunner]


def run_job(config: RunConfig, environ: Mapping[str, str] = os.environ) -> RunSummary:
    """Run `config` over every shard not yet done, in this process, and return the summary.
    With --num-shards N this process is one worker of N and takes its share of the shards
    (index from --shard-index or the scheduler's variable in `environ`).

    Raises UsageError on bad settings (nothing written). A shard that fails is recorded in
    the summary and the manifest and the others go on; the caller decides the exit code.
    """
    refuse_while_a_worker_starts()
    slot = resolve_worker_slot(config.num_shards, config.shard_index, environ)
    return run_claimed(config, slot, prepare_here)


def refuse_while_a_worker_starts() -> None:
    """A spawned tokenizer worker re-runs the main script while it starts; if that script
    calls lengthwise without a main guard, stop here (before any lock, model or output is
    touched) with what to do, instead of starting a run inside the worker."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError("lengthwise was called while a tokenizer worker process was starting: the script that "
                           "calls it has no `if __name__ == \"__main__\":` guard, so each worker runs it again. "
                           "Put the call under that guard, or set tokenize_workers=0")


def prepare_here(config: RunConfig, choice: ModelChoice) -> ShardsRunner:
    """The local engine: the model loaded once in this process, one shard runner for all shards."""
    return ShardRunner(config, load_model(config, choice)).run


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
    choice = choose_model(config)
    fingerprint = output_fingerprint(config, choice)
    refuse_other_settings(config, manifest.read_run(), fingerprint)
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


# ── the shard runner: shards in, committed outputs and a summary out ───────────────────


class ShardRunner:
    """One loaded model on one device, with its batch setting and memory plan settled once;
    `run` may be called for several lists of shards (a Ray actor gets them one by one)."""

    def __init__(self, config: RunConfig, loaded: LoadedModel):
        self.loaded = loaded
        config = dataclasses.replace(config, max_length=loaded.choice.max_length)
        saved_for = saved_recommendations(config, loaded.choice.path, loaded.choice.device, loaded.model)
        self.config, self.batch_setting = resolve_batch_setting(config, loaded.choice.device.type, saved_for)
        log.info(f"batch setting: {self.batch_setting}")
        self.sweep_reference = sweep_reference(saved_for)
        self.plan = memory_plan_for(self.config, loaded.job, loaded.model, loaded.choice.path,
                                    loaded.choice.device) if self.config.probe else None
        self.limits = BatchLimits(self.plan)
        check_kept_columns(self.config.keep_columns, loaded.job.output_schema(loaded.model).names)

    def run(self, shards: list[Shard], sink: ShardSink, manifest: RunManifest, summary: RunSummary,
            started: float) -> None:
        """Read, tokenize, batch, forward and write `shards`, adding to `summary`. Time before
        this call (since `started`) counts as setup."""
        config, loaded = self.config, self.loaded
        job, model, device = loaded.job, loaded.model, loaded.choice.device
        times = StageTimes(setup=time.perf_counter() - started)
        summary.device, summary.dtype, summary.model = str(device), dtype_name(loaded.choice.dtype), loaded.choice.path
        summary.dtype_reason = loaded.choice.dtype_reason
        summary.batch_setting, summary.batch_plan = self.batch_setting, describe_plan(self.plan)
        summary.settings, summary.sweep_reference = diagnosis_settings(config, model), self.sweep_reference
        count_flagged = functools.partial(job.count_flagged, model) if hasattr(job, "count_flagged") else None
        writer = WindowWriter(sink, manifest, shards, self._columns_of, times, count_flagged)
        background = BackgroundWriter(writer)
        progress = tqdm(total=sum(shard.num_rows for shard in shards), unit="rows", file=sys.stderr,
                        disable=not config.progress, dynamic_ncols=True, smoothing=0.1)
        try:
            with TokenizerPool(loaded.tokenizer, config.tokenize_workers) as pool:
                blocks = timed(read_blocks(shards, config.id_column, config.text_column, config.window_rows,
                                           config.storage_options, config.keep_columns), times, "read")
                windows = tokenize_windows(pool, group_into_windows(blocks, config.window_rows), times)
                feeder = DeviceFeeder(device)
                work = batches_of(windows, config, self.limits, loaded.tokenizer.pad_token_id, feeder, times)
                for item, result in run_on_device(work, job, model, device, feeder, self.limits,
                                                  config.prefetch_batches, times):
                    if isinstance(item, WindowDone):
                        background.write(item.window)
                        progress.update(item.window.tokenize_errors)
                        # a shard that failed to read is seen here; one whose commit failed, up to two windows later
                        if config.fail_fast and (background.failures or any(b.failure for b in item.window.blocks)):
                            break
                        continue
                    if result.outputs:
                        item.window.store(item.rows, result.outputs)
                        broken = ~finite_rows(result.outputs) & ~result.failed
                        if broken.any():
                            item.window.fail(item.rows[broken], f"the model gave a non-finite output (nan or inf) "
                                             f"in {summary.dtype}; rerun with --dtype float32")
                    if result.failed.any():
                        item.window.fail(item.rows[result.failed], f"out of memory even alone at padded length "
                                         f"{item.padded_length}; lower --max-length or use a larger device")
                    summary.batches += 1
                    summary.oom_splits += result.splits
                    summary.real_tokens += item.real_tokens
                    summary.padded_tokens += item.padded_tokens
                    progress.update(len(item.rows))
                    elapsed = progress.format_dict["elapsed"]
                    if elapsed:
                        progress.set_postfix(tokens_per_s=f"{summary.real_tokens / elapsed:,.0f}", refresh=False)
            background.close()
        finally:
            background.close(raise_error=False)  # on an error: the windows already handed on are still written
            progress.close()
            writer.finish(summary)  # on an error too: nothing partial stays, failed shards are marked
        wall_s = time.perf_counter() - started
        summary.padding_efficiency = padding_efficiency(summary.real_tokens, summary.padded_tokens)
        summary.rows_per_s = summary.rows / wall_s
        summary.tokens_per_s = summary.real_tokens / wall_s
        summary.stage_s = {name: round(seconds, 3) for name, seconds in dataclasses.asdict(times).items()}
        summary.device_busy_fraction = times.forward / max(wall_s - times.setup, 1e-9)
        summary.lowered_batch_rows = dict(sorted(self.limits.lowered.items()))

    def _columns_of(self, outputs: dict, valid: np.ndarray, rows: int) -> dict:
        job, model = self.loaded.job, self.loaded.model
        if outputs:
            return job.to_columns(model, outputs, valid)
        # no row of this window could run
        return {f.name: pa.nulls(rows, f.type) for f in job.output_schema(model)}


def diagnosis_settings(config: RunConfig, model: torch.nn.Module) -> dict:
    """The settings the diagnosis reads and names in its actions."""
    return {"max_length": config.max_length, "max_positions": getattr(model.config, "max_position_embeddings", None),
            "window_rows": config.window_rows, "tokenize_workers": config.tokenize_workers, "cores": usable_cores(),
            "safety": config.safety, "max_batch_tokens": config.max_batch_tokens,
            "max_batch_rows": config.max_batch_rows}


def check_kept_columns(keep_columns, job_columns: list[str]) -> None:
    """Kept input columns must not take a name the output already has."""
    taken = [name for name in keep_columns if name in ("id", *job_columns, "truncated", "error")]
    if taken:
        raise UsageError(f"--keep-columns {', '.join(taken)}: the output already has a column of that name "
                         f"(id, {', '.join(job_columns)}, truncated, error); rename it in the input")


def finite_rows(outputs: dict[str, np.ndarray]) -> np.ndarray:
    """Rows whose every output value is finite: a nan or inf (overflow in half precision, a
    broken model) becomes the row's error instead of a valid-looking result."""
    finite = None
    for values in outputs.values():
        row_finite = np.isfinite(values.reshape(len(values), -1)).all(axis=1)
        finite = row_finite if finite is None else finite & row_finite
    return finite


# ── batches: planned per window, collated ahead of the device ──────────────────────────


@dataclass
class ReadyBatch:
    """A collated batch on its way to the device, with the rows it answers for."""

    rows: np.ndarray  # positions in the encoded rows (of `window`, if any)
    padded_length: int
    tensors: list[torch.Tensor]  # input ids and attention mask, on their way to the device
    copied: object  # the CUDA event of their copy, or None
    real_tokens: int
    padded_tokens: int
    window: Window | None = None
    entered: float = 0.0  # when the packer handed these rows on (the sweep's row latency starts here)


@dataclass
class WindowDone:
    window: Window


class BatchLimits:
    """Rows per padded length from the memory plan, lowered for the rest of the run whenever a
    batch runs out of memory. Read by the planner thread, lowered by the device loop."""

    def __init__(self, plan: MemoryPlan | None):
        self.plan = plan
        self.lowered: dict[int, int] = {}  # padded length → rows that ran after a split

    def rows_for(self, padded_length: int) -> int:
        rows = self.plan.rows_for(padded_length) if self.plan else np.iinfo(np.int64).max
        for length, lowered_rows in list(self.lowered.items()):
            if length <= padded_length:  # a longer batch needs at least as much memory
                rows = min(rows, lowered_rows)
        return rows

    def lower(self, padded_length: int, rows: int) -> None:
        self.lowered[padded_length] = min(rows, self.lowered.get(padded_length, rows))


def collate_batches(encoded: EncodedRows, rows: np.ndarray, max_batch_tokens: int | None, max_batch_rows: int,
                    max_length: int, limits: BatchLimits, pad_token_id: int, feeder: DeviceFeeder,
                    times: StageTimes | None = None, window: Window | None = None) -> Iterator[ReadyBatch]:
    """Plan `rows` of `encoded` into batches (longest first, padded to the device's multiple)
    and collate each for the device."""
    lengths = encoded.lengths[rows]
    bounds = bucket_bounds(max_length, padding_multiple(feeder.device))
    for batch in plan_batches(lengths, max_batch_tokens, max_batch_rows, bounds, limits.rows_for):
        entered = time.perf_counter()
        picked = rows[batch.rows]
        input_ids, attention_mask = collate(encoded.token_ids, encoded.offsets, picked, batch.padded_length,
                                            pad_token_id)
        tensors, copied = feeder.send(input_ids, attention_mask)
        ready = ReadyBatch(picked, batch.padded_length, tensors, copied, int(lengths[batch.rows].sum()),
                           batch.padded_tokens, window, entered)
        if times is not None:
            times.collate += time.perf_counter() - entered
        yield ready


def batches_of(windows: Iterable[Window], config: RunConfig, limits: BatchLimits, pad_token_id: int,
               feeder: DeviceFeeder, times: StageTimes) -> Iterator[ReadyBatch | WindowDone]:
    """Each window's valid rows as collated batches, then a marker that the window is complete."""
    for window in windows:
        yield from collate_batches(window.encoded, np.flatnonzero(window.valid), config.max_batch_tokens,
                                   config.max_batch_rows, config.max_length, limits, pad_token_id, feeder, times,
                                   window)
        yield WindowDone(window)


# ── the device loop ──────────────────────────────────────────────────────────────────────


def run_on_device(items: Iterable, job, model: torch.nn.Module, device: torch.device, feeder: DeviceFeeder,
                  limits: BatchLimits, prefetch_batches: int,
                  times: StageTimes) -> Iterator[tuple[object, SplitForward | None]]:
    """The one device loop: take each collated batch from the prefetch thread, receive it on
    the device, run the job's forward (halving on out-of-memory, lowering `limits` for the
    rest of the run) and yield it with its outputs on the host. Other items pass through with
    None, in order, after every batch before them.

    On CUDA one batch stays in flight: batch N+1 is launched before batch N's outputs are read
    back, so the device never idles while the host stores results, and `times.forward` is
    device time from CUDA events. On the CPU the forward is synchronous and each batch is
    yielded at once."""
    keep_in_flight = device.type == "cuda"

    def forward(input_ids, attention_mask):
        # inputs still on the host (their copy ran out of memory) move here, under the back-off
        return job.forward(model, input_ids.to(device, non_blocking=True),
                           attention_mask.to(device, non_blocking=True))

    def read_back(item: ReadyBatch, copy: HostCopy) -> tuple[ReadyBatch, SplitForward]:
        result = copy.read()
        device_seconds = copy.device_seconds()
        if device_seconds is not None:
            times.forward += device_seconds
        return item, result

    in_flight = None
    with torch.inference_mode():
        for item in timed(prefetch(items, prefetch_batches), times, "wait_for_batch"):
            if not isinstance(item, ReadyBatch):
                if in_flight:
                    yield read_back(*in_flight)
                    in_flight = None
                yield item, None
                continue
            started = time.perf_counter()
            started_event = device_timer_start(device)
            input_ids, attention_mask = feeder.receive(item.tensors, item.copied)
            result = forward_splitting_on_oom(forward, input_ids, attention_mask, device)
            if result.splits:
                limits.lower(item.padded_length, max(1, result.largest_ok_rows))
            launched = (item, HostCopy(result, device, started_event))
            if started_event is None:
                times.forward += time.perf_counter() - started
            if in_flight:  # the batch before this one, now that this one is launched
                yield read_back(*in_flight)
                in_flight = None
            if keep_in_flight:
                in_flight = launched
            else:
                yield read_back(*launched)
        if in_flight:
            yield read_back(*in_flight)


def device_timer_start(device: torch.device):
    """A recorded CUDA event to time the device's work from (None on the CPU, timed on the host)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
