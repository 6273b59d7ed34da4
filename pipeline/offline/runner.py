"""The shard runner: one job run over a list of shards, wired stage by stage. Read top to
bottom to see the whole flow:

    shards ─read─▶ row blocks ─window─▶ windows ─tokenize pool─▶ encoded windows
      ─plan (buckets)─▶ batches ─collate, prefetch thread─▶ device forward
      ─scatter by row position (the encoder process's)─▶ window outputs ─write, in input order─▶
      output shards

An engine (`pipeline/engines/`) claims the output and loads the model once; a `ShardRunner`
then turns a list of input shards into committed output shards and a summary. Every engine
(this process, one indexed worker of N, a Ray actor) calls a ShardRunner; only the hand-out
of shards differs. Reading, tokenizing, planning and collating are the producer's (offline/producer.py:
on a background thread of this process, tokenizing on worker processes; on CUDA all of it in a feeder
process, offline/feeder.py) while `run_on_device` (`core/forward.py`), the one device loop that `run`
and `sweep` share, keeps the device busy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sys
import time
from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa
import torch
from tqdm import tqdm

from pipeline.core.buckets import padding_efficiency
from pipeline.core.clock import SetupClock, StageTimes
from pipeline.core.device import dtype_name, padding_multiple, peak_rss_bytes
from pipeline.core.errors import UsageError
from pipeline.core.forward import DeviceFeeder, ReadyBatch, finite_rows, run_on_device, sent
from pipeline.core.probe import describe_plan
from pipeline.core.process_memory import STREAMING_MEMORY
from pipeline.core.settings import auto_window_rows, usable_cores
from pipeline.core.unpadded import runs_unpadded
from pipeline.runtime import Runtime
from pipeline.runtime.model_set import settled_models
from pipeline.offline.config import RunConfig
from pipeline.offline.encoder import OutputEncoder
from pipeline.offline.manifest import RunManifest
from pipeline.offline.carry import Carry, kept_columns
from pipeline.offline.sink import BackgroundWriter, ShardSink, WindowWriter
from pipeline.offline.source import Shard
from pipeline.offline.summary import IdTracker, RunSummary, low_reuse_warning
from pipeline.offline.feeder import FeederProcess
from pipeline.offline.producer import BatchProducer, ProducerSpec, StartedShards
from pipeline.offline.windows import OUTPUT_ARRAYS, BatchPacking, ProcessMemory, WindowBatch, WindowPart

log = logging.getLogger(__name__)


class ShardRunner:
    """One loaded model on one device, with its batch setting and memory plan settled once;
    `run` may be called for several lists of shards (a Ray actor gets them one by one)."""

    def __init__(self, config: RunConfig, runtime: Runtime, producer: BatchProducer | FeederProcess,
                 clock: SetupClock | None = None, carry: Carry | None = None):
        """`runtime`: the model and batch limits (`open_runtime`); `producer`: what builds the batches, its
        tokenizer pool started already (offline/producer.py: here, or in a feeder process on CUDA; it closes with
        this runner); `clock`: the setup steps so far, for the first run's summary. `carry`: a change of models
        (offline/carry.py): the kept models' columns carried from the output's earlier shards, the carried rows
        run by the others only."""
        self.config, self.runtime, self.loaded, self.carry = config, runtime, runtime.loaded, carry
        self.producer, self.clock = producer, clock or SetupClock()
        self.window_rows = config.window_rows or auto_window_rows(runtime.batch.max_batch_rows)
        self.tokenize_workers = producer.workers
        self._encoder: OutputEncoder | None = None  # the process that encodes local outputs (kept like the pool)
        output_names = self.loaded.job.output_schema(self.loaded.model).names
        split_names = [f.name for f in self._split_fields()]
        check_kept_columns(config.keep_columns, output_names, split_names)
        carried = kept_columns([*output_names, *split_names], carry.kept) if carry else ()
        producer.configure(ProducerSpec(config, self._batch_packing(), runtime.limits, carry, tuple(carried)))

    def start(self, shards: list[Shard]) -> StartedShards:
        """Read the first window of `shards` and hand it to the kept tokenizer pool now, for a later
        `run(shards, …, begun=…)`; safe while another `run` of this runner goes on."""
        return self.producer.start(shards)

    def run(self, shards: list[Shard], sink: ShardSink, manifest: RunManifest, summary: RunSummary,
            started: float, ids: IdTracker | None = None, begun: StartedShards | None = None) -> None:
        """Read, tokenize, batch, forward and write `shards`, adding to `summary`. Time before
        this call (since `started`) counts as setup; `ids` collects the written rows' id hashes;
        `begun`: the shards' first window, started already (`start`). This process streams the
        shards' rows meanwhile (pipeline/core/process_memory.py), and is left as it was after."""
        STREAMING_MEMORY.hold()
        try:
            self._run(shards, sink, manifest, summary, started, ids, begun)
        finally:
            STREAMING_MEMORY.release()

    def _run(self, shards: list[Shard], sink: ShardSink, manifest: RunManifest, summary: RunSummary,
             started: float, ids: IdTracker | None, begun: StartedShards | None) -> None:
        times = begun.times if begun else StageTimes()
        self._describe(summary)
        writer = self._window_writer(sink, manifest, shards, times, ids)
        background = BackgroundWriter(writer)
        progress = self._progress_bar(shards)
        failed = True
        try:
            sink.encoder = self._encoder_for(sink)
            self._end_setup(times, started, summary)
            feeder = DeviceFeeder(self.loaded.choice.device)
            work = sent_to_device(self.producer.items(shards, times, begun), feeder, times)
            try:
                self._compute(work, feeder, background, progress, summary, times)
            finally:  # a run left early (--fail-fast, an error) ends its producer's batches now, their times counted
                with contextlib.suppress(ValueError):  # unless a producer stuck past the prefetch's join still runs it
                    work.close()
            background.close()
            failed = False
        finally:
            self._end_run(background, progress, writer, summary, failed)
        self._add_rates(summary, times, time.perf_counter() - started)

    def _batch_packing(self) -> BatchPacking:
        """What packing this run's batches takes of its runtime, model and device (`collated_parts`)."""
        runtime = self.runtime
        return BatchPacking(self.window_rows, runtime.batch.max_batch_tokens, runtime.batch.max_batch_rows,
                            runtime.max_length, self.loaded.tokenizer.pad_token_id,
                            padding_multiple(self.loaded.choice.device), runs_unpadded(self.loaded.model))

    def _window_writer(self, sink: ShardSink, manifest: RunManifest, shards: list[Shard], times: StageTimes,
                       ids: IdTracker | None) -> WindowWriter:
        """The writer of this run's windows, with the job's flag count (where it has one) and its fold of
        a row's segments."""
        loaded = self.loaded
        count_flagged = functools.partial(loaded.job.count_flagged, loaded.model) \
            if hasattr(loaded.job, "count_flagged") else None
        return WindowWriter(sink, manifest, shards, self._columns_of, times, count_flagged, ids,
                            functools.partial(loaded.job.fold_segments, loaded.model))

    def _progress_bar(self, shards: list[Shard]) -> tqdm:
        return tqdm(total=sum(shard.num_rows for shard in shards), unit="rows", file=sys.stderr,
                    disable=not self.config.progress, dynamic_ncols=True, smoothing=0.1)

    def _end_setup(self, times: StageTimes, started: float, summary: RunSummary) -> None:
        """The setup ends once the tokenizer pool is up: its time and steps go to the summary."""
        import_arrow_conversions()
        with self.clock.step("tokenizer pool"):  # only the wait for processes not yet up
            self.producer.ready()
        times.setup = time.perf_counter() - started
        summary.setup_steps = self.clock.breakdown(times.setup)
        self.clock = SetupClock()  # a later run (a Ray actor's next shard) starts its own

    def _compute(self, work: Iterator, feeder: DeviceFeeder, background: BackgroundWriter, progress: tqdm,
                 summary: RunSummary, times: StageTimes) -> None:
        """The device loop over `work`'s batches: a batch's result counts in the summary and the bar; a
        window's part, its batches done, goes to the writer. --fail-fast stops at the first failed shard."""
        loaded = self.loaded
        for item, result in run_on_device(work, loaded.job, loaded.model, loaded.choice.device, feeder,
                                          self.runtime.limits, self.config.prefetch_batches, times):
            if isinstance(item, WindowPart):
                if self._hand_on(item, background, progress, summary):
                    return
                continue
            progress.update(record_batch(item, result, summary))
            elapsed = progress.format_dict["elapsed"]
            if elapsed:
                progress.set_postfix(tokens_per_s=f"{summary.real_tokens / elapsed:,.0f}", refresh=False)

    def _hand_on(self, part: WindowPart, background: BackgroundWriter, progress: tqdm, summary: RunSummary) -> bool:
        """A window's part to the writer, its rows' duplicates copied first; whether --fail-fast stops here."""
        copied = part.window.copy_duplicates(part.start_row, part.end_row)
        summary.deduplicated_rows += copied
        background.write(part)
        progress.update(part.tokenize_errors + copied)
        # a shard that failed to read is seen here; one whose commit failed, up to two parts later
        return bool(self.config.fail_fast and (background.failures or any(b.failure for b in part.blocks)))

    def _end_run(self, background: BackgroundWriter, progress: tqdm, writer: WindowWriter, summary: RunSummary,
                 failed: bool) -> None:
        """After the run, ended or failed: every window handed on written, the shards finished; the producer's
        processes, and the encoder's, kept for the next run only if the producer keeps its pool."""
        background.close(raise_error=False)  # on an error: the windows already handed on are still written
        progress.close()
        try:
            writer.finish(summary)  # on an error too: nothing partial stays, failed shards are marked
        finally:
            if not self.producer.end_run(failed):
                self._close_encoder()
        self._warn_of_low_reuse(summary)

    def _describe(self, summary: RunSummary) -> None:
        """What the summary says of the runtime: device, dtype, model, long text, compile, batch plan."""
        loaded = self.loaded
        summary.device, summary.dtype = str(loaded.choice.device), dtype_name(loaded.choice.dtype)
        summary.model, summary.dtype_reason = loaded.choice.path, loaded.choice.dtype_reason
        summary.long_text = "split" if loaded.tokenizer.segment_length else "truncate"
        summary.compile, summary.compile_s = loaded.compile.reason, round(loaded.compile.compile_s, 2)
        summary.unpad = loaded.unpad
        summary.batch_setting, summary.batch_plan = self.runtime.batch_setting, describe_plan(self.runtime.plan)
        summary.models = settled_models(self.runtime.members)  # several models: what each settled
        summary.settings = diagnosis_settings(self.runtime, self.window_rows, self.tokenize_workers)
        summary.sweep_reference = self.runtime.sweep_reference

    def _warn_of_low_reuse(self, summary: RunSummary) -> None:
        if self.config.reuse and self.producer.previous_rows is not None:
            summary.reuse_warning = low_reuse_warning(summary.rows, summary.reused_rows, summary.reuse,
                                                      self.producer.previous_rows, self.config.reuse)
            if summary.reuse_warning:
                log.warning(summary.reuse_warning)

    def _add_rates(self, summary: RunSummary, times: StageTimes, wall_s: float) -> None:
        """The run's rates, stage times and peaks, once its shards are written."""
        summary.padding_efficiency = padding_efficiency(summary.real_tokens, summary.padded_tokens)
        summary.rows_per_s = summary.rows / wall_s
        summary.tokens_per_s = summary.real_tokens / wall_s
        summary.stage_s = {name: round(seconds, 3) for name, seconds in dataclasses.asdict(times).items()}
        summary.device_busy_fraction = times.forward / max(wall_s - times.setup, 1e-9)
        summary.lowered_batch_rows = dict(sorted(self.runtime.limits.lowered.items()))
        summary.compiled_graphs = self.loaded.compile.graphs()
        summary.peak_rss_bytes = max(summary.peak_rss_bytes, peak_rss_bytes())
        device = self.loaded.choice.device
        if device.type == "cuda":
            summary.peak_device_bytes = max(summary.peak_device_bytes, torch.cuda.max_memory_allocated(device))

    __call__ = run  # an engine's ShardsRunner (pipeline/engines/claim.py)

    def _encoder_for(self, sink: ShardSink) -> OutputEncoder | None:
        """The encoder process for a local output (started now, or the one kept from a run before);
        None for an object store or memory, encoded in this process."""
        if sink.uses_encoder and self._encoder is None:
            self._encoder = OutputEncoder()
            if OutputEncoder.shares_memory:  # its process holds the windows' outputs and puts rows in place
                OUTPUT_ARRAYS.memory = self._encoder
        return self._encoder if sink.uses_encoder else None

    def _close_encoder(self) -> None:
        if self._encoder is not None:
            if OUTPUT_ARRAYS.memory is self._encoder:
                OUTPUT_ARRAYS.memory = ProcessMemory()
            self._encoder.close()
            self._encoder = None

    def close(self) -> None:
        """Stop the producer (its tokenizer pool and reader processes, or its feeder process) and the encoder."""
        self.producer.close()
        self._close_encoder()

    def _columns_of(self, outputs: dict, valid: np.ndarray, rows: int) -> dict:
        job, model = self.loaded.job, self.loaded.model
        columns = job.to_columns(model, outputs, valid) if outputs else {}
        if outputs and self.carry is None:
            return columns
        # no row of this window could run, or (a change of models) a model ran none: its columns are carried
        expected = [f for f in [*job.output_schema(model), *self._split_fields()] if f.name != "segments"]
        return {f.name: columns[f.name] if f.name in columns else pa.nulls(rows, f.type)
                for f in expected}  # output_table adds `segments`

    def _split_fields(self) -> list[pa.Field]:
        """The columns --long-text split adds: segments, and the job's own (moderate's flag_spans)."""
        job, model = self.loaded.job, self.loaded.model
        if not self.loaded.tokenizer.segment_length:
            return []
        return [pa.field("segments", pa.int32()), *(job.split_schema(model) if hasattr(job, "split_schema") else [])]


