"""One job run, wired stage by stage. Read this file top to bottom to see the whole flow:

    shards ─read─▶ row blocks ─window─▶ windows ─tokenize pool─▶ encoded windows
      ─plan (buckets)─▶ batches ─collate, prefetch thread─▶ device forward
      ─scatter by row position─▶ window outputs ─write, in input order─▶ output shards

Reading, tokenizing, planning and collating run on a background thread (tokenizing on
worker processes) while the main thread keeps the device busy with the current batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from jobs.registry import get_job
from pipeline.buckets import bucket_bounds, padding_efficiency, plan_batches
from pipeline.config import RunConfig
from pipeline.device import (DeviceFeeder, available_memory_bytes, collate, device_name, dtype_name,
                             forward_splitting_on_oom, prefetch)
from pipeline.errors import UsageError
from pipeline.memory import (MemoryPlan, default_plan_cache_dir, load_cached_plan, model_memory_fingerprint,
                             plan_cache_key, probe_memory_plan, save_plan)
from pipeline.sink import MANIFEST_DIR, RunManifest, ShardSink, fingerprint_differences, pending
from pipeline.source import RowBlock, Shard, list_shards, read_blocks
from pipeline.model import ModelChoice, choose_model, load_model, model_content_hash
from pipeline.tokenize import EncodedRows, TokenizerPool


# ── stage timing ───────────────────────────────────────────────────────────────────────


@dataclass
class StageTimes:
    """Seconds per stage. read/tokenize/collate overlap the device; wait is the device idle."""

    setup: float = 0.0  # listing shards, loading tokenizer and model
    read: float = 0.0
    tokenize: float = 0.0  # summed over worker processes
    collate: float = 0.0
    wait_for_batch: float = 0.0
    forward: float = 0.0
    write: float = 0.0


def timed(items: Iterable, times: StageTimes, stage: str) -> Iterator:
    """Yield from `items`, adding the time spent producing each item to `times.<stage>`."""
    iterator = iter(items)
    while True:
        started = time.perf_counter()
        try:
            item = next(iterator)
        except StopIteration:
            return
        finally:
            setattr(times, stage, getattr(times, stage) + time.perf_counter() - started)
        yield item


# ── windows: the rows sorted and packed together ───────────────────────────────────────


def group_into_windows(blocks: Iterable[RowBlock], window_rows: int) -> Iterator[list[RowBlock]]:
    """Consecutive row blocks, sliced so each window holds exactly `window_rows` rows
    (the last may hold fewer). A window may span shards; row-less blocks (an empty shard's,
    a shard failure) ride along in order."""
    window: list[RowBlock] = []
    filled = 0
    for block in blocks:
        start = 0
        while True:
            take = min(block.num_rows - start, window_rows - filled)
            end = start + take
            window.append(dataclasses.replace(block, first_row=block.first_row + start,
                                              ids=block.ids.slice(start, take), texts=block.texts.slice(start, take),
                                              is_last_of_shard=block.is_last_of_shard and end == block.num_rows))
            filled += take
            start = end
            if filled == window_rows:
                yield window
                window, filled = [], 0
            if start == block.num_rows:
                break
    if window:
        yield window


@dataclass
class Window:
    """One window in flight: its blocks, their tokens, and the outputs as they arrive."""

    blocks: list[RowBlock]
    encoded: EncodedRows
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    valid: np.ndarray = field(init=False)  # rows that tokenized and go to the model
    tokenize_errors: int = field(init=False)  # rows that never reach the model

    def __post_init__(self) -> None:
        self.valid = np.array([error is None for error in self.encoded.errors], dtype=bool)
        self.tokenize_errors = int((~self.valid).sum())

    def fail(self, rows: np.ndarray, error: str) -> None:
        """Rows that could not run after all (out of memory even alone) get an error."""
        for row in rows:
            self.encoded.errors[row] = error
        self.valid[rows] = False

    @property
    def num_rows(self) -> int:
        return len(self.encoded)

    def store(self, rows: np.ndarray, batch_outputs: dict[str, np.ndarray]) -> None:
        """Scatter one batch's outputs back to the window positions of its rows."""
        for name, values in batch_outputs.items():
            if name not in self.outputs:
                self.outputs[name] = np.zeros((self.num_rows, *values.shape[1:]), dtype=values.dtype)
            self.outputs[name][rows] = values


