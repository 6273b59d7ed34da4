"""Windows: consecutive rows read, tokenized, sorted and packed together.

A window bounds the rows in flight (memory follows `--window-rows`, not the data). It may
span shards; it is then planned and run in parts that end at a shard's last row (`WindowPart`),
each written and its finished shard committed as soon as its batches are done, so an interrupt
loses at most the window in flight, never the shards before it in that window. Outputs are
scattered back by row position as batches finish.
"""

from __future__ import annotations

import dataclasses
import mmap
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from pipeline.core.buckets import BatchLimits
from pipeline.core.clock import StageTimes
from pipeline.core.collate import CollatedBatch, collated_batches
from pipeline.core.segments import segment_groups
from pipeline.core.tokenize import EncodedRows, TokenizerPool, rows_without_error
from pipeline.offline.carry import carried_mask, split_by_carry
from pipeline.offline.reuse import ReusedRows, hash_rows, row_hashes
from pipeline.offline.source import RowBlock


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
                                              kept={name: values.slice(start, take) for name, values in block.kept.items()},
                                              errors=None if block.errors is None else block.errors.slice(start, take),
                                              pairs=None if block.pairs is None else block.pairs.slice(start, take),
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
    """One window in flight: its blocks, their tokens, and the outputs as they arrive.

    With --long-text split the rows that did not fit have segments (`encoded.segments`): they
    run as rows of their own after the window's rows (`scored`: rows, then segments), and a
    split row's outputs are folded from its segments' when it is written (`row_outputs`)."""

    blocks: list[RowBlock]
    encoded: EncodedRows
    outputs: dict[str, np.ndarray] = field(default_factory=dict)  # by position in `scored`
    stored: dict[str, np.ndarray] = field(default_factory=dict, init=False)  # by output: positions of `scored` stored
    valid: np.ndarray = field(init=False)  # rows that tokenized and go to the model (or their segments do)
    tokenize_errors: int = field(init=False)  # rows that never reach the model (reused ones too)
    scored: EncodedRows = field(init=False)  # what runs: the rows, then their segments
    segment_counts: np.ndarray | None = field(init=False)  # --long-text split: segments per row (0: it fit)
    duplicate_of: np.ndarray | None = None  # --dedupe: per row, the row whose result it copies (itself: none)
    carried: np.ndarray | None = field(init=False)  # a change of models: rows whose kept models' columns are
    # carried (offline/carry.py); they still run, on the models computed

    def __post_init__(self) -> None:
        self.carried = carried_mask(self.blocks)
        reused = np.concatenate([b.reuse.mask if b.reuse is not None and not b.reuse.carried
                                 else np.zeros(b.num_rows, bool) for b in self.blocks]) if self.blocks \
            else np.zeros(0, bool)
        for row in np.flatnonzero(reused):  # --reuse: their text was dropped; they take yesterday's result
            self.encoded.errors[row] = None
        self.valid = rows_without_error(self.encoded.errors) & ~reused
        self.tokenize_errors = int((~self.valid).sum())
        segments = self.encoded.segments
        self.scored, self.segment_counts = self.encoded, None
        if segments is not None:
            self.segment_counts = np.bincount(segments.row, minlength=self.num_rows)
            self.scored = self.encoded.with_segments()

    def rows_to_score(self, start: int, end: int) -> np.ndarray:
        """Positions in `scored` of what runs for rows start:end: the valid rows that fit, and the
        segments of the valid rows that were split."""
        rows = start + np.flatnonzero(self.valid[start:end])
        if self.segment_counts is None or not len(self.encoded.segments):
            return rows
        owner = self.encoded.segments.row
        first, last = np.searchsorted(owner, [start, end])
        segments = first + np.flatnonzero(self.valid[owner[first:last]])
        return np.concatenate([rows[self.segment_counts[rows] == 0], self.num_rows + segments])

    def rows_by_models(self, start: int, end: int, computed: tuple[str, ...] | None) -> list[tuple]:
        """`rows_to_score(start, end)` as (positions, the models that run them; None: every model): with a
        change of models, the carried rows run only the `computed` models (offline/carry.py)."""
        segments = self.encoded.segments
        return split_by_carry(self.rows_to_score(start, end), self.carried,
                              None if segments is None else segments.row, self.num_rows, computed)

    def rows_done(self, scored_rows: np.ndarray) -> int:
        """Rows whose last piece these positions of `scored` are (for the progress bar)."""
        fit = int((scored_rows < self.num_rows).sum())
        if self.segment_counts is None:
            return fit
        owner = self.encoded.segments.row
        segments = scored_rows[scored_rows >= self.num_rows] - self.num_rows
        return fit + int((segments + 1 == len(owner)).sum() +
                         (owner[np.minimum(segments + 1, len(owner) - 1)] != owner[segments]).sum())

    def fail(self, rows: np.ndarray, error: str) -> None:
        """Rows that could not run after all (out of memory even alone) get an error; a segment
        fails its row."""
        if self.segment_counts is not None and len(rows):
            rows = np.unique(np.where(rows < self.num_rows, rows,
                                      self.encoded.segments.row[np.maximum(rows - self.num_rows, 0)]))
        for row in rows:
            self.encoded.errors[row] = error
        self.valid[rows] = False

    def row_outputs(self, start: int, end: int, fold) -> dict[str, np.ndarray]:
        """The outputs of rows start:end; a split row's folded from its segments by
        `fold(segment outputs, where each row's segments start, their token counts)`, which
        may add `best_segment` (row, label → the segment that decided it): that becomes `spans`,
        the character span of the text behind each label's output (all the text for a row that fit)."""
        OUTPUT_ARRAYS.wait_placed()
        self._zero_unstored(start, end)
        outputs = {name: values[start:end] for name, values in self.outputs.items()}
        if self.segment_counts is None or not outputs:
            return outputs
        segments = self.encoded.segments
        first, last = np.searchsorted(segments.row, [start, end])
        self._zero_unstored(self.num_rows + first, self.num_rows + last)
        rows, starts = segment_groups(segments.row[first:last])
        folded = fold({name: values[self.num_rows + first:self.num_rows + last]
                       for name, values in self.outputs.items()}, starts, segments.lengths[first:last])
        # `best_segment`, or a model's `NAME.best_segment` in a run of several (jobs/model_set.py)
        bests = {name: folded.pop(name) for name in list(folded) if name.rpartition(".")[2] == "best_segment"}
        outputs = {name: values.copy() for name, values in outputs.items()}
        for name, values in folded.items():
            outputs[name][rows - start] = values
        for name, best in bests.items():
            spans = np.zeros((end - start, best.shape[1], 2), np.int32)
            spans[:, :, 1] = segments.row_chars[start:end, None]
            spans[rows - start] = segments.spans[first + best]
            outputs[name.removesuffix("best_segment") + "spans"] = spans
        return outputs

    def _zero_unstored(self, start: int, end: int) -> None:
        """Outputs at positions start:end of `scored` that were never stored (a row that did not run, or
        failed) read as zeros: the arrays come from earlier windows as they were left (`OutputArrays`)."""
        for name, values in self.outputs.items():
            unstored = start + np.flatnonzero(~self.stored[name][start:end])
            if len(unstored):
                values[unstored] = 0

    @property
    def num_rows(self) -> int:
        return len(self.encoded)

    def set_aside_duplicates(self, text_hashes: np.ndarray) -> None:
        """Rows whose text an earlier row of the window has are not run: they copy its result. Rows
        split into segments run each (their result is folded from their own segments at the write)."""
        whole = self.valid if self.segment_counts is None else self.valid & (self.segment_counts == 0)
        if self.carried is None:
            self.duplicate_of = first_of_each_text(text_hashes, whole)
        else:  # a carried row runs fewer models: it copies only a carried row, and is copied only by one
            self.duplicate_of = np.where(self.carried, first_of_each_text(text_hashes, whole & self.carried),
                                         first_of_each_text(text_hashes, whole & ~self.carried))
        self.valid[self.duplicate_of != np.arange(self.num_rows)] = False

    def copy_duplicates(self, start: int, end: int) -> int:
        """Once rows `start:end` have run: each duplicate among them takes its first copy's outputs, bit for
        bit, or its error (the first copy is never later). Returns the rows copied."""
        if self.duplicate_of is None:
            return 0
        rows = start + np.flatnonzero(self.duplicate_of[start:end] != np.arange(start, end))
        firsts = self.duplicate_of[rows]
        if len(rows):
            OUTPUT_ARRAYS.wait_placed()
        for name, values in self.outputs.items():
            values[rows] = values[firsts]
            self.stored[name][rows] = self.stored[name][firsts]
        ran = self.valid[firsts]
        self.valid[rows] = ran
        for row, first in zip(rows[~ran].tolist(), firsts[~ran].tolist()):
            self.encoded.errors[row] = self.encoded.errors[first]
        return len(rows)

    def store(self, rows: np.ndarray, batch_outputs: dict[str, np.ndarray]) -> None:
        """Scatter one batch's outputs back to the positions (in `scored`) of its rows."""
        for name, values in batch_outputs.items():
            if name not in self.outputs:
                self.outputs[name] = OUTPUT_ARRAYS.take((len(self.scored), *values.shape[1:]), values.dtype)
                self.stored[name] = np.zeros(len(self.scored), dtype=bool)
            OUTPUT_ARRAYS.place(self.outputs[name], rows, values)
            self.stored[name][rows] = True

    def release_outputs(self) -> None:
        """Every row is written: the outputs' arrays go to the next windows."""
        outputs, self.outputs, self.stored = self.outputs, {}, {}
        OUTPUT_ARRAYS.give_back(outputs.values())