def diagnosis_settings(runtime: Runtime, window_rows: int, tokenize_workers: int) -> dict:
    """The settings the diagnosis reads and names in its actions (max_positions: the tokens the
    model takes, fewer than its position table in the RoBERTa family)."""
    limit = runtime.loaded.position_limit
    return {"max_length": runtime.max_length, "max_positions": limit.tokens if limit else None,
            "window_rows": window_rows, "tokenize_workers": tokenize_workers, "cores": usable_cores(),
            "torch_threads": torch.get_num_threads(),
            "safety": runtime.batch.safety, "max_batch_tokens": runtime.batch.max_batch_tokens,
            "max_batch_rows": runtime.batch.max_batch_rows, **({"pair": True} if runtime.loaded.tokenizer.pair else {})}


def import_arrow_conversions() -> None:
    """pyarrow imports pandas at its first conversion of a numpy array (0.2-0.5 s of CPU): done in
    setup, while the tokenizer workers start, not under the first window's rows."""
    pa.array(np.zeros(1, np.int64), mask=np.zeros(1, bool))


def check_kept_columns(keep_columns, job_columns: list[str], split_columns: list[str] = ()) -> None:
    """Kept input columns must not take a name the output already has."""
    taken = [name for name in keep_columns if name in ("id", *job_columns, *split_columns, "truncated", "error")]
    if taken:
        raise UsageError(f"--keep-columns {', '.join(taken)}: the output already has a column of that name "
                         f"(id, {', '.join([*job_columns, *split_columns])}, truncated, error); rename it in the "
                         "input")