def tokenize_windows(pool: TokenizerPool, windows: Iterable[list[RowBlock]], times: StageTimes) -> Iterator[Window]:
    """Tokenized windows; the next window is submitted before the current one is handed on."""
    in_flight = None
    for blocks in windows:
        texts = [text for block in blocks for text in block.texts.to_pylist()]
        submitted = (blocks, pool.submit(texts))
        if in_flight is not None:
            yield _finish_tokenizing(pool, in_flight, times)
        in_flight = submitted
    if in_flight is not None:
        yield _finish_tokenizing(pool, in_flight, times)


def _finish_tokenizing(pool: TokenizerPool, in_flight, times: StageTimes) -> Window:
    """The window's encoded rows; a row with a null id is an error whatever its text."""
    blocks, handle = in_flight
    encoded = pool.result(handle)
    times.tokenize += encoded.encode_s
    null_ids = np.concatenate([b.ids.is_null().to_numpy(zero_copy_only=False) for b in blocks])
    for row in np.flatnonzero(null_ids):
        encoded.errors[row] = "id is null"
    return Window(blocks, encoded)


# ── batches ────────────────────────────────────────────────────────────────────────────


@dataclass
class ReadyBatch:
    """A collated batch on its way to the device, with the window rows it answers for."""

    window: Window
    rows: np.ndarray
    padded_length: int
    tensors: list[torch.Tensor]  # input ids and attention mask, on their way to the device
    copied: object  # the CUDA event of their copy, or None
    real_tokens: int
    padded_tokens: int


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


def batches_of(windows: Iterable[Window], config: RunConfig, limits: BatchLimits, pad_token_id: int,
               feeder: DeviceFeeder, times: StageTimes) -> Iterator[ReadyBatch | WindowDone]:
    """Plan each window's valid rows into batches (longest first) and collate them."""
    bounds = bucket_bounds(config.max_length)
    for window in windows:
        valid_rows = np.flatnonzero(window.valid)
        lengths = window.encoded.lengths[valid_rows]
        for batch in plan_batches(lengths, config.max_batch_tokens, config.max_batch_rows, bounds, limits.rows_for):
            started = time.perf_counter()
            rows = valid_rows[batch.rows]
            input_ids, attention_mask = collate(window.encoded.token_ids, window.encoded.offsets, rows,
                                                batch.padded_length, pad_token_id)
            tensors, copied = feeder.send(input_ids, attention_mask)
            ready = ReadyBatch(window, rows, batch.padded_length, tensors, copied,
                               int(lengths[batch.rows].sum()), batch.padded_tokens)
            times.collate += time.perf_counter() - started
            yield ready
        yield WindowDone(window)


# ── output ─────────────────────────────────────────────────────────────────────────────


def output_table(block: RowBlock, window: Window, start: int, job, model) -> pa.Table:
    """The output rows of one block: id, the job's columns, truncated, error — in input order."""
    positions = slice(start, start + block.num_rows)
    valid = window.valid[positions]
    if window.outputs:
        columns = job.to_columns(model, {k: v[positions] for k, v in window.outputs.items()}, valid)
    else:  # no row of this window could run
        columns = {f.name: pa.nulls(block.num_rows, f.type) for f in job.output_schema(model)}
    columns = {"id": block.ids, **columns,
               "truncated": pa.array(window.encoded.truncated[positions] & valid, pa.bool_()),
               "error": pa.array(window.encoded.errors[positions], pa.string())}
    return pa.table(columns)


# ── the run ────────────────────────────────────────────────────────────────────────────