HUGE_PAGE_BYTES = 2 * 2**20  # an x86-64 transparent huge page


def zeroed_array(shape: tuple, dtype: np.dtype) -> np.ndarray:
    """A zeroed array in a mapping of its own that the kernel may back with transparent huge pages
    (asked for with madvise: the common `madvise` setting gives them to no one else). Its first
    touch, row by row as batches are stored, then faults in 2 MiB at a time instead of 4 KiB:
    storing a 65,536 x 384 float32 window cost the device loop 3.5 µs a row in an array from
    np.zeros and 0.3 µs in this one (2-core Zen 4 VM). Small arrays, and systems without
    anonymous mappings, get np.zeros."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if size < HUGE_PAGE_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):
        return np.zeros(shape, dtype)
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(memory, dtype).reshape(shape)  # the array keeps the mapping; unmapped with it


class ProcessMemory:
    """Window outputs in this process's own memory (`zeroed_array`), each batch's rows put in their places
    here. The other window memory is an encoder process's (offline/encoder.py's `OutputEncoder`: `zeros`
    in memory it shares, `place` by a thread of its, `wait_placed` before reading)."""

    zeros = staticmethod(zeroed_array)

    @staticmethod
    def place(array: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
        array[rows] = values

    @staticmethod
    def wait_placed() -> None:
        pass


class OutputArrays:
    """Arrays for windows' outputs, kept from one window to the next, in this process's memory or an encoder
    process's (`memory`). A window's outputs are ~1.5 KB a row (a 384-float embedding): a new array is faulted
    in as batches are stored, which cost the device loop ten times the copy itself. One taken again holds
    the last window's values: the window zeroes the rows it did not store when they are read
    (`Window.row_outputs`), not the whole array (0.1 µs a row of the device loop). At most `keep` arrays of
    each shape wait, so what is kept stays within the windows in flight; an array of an earlier memory is not
    kept (see `memory`)."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._memory = ProcessMemory()
        self._free: dict[tuple, list[np.ndarray]] = {}
        self._made: set[int] = set()  # ids of the arrays the current memory made that are alive
        self._lock = threading.Lock()  # windows are stored by the device loop and released by the writer

    @property
    def memory(self):
        return self._memory

    @memory.setter
    def memory(self, memory) -> None:
        """A new memory drops the arrays the old one made: a run with an encoder would otherwise store
        into a run's before it (kept by `keep_pool` or a Ray actor) that the encoder cannot map; an array of
        the old one given back later (a shard still being written as the next one starts) is let go."""
        with self._lock:
            self._memory = memory
            self._free.clear()
            self._made.clear()

    def take(self, shape: tuple, dtype: np.dtype) -> np.ndarray:
        with self._lock:
            free = self._free.get((shape, np.dtype(dtype)))
            array = free.pop() if free else None
        if array is None:
            with self._lock:
                memory = self._memory
            array = memory.zeros(shape, dtype)
            with self._lock:
                if memory is self._memory:
                    self._made.add(id(array))
        return array

    def place(self, array: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
        """`array[rows] = values`, by the memory's way (visible here after `wait_placed`)."""
        self._memory.place(array, rows, values)

    def wait_placed(self) -> None:
        self._memory.wait_placed()

    def give_back(self, arrays: Iterable[np.ndarray]) -> None:
        with self._lock:
            for array in arrays:
                free = self._free.setdefault((array.shape, array.dtype), [])
                if id(array) in self._made and len(free) < self.keep:
                    free.append(array)
                else:
                    self._made.discard(id(array))


OUTPUT_ARRAYS = OutputArrays()  # one for the process: a Ray actor's overlapping shards share it


def first_of_each_text(text_hashes: np.ndarray, eligible: np.ndarray) -> np.ndarray:
    """Per row, the first eligible row with its text hash: itself for a first copy and for a row not eligible."""
    source = np.arange(len(text_hashes))
    rows = np.flatnonzero(eligible)
    if len(rows):
        _, first, inverse = np.unique(text_hashes[rows], return_index=True, return_inverse=True)
        source[rows] = rows[first[inverse.reshape(-1)]]
    return source


def dedupe_windows(windows: Iterable[Window]) -> Iterator[Window]:
    """--dedupe: in each window, rows with the same text (a pair job's: the same text and pair; its hash, the one
    the text-hash file keeps, so it is computed once) run once; the block's hashes are kept for that file."""
    for window in windows:
        window.blocks = [block if block.reuse is not None else dataclasses.replace(
            block, reuse=ReusedRows(hash_rows(block.ids, block.texts, block.pairs), np.zeros(block.num_rows, bool),
                                    None))
            for block in window.blocks]
        if window.blocks:
            hashes = pa.concat_arrays([block.reuse.hashes.text_hashes for block in window.blocks])
            window.set_aside_duplicates(hashes.fill_null(0).to_numpy())
        yield window


@dataclass(frozen=True)
class WindowPart:
    """Consecutive blocks `first_block:end_block` of a window (rows `start_row:end_row`): planned,
    run and written together; it ends at the last row of a shard or of the window."""

    window: Window
    first_block: int
    end_block: int
    start_row: int
    end_row: int

    @property
    def blocks(self) -> list[RowBlock]:
        return self.window.blocks[self.first_block:self.end_block]

    @property
    def tokenize_errors(self) -> int:
        return int((~self.window.valid[self.start_row:self.end_row]).sum())


def window_parts(window: Window, min_rows: int) -> list[WindowPart]:
    """The window cut after a shard's last row once a part holds at least `min_rows` rows: a
    shard ending inside the window is committed as soon as its part is done, while tiny shards
    still share a part (and its batches) with their neighbours. The last part takes the rest."""
    parts, first, start, row = [], 0, 0, 0
    for index, block in enumerate(window.blocks):
        row += block.num_rows
        if block.is_last_of_shard and row - start >= min_rows and index + 1 < len(window.blocks):
            parts.append(WindowPart(window, first, index + 1, start, row))
            first, start = index + 1, row
    parts.append(WindowPart(window, first, len(window.blocks), start, row))
    return parts


PART_OF_WINDOW = 8  # a window spanning shards is cut at shard ends into parts of at least 1/8 of its rows


@dataclass(frozen=True)
class BatchPacking:
    """What packing a run's batches takes of its runtime: the limits, the device's padding multiple and
    whether the model runs padded batches unpadded (their packed layout is collated too)."""

    window_rows: int
    max_batch_tokens: int | None
    max_batch_rows: int
    max_length: int
    pad_token_id: int
    padding_multiple: int
    packed: bool


@dataclass
class WindowBatch:
    """A collated batch of a window's rows on the host, and the models that run it (None: every one)."""

    batch: CollatedBatch
    window: Window
    models: tuple[str, ...] | None


def collated_parts(windows: Iterable[Window], packing: BatchPacking, limits: BatchLimits,
                   computed: tuple[str, ...] | None = None) -> Iterator[WindowBatch | WindowPart]:
    """Each window part's valid rows as collated batches, then the part itself: its rows are done once
    its batches are, so it can be written and the shard it ends committed. `computed`: a change of models,
    whose carried rows run in batches of their own, by these models only (none: they do not run). All on
    the host, without torch: the device's side sends each batch (core/forward.py `sent`)."""
    for window in windows:
        for part in window_parts(window, max(1, packing.window_rows // PART_OF_WINDOW)):
            for rows, models in window.rows_by_models(part.start_row, part.end_row, computed):
                if models == ():
                    continue
                for batch in collated_batches(window.scored, rows, packing.max_batch_tokens, packing.max_batch_rows,
                                              packing.max_length, limits, packing.pad_token_id,
                                              packing.padding_multiple, packing.packed):
                    yield WindowBatch(batch, window, models)
            yield part


def submit_window(pool: TokenizerPool, blocks: list[RowBlock]) -> tuple[list[RowBlock], list]:
    """Hand a window's texts to the tokenizer pool, with the ids of the blocks --reuse has not hashed
    (the workers hash those rows too): the window and its pending handles."""
    return blocks, [handle for block in blocks
                    for handle in pool.submit(block.texts, block.ids if block.reuse is None else None, block.pairs)]


def tokenize_windows(pool: TokenizerPool, windows: Iterable[list[RowBlock]], times: StageTimes,
                     in_flight: tuple[list[RowBlock], list] | None = None) -> Iterator[Window]:
    """Tokenized windows; the next window is submitted before the current one is handed on.
    `in_flight`: a first window submitted already (`submit_window`), ahead of `windows`."""
    for blocks in windows:
        submitted = submit_window(pool, blocks)
        if in_flight is not None:
            yield _finish_tokenizing(pool, in_flight, times)
        in_flight = submitted
    if in_flight is not None:
        yield _finish_tokenizing(pool, in_flight, times)


def _finish_tokenizing(pool: TokenizerPool, in_flight, times: StageTimes) -> Window:
    """The window's encoded rows, and each block's hashes from the workers (`block.reuse`, with
    no row reused: what dedupe, the id count and the text-hash file read); a row with a null id
    is an error whatever its text, and one its reader could not read whole has the reader's error."""
    blocks, handles = in_flight
    encoded = pool.result(handles)
    times.tokenize += encoded.encode_s
    if encoded.hashes is not None:
        blocks, start = list(blocks), 0
        for index, block in enumerate(blocks):
            if block.reuse is None:
                hashes = row_hashes(encoded.hashes.slice(start, start + block.num_rows))
                blocks[index] = dataclasses.replace(block, reuse=ReusedRows(hashes, np.zeros(block.num_rows, bool),
                                                                            None))
            start += block.num_rows
    null_ids = np.concatenate([b.ids.is_null().to_numpy(zero_copy_only=False) for b in blocks]) if blocks else []
    for row in np.flatnonzero(null_ids):
        encoded.errors[row] = "id is null"
    start = 0
    for block in blocks:
        if block.errors is not None and block.errors.null_count < len(block.errors):
            for row, error in enumerate(block.errors.to_pylist()):
                if error is not None:
                    encoded.errors[start + row] = error
        start += block.num_rows
    return Window(blocks, encoded)