def sent_to_device(items: Iterable[WindowBatch | WindowPart], feeder: DeviceFeeder,
                   times: StageTimes) -> Iterator[ReadyBatch | WindowPart]:
    """The producer's batches on their way to the device (on the prefetch thread, so the copy overlaps the
    forward), its parts as they come."""
    for item in items:
        yield item if isinstance(item, WindowPart) else sent(item.batch, feeder, times, item.window, item.models)


def record_batch(item: ReadyBatch, result, summary: RunSummary) -> int:
    """A batch's outputs into its window (rows it could not run failed, with the reason), counted in the
    summary; the rows of the window this finished."""
    if result.outputs:
        item.window.store(item.rows, result.outputs)
        broken = ~finite_rows(result.outputs) & ~result.failed
        if broken.any():
            item.window.fail(item.rows[broken], f"the model gave a non-finite output (nan or inf) in {summary.dtype}; "
                             "rerun with --dtype float32")
    if result.failed.any():
        item.window.fail(item.rows[result.failed], f"out of memory even alone at padded length {item.padded_length}; "
                         "lower --max-length or use a larger device")
    summary.batches += 1
    summary.oom_splits += result.splits
    summary.real_tokens += item.real_tokens
    summary.padded_tokens += item.padded_tokens
    return item.window.rows_done(item.rows)