@dataclass
class RunSummary:
    rows: int = 0  # rows written by this run
    error_rows: int = 0
    truncated_rows: int = 0
    shards: int = 0  # shards named by the input
    shards_done_before: int = 0  # skipped: committed by an earlier run
    failed_shards: list = field(default_factory=list)  # [{"shard", "error"}]: nothing of them committed
    duplicate_ids: int = 0  # rows whose id an earlier row of this run already had (both kept)
    duplicate_id_examples: list = field(default_factory=list)
    batches: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    padding_efficiency: float = 1.0
    rows_per_s: float = 0.0
    tokens_per_s: float = 0.0
    wall_s: float = 0.0
    stage_s: dict = field(default_factory=dict)
    device_busy_fraction: float = 0.0
    oom_splits: int = 0  # batches halved after running out of memory
    lowered_batch_rows: dict = field(default_factory=dict)  # padded length → rows after a split
    batch_setting: str = ""  # the token and row limits, and where they came from
    batch_plan: str = ""  # where the memory plan came from
    device: str = ""
    dtype: str = ""
    model: str = ""
    output: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def to_text(self) -> str:
        stages = "  ".join(f"{name} {seconds:.2f}s" for name, seconds in self.stage_s.items())
        lines = [
            f"rows            {self.rows:,} in {self.shards - self.shards_done_before - len(self.failed_shards)} "
            f"shard(s) ({self.error_rows:,} with errors, {self.truncated_rows:,} truncated, "
            f"{self.duplicate_ids:,} duplicate ids)",
            f"tokens          {self.real_tokens:,} real / {self.padded_tokens:,} padded in {self.batches:,} batches"
            f" = padding efficiency {self.padding_efficiency:.3f}",
            f"throughput      {self.rows_per_s:,.1f} rows/s, {self.tokens_per_s:,.0f} tokens/s "
            f"in {self.wall_s:.2f}s wall",
            f"stages          {stages}",
            f"device busy     {self.device_busy_fraction:.1%} of the time after setup ({self.device}, {self.dtype})",
            f"batch setting   {self.batch_setting}",
            f"batch plan      {self.batch_plan}" + (f"; {self.oom_splits} out-of-memory splits, rows lowered to "
                                                    f"{self.lowered_batch_rows}" if self.oom_splits else ""),
            f"output          {self.output}",
        ]
        if self.shards_done_before:
            lines.append(f"resumed         {self.shards_done_before} of {self.shards} shards were already done")
        if self.duplicate_ids:
            lines.append(f"duplicate ids   e.g. {', '.join(map(repr, self.duplicate_id_examples))}")
        for failed in self.failed_shards:
            lines.append(f"FAILED          {failed['shard']}: {failed['error']}")
        return "\n".join(lines)


def output_fingerprint(config: RunConfig, choice: ModelChoice) -> dict:
    """Everything that changes the output values. Batch sizes, workers and memory settings
    are left out on purpose: they must not change results."""
    return {"job": config.job, "model": model_content_hash(choice.path), "max_length": choice.max_length,
            "dtype": dtype_name(choice.dtype), "prompt": choice.prompt, "id_column": config.id_column,
            "text_column": config.text_column}


SECRET_WORDS = ("key", "secret", "token", "password", "credential", "session")


def recorded_config(config: RunConfig) -> dict:
    """The resolved config as saved beside the outputs, with secret storage options blanked."""
    data = config.to_dict()
    data["storage_options"] = {k: "<redacted>" if any(w in k.lower() for w in SECRET_WORDS) else v
                               for k, v in config.storage_options.items()}
    return data


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_job(config: RunConfig) -> RunSummary:
    """Run `config` over every shard not yet done and return the summary.

    Raises UsageError on bad settings (nothing written). A shard that fails is recorded in
    the summary and the manifest and the others go on; the caller decides the exit code.
    """
    started = time.perf_counter()
    job = get_job(config.job)
    shards = list_shards(config.input, config.id_column, config.text_column, config.storage_options)
    sink = ShardSink(config.output, config.storage_options)
    manifest = RunManifest(sink.fs, sink.output_dir)
    lock_note = manifest.acquire_lock()
    if lock_note:
        log(lock_note)
    try:
        return _run_locked(config, job, shards, sink, manifest, started)
    finally:
        manifest.release_lock()


def _run_locked(config: RunConfig, job, shards: list[Shard], sink: ShardSink, manifest: RunManifest,
                started: float) -> RunSummary:
    choice = choose_model(config)
    model_path, device = choice.path, choice.device
    fingerprint = output_fingerprint(config, choice)
    recorded = manifest.read_run()
    if recorded and recorded["fingerprint"] != fingerprint and not config.overwrite:
        raise UsageError(f"{config.output} holds results made with other settings "
                         f"({'; '.join(fingerprint_differences(recorded['fingerprint'], fingerprint))}); "
                         "rerun with the same settings, choose another --output, or add --overwrite to redo it")
    if config.overwrite:
        manifest.clear_markers()
        sink.remove_outputs([shard.stem for shard in shards])
    if sink.remove_stale_temporaries():
        log("removed temporary files of an interrupted run")
    manifest.write_run(fingerprint, recorded_config(config))
    done = {stem for stem, marker in manifest.shard_markers().items() if marker["status"] == "done"}
    todo_stems = set(pending([s.stem for s in shards], done))
    todo = [shard for shard in shards if shard.stem in todo_stems]
    summary = RunSummary(shards=len(shards), shards_done_before=len(shards) - len(todo), output=config.output)
    if summary.shards_done_before:
        log(f"{summary.shards_done_before} of {len(shards)} shards already done, resuming")
    if not todo:
        summary.wall_s = time.perf_counter() - started
        return summary

    loaded = load_model(config, choice)
    model, tokenizer_spec = loaded.model, loaded.tokenizer
    config = dataclasses.replace(config, max_length=choice.max_length)
    config, summary.batch_setting = resolve_batch_setting(config, model_path, device, model)
    log(f"batch setting: {summary.batch_setting}")
    if config.max_batch_tokens is None and not config.probe:
        raise UsageError("--max-batch-tokens auto has no sweep recommendation to use and --no-probe turns the "
                         "memory plan off; drop --no-probe, run `lengthwise sweep`, or give a number")
    plan = memory_plan_for(config, job, model, model_path, device) if config.probe else None
    limits = BatchLimits(plan)
    times = StageTimes(setup=time.perf_counter() - started)
    summary.device, summary.dtype, summary.model = str(device), fingerprint["dtype"], model_path
    summary.batch_plan = describe_plan(plan)
    failures: dict[int, str] = {}  # shard index in `todo` → why it failed
    id_hashes: list[np.ndarray] = []
    shard_counts: dict[int, np.ndarray] = {}  # shard index → rows, error rows, truncated rows written
    progress = tqdm(total=sum(shard.num_rows for shard in todo), unit="rows", file=sys.stderr,
                    disable=not config.progress, dynamic_ncols=True, smoothing=0.1)
    try:
        with TokenizerPool(tokenizer_spec, config.tokenize_workers) as pool, torch.inference_mode():
            blocks = timed(read_blocks(todo, config.id_column, config.text_column, config.window_rows,
                                       config.storage_options), times, "read")
            windows = tokenize_windows(pool, group_into_windows(blocks, config.window_rows), times)
            feeder = DeviceFeeder(device)
            work = batches_of(windows, config, limits, tokenizer_spec.pad_token_id, feeder, times)
            for item in timed(prefetch(work, config.prefetch_batches), times, "wait_for_batch"):
                if isinstance(item, ReadyBatch):
                    forward_started = time.perf_counter()
                    input_ids, attention_mask = feeder.receive(item.tensors, item.copied)
                    result = forward_splitting_on_oom(lambda ids, mask: job.forward(model, ids, mask),
                                                      input_ids, attention_mask, device)
                    if result.outputs:
                        item.window.store(item.rows, result.outputs)
                    if result.splits:
                        summary.oom_splits += result.splits
                        limits.lower(item.padded_length, max(1, result.largest_ok_rows))
                    if result.failed.any():
                        item.window.fail(item.rows[result.failed], f"out of memory even alone at padded length "
                                         f"{item.padded_length}; lower --max-length or use a larger device")
                    times.forward += time.perf_counter() - forward_started
                    summary.batches += 1
                    summary.real_tokens += item.real_tokens
                    summary.padded_tokens += item.padded_tokens
                    progress.update(len(item.rows))
                    elapsed = progress.format_dict["elapsed"]
                    if elapsed:
                        progress.set_postfix(tokens_per_s=f"{summary.real_tokens / elapsed:,.0f}", refresh=False)
                else:
                    _write_window(item.window, sink, manifest, todo, failures, job, model, times, shard_counts)
                    id_hashes.append(_hash_ids(item.window.blocks, failures))
                    progress.update(item.window.tokenize_errors)
                    if config.fail_fast and failures:
                        break
    except BaseException:
        sink.abort_all()
        _record_failures(failures, todo, manifest, summary)
        raise
    finally:
        progress.close()
    _record_failures(failures, todo, manifest, summary)
    sink.abort_all()  # shards left open by --fail-fast: nothing of them is committed
    written = sum((c for i, c in shard_counts.items() if i in sink.committed), np.zeros(3, np.int64))
    summary.rows, summary.error_rows, summary.truncated_rows = (int(n) for n in written)
    summary.duplicate_ids, summary.duplicate_id_examples = _duplicate_ids(id_hashes, sink)
    summary.wall_s = time.perf_counter() - started
    summary.padding_efficiency = padding_efficiency(summary.real_tokens, summary.padded_tokens)
    summary.rows_per_s = summary.rows / summary.wall_s
    summary.tokens_per_s = summary.real_tokens / summary.wall_s
    summary.stage_s = {name: round(seconds, 3) for name, seconds in asdict(times).items()}
    summary.device_busy_fraction = times.forward / max(summary.wall_s - times.setup, 1e-9)
    summary.lowered_batch_rows = dict(sorted(limits.lowered.items()))
    return summary


def run_status(output: str, storage_options: dict) -> dict:
    """Shards done, failed and pending for the run recorded in `output`, without a model."""
    sink_fs, output_dir = fsspec.core.url_to_fs(output, **storage_options)
    if not sink_fs.exists(f"{output_dir.rstrip('/')}/{MANIFEST_DIR}/run.json"):
        raise UsageError(f"{output} has no lengthwise run (no {MANIFEST_DIR}/run.json); check --output")
    manifest = RunManifest(sink_fs, output_dir.rstrip("/"))
    recorded = manifest.read_run()
    markers = manifest.shard_markers()
    config = recorded["config"]
    recorded_options = {k: v for k, v in config.get("storage_options", {}).items() if v != "<redacted>"}
    shards = list_shards(config["input"], config["id_column"], config["text_column"],
                         {**recorded_options, **storage_options})
    by_stem = {shard.stem: shard for shard in shards}
    status_of = {stem: markers.get(stem, {}).get("status", "pending") for stem in by_stem}
    done = [stem for stem, state in status_of.items() if state == "done"]
    return {
        "output": output, "shards": len(shards), "done": len(done),
        "failed": sum(state == "failed" for state in status_of.values()),
        "pending": sum(state == "pending" for state in status_of.values()),
        "rows": sum(shard.num_rows for shard in shards), "rows_done": sum(by_stem[stem].num_rows for stem in done),
        "failed_shards": [{"shard": markers[stem].get("input", stem), "error": markers[stem].get("error")}
                          for stem, state in status_of.items() if state == "failed"],
        "lock": manifest.read_lock(),
    }


def resolve_batch_setting(config: RunConfig, model_path: str, device: torch.device, model) -> tuple[RunConfig, str]:
    """Replace an `auto` token or row limit by the saved sweep recommendation for this model,
    device, dtype and max length; without one, tokens stay auto (the memory plan alone) and
    rows fall back to the default. Returns the config and where each limit came from."""
    from pipeline.config import DEFAULT_MAX_BATCH_ROWS
    from pipeline.sweep import load_recommendation, recommendation_key

    dtype = dtype_name(next(model.parameters()).dtype)
    changes, notes = {}, []
    for vary, name in (("max-batch-tokens", "max_batch_tokens"), ("max-batch-rows", "max_batch_rows")):
        value = getattr(config, name)
        if value is not None:
            notes.append(f"--{vary} {value}")
            continue
        key, file_name = recommendation_key(model_memory_fingerprint(model_path), config.job, device_name(device),
                                            dtype, config.max_length, vary)
        saved = load_recommendation(config.plan_cache or default_plan_cache_dir(), file_name, key)
        if saved is not None:
            changes[name] = saved["level"]
            notes.append(f"--{vary} {saved['level']} recommended by the sweep of {saved['created']} ({saved['path']})")
        elif name == "max_batch_tokens":
            notes.append("--max-batch-tokens auto: no sweep recommendation for this model, device and dtype, "
                         "so the memory plan alone")
        else:
            changes[name] = DEFAULT_MAX_BATCH_ROWS
            notes.append(f"--max-batch-rows auto: no sweep recommendation for this model, device and dtype, "
                         f"so {DEFAULT_MAX_BATCH_ROWS}")
    return dataclasses.replace(config, **changes), "; ".join(notes)


def memory_plan_for(config: RunConfig, job, model, model_path: str, device: torch.device) -> MemoryPlan | None:
    """The memory plan for these settings: from the plan cache, else probed on the device and
    cached. Logs which on stderr."""
    available = available_memory_bytes(device, config.memory_budget, config.memory_reserve)
    if available <= 0:
        raise UsageError(f"no memory left for batches on {device} ({available} bytes); "
                         "lower --memory-reserve or set --memory-budget")
    dtype = dtype_name(next(model.parameters()).dtype)
    key, name = plan_cache_key(model=model_memory_fingerprint(model_path), job=config.job,
                               device=device_name(device), dtype=dtype, max_length=config.max_length,
                               available_bytes=available, safety=config.safety,
                               max_batch_tokens=config.max_batch_tokens, max_batch_rows=config.max_batch_rows)
    cache_dir = config.plan_cache or default_plan_cache_dir()
    plan = load_cached_plan(cache_dir, key, name) if config.use_plan_cache else None
    if plan is None:
        try:
            plan = probe_memory_plan(job, model, device, available, config.safety, config.max_length,
                                     config.max_batch_rows, config.max_batch_tokens)
        except (ValueError, RuntimeError) as error:
            if config.max_batch_tokens is None:
                raise UsageError(f"the memory probe failed ({error}); give --max-batch-tokens a number") from error
            log(f"batch plan: the memory probe failed ({error}); using --max-batch-tokens and --max-batch-rows only")
            return None
        plan.key = key
        if config.use_plan_cache:
            plan.source = f"probed in {plan.probe_s:.1f}s, cached at {save_plan(cache_dir, name, plan)}"
        else:
            plan.source = f"probed in {plan.probe_s:.1f}s (plan cache off)"
    else:
        plan.source = f"from cache {plan.source}"
    print(f"batch plan: {plan.source}", file=sys.stderr)
    return plan


def describe_plan(plan: MemoryPlan | None) -> str:
    if plan is None:
        return "token and row limits only (no memory plan)"
    rows = ", ".join(f"≤{b.length}: {b.probed_rows}" for b in plan.buckets)
    return f"{plan.source}; rows per padded length {rows}"


def _write_window(window: Window, sink: ShardSink, manifest: RunManifest, shards: list[Shard],
                  failures: dict[int, str], job, model, times: StageTimes, counts: dict[int, np.ndarray]) -> None:
    """Write a finished window block by block; commit each shard whose last row it holds and
    mark it done. A shard that failed (while being read, or at its commit) is dropped whole:
    its temporary file is deleted and nothing of it is committed."""
    started = time.perf_counter()
    start = 0
    for block in window.blocks:
        positions = slice(start, start + block.num_rows)
        start += block.num_rows
        if block.failure is not None:
            failures[block.shard_index] = block.failure
            sink.abort(block.shard_index)
        if block.shard_index in failures:
            continue
        sink.write(block.shard_index, shards[block.shard_index], output_table(block, window, positions.start, job,
                                                                               model))
        if block.is_last_of_shard:
            shard = shards[block.shard_index]
            try:
                sink.commit(block.shard_index)
            except Exception as error:  # e.g. the rename failed for good, or the row count is wrong
                failures[block.shard_index] = f"committing the output failed: {type(error).__name__}: {error}"
                sink.abort(block.shard_index)
                continue
            manifest.mark(shard.stem, "done", input=shard.url, rows=shard.num_rows)
        valid = window.valid[positions]
        counts.setdefault(block.shard_index, np.zeros(3, np.int64))
        counts[block.shard_index] += (block.num_rows, (~valid).sum(), (window.encoded.truncated[positions] & valid).sum())
    times.write += time.perf_counter() - started


def _record_failures(failures: dict[int, str], shards: list[Shard], manifest: RunManifest,
                     summary: RunSummary) -> None:
    for shard_index, reason in sorted(failures.items()):
        manifest.mark(shards[shard_index].stem, "failed", input=shards[shard_index].url, error=reason)
        summary.failed_shards.append({"shard": shards[shard_index].url, "error": reason})


def id_hash(value) -> int:
    """A stable 64-bit hash of an id value (type included: 1 and "1" differ)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


def _hash_ids(blocks: list[RowBlock], failures: dict[int, str]) -> np.ndarray:
    """64-bit hashes of a window's non-null ids: 8 bytes a row to find duplicates at the end."""
    values = [v for b in blocks if b.shard_index not in failures for v in b.ids.to_pylist() if v is not None]
    return np.fromiter((id_hash(v) for v in values), dtype=np.int64, count=len(values))


def _duplicate_ids(id_hashes: list[np.ndarray], sink: ShardSink, examples: int = 5) -> tuple[int, list]:
    """How many rows repeat an earlier id, and a few such ids (read back from the outputs)."""
    hashes = np.concatenate(id_hashes) if id_hashes else np.zeros(0, np.int64)
    unique, counts = np.unique(hashes, return_counts=True)
    repeated = set(unique[counts > 1].tolist())
    duplicates = int((counts[counts > 1] - 1).sum())
    found: list = []
    for path in sink.committed.values() if repeated else ():
        for value in pq.read_table(path, columns=["id"], filesystem=sink.fs)["id"].to_pylist():
            if len(found) < examples and value is not None and id_hash(value) in repeated and value not in found:
                found.append(value)
    return duplicates, found
