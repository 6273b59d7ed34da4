"""Length buckets and batch packing: token lengths in, row-index batches out.

Pure numpy, no torch, no files. The cost of a batch is its padded size, rows × padded
length, and a batch is padded to the bucket bound of its longest row. Rows are packed
longest first so the most memory-hungry batch of a window runs before the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pipeline.core.memory import MemoryPlan

BUCKET_STEP = 8  # padded lengths are multiples of 8: tensor-core friendly, few distinct shapes


def bucket_bounds(max_length: int, step: int = BUCKET_STEP) -> np.ndarray:
    """Upper bounds of the length buckets: step, 2·step, … and max_length itself."""
    if max_length < 1:
        raise ValueError(f"max_length must be at least 1, got {max_length}")
    bounds = np.arange(step, max_length + step, step, dtype=np.int64)
    bounds[-1] = max_length
    return np.unique(bounds)


def padded_lengths(lengths: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """The bucket bound each length pads to (the smallest bound ≥ length)."""
    lengths = np.asarray(lengths)
    if lengths.size and (lengths.min() < 1 or lengths.max() > bounds[-1]):
        raise ValueError(f"lengths must lie in 1..{bounds[-1]}, got {lengths.min()}..{lengths.max()}")
    return bounds[np.searchsorted(bounds, lengths, side="left")]


@dataclass(frozen=True)
class Batch:
    """Row positions (into the lengths array that was planned) and the length they pad to."""

    rows: np.ndarray
    padded_length: int

    @property
    def padded_tokens(self) -> int:
        return len(self.rows) * self.padded_length


def batch_capacity(padded_length: int, max_batch_tokens: int | None, max_batch_rows: int,
                   memory_rows: Callable[[int], int] | None = None) -> int:
    """Rows a batch of this padded length may hold under the token budget (None: no token
    budget), the row limit and the memory plan; never less than one, so every row runs."""
    rows = max_batch_rows
    if max_batch_tokens is not None:
        rows = min(rows, max_batch_tokens // padded_length)
    if memory_rows is not None:
        rows = min(rows, memory_rows(padded_length))
    return max(1, rows)


# A batch closes before it is full when the next row would make more than this share of its padded tokens
# padding that batching adds (each row's own rounding up to its bucket bound aside). Large batches otherwise span a
# window's whole length range: at 262,144 tokens a batch of tweets was half padding.
MAX_BATCH_PADDING = 1 / 8


def plan_batches(lengths: np.ndarray, max_batch_tokens: int | None, max_batch_rows: int,
                 bounds: np.ndarray, memory_rows: Callable[[int], int] | None = None,
                 max_padding: float = MAX_BATCH_PADDING) -> Iterator[Batch]:
    """Pack every row exactly once, longest first, under the padded-token and row limits and
    the memory plan's rows per padded length. Lazily: each batch asks `memory_rows` when it is
    packed, so a limit lowered after an out-of-memory error applies to the rest of the window.
    A batch also closes where taking the next rows would make more than `max_padding` of it
    padding added by batching (`fill_under_padding`).

    The sort is stable, so equal lengths keep input order and plans are reproducible. A row
    longer than the token budget on its own still gets a batch of one.
    """
    if (max_batch_tokens is not None and max_batch_tokens < 1) or max_batch_rows < 1:
        raise ValueError(f"limits must be positive, got max_batch_tokens={max_batch_tokens}, "
                         f"max_batch_rows={max_batch_rows}")
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    padded = padded_lengths(lengths[order], bounds)
    start = 0
    while start < len(order):
        padded_length = int(padded[start])
        capacity = batch_capacity(padded_length, max_batch_tokens, max_batch_rows, memory_rows)
        stop = start + fill_under_padding(padded[start:start + capacity], max_padding)
        yield Batch(rows=order[start:stop], padded_length=padded_length)
        start = stop


def fill_under_padding(own_padded: np.ndarray, max_padding: float) -> int:
    """How many of these rows (their own padded lengths, longest first) one batch takes: up to
    the first row that would pad by more than `max_padding` of the batch's padded length; at
    least one."""
    too_short = np.flatnonzero(own_padded < (1 - max_padding) * own_padded[0])
    return int(too_short[0]) if too_short.size else len(own_padded)


def padding_efficiency(real_tokens: int, padded_tokens: int) -> float:
    """Share of the computed tokens that were real text (1.0 means no padding)."""
    return real_tokens / padded_tokens if padded_tokens else 1.0


NO_ROW_LIMIT = int(np.iinfo(np.int64).max)


class BatchLimits:
    """Rows per padded length from the memory plan, lowered for the rest of the run whenever a
    batch runs out of memory. Read by the planner thread, lowered by the device loop."""

    def __init__(self, plan: MemoryPlan | None):
        self.plan = plan
        self.lowered: dict[int, int] = {}  # padded length → rows that ran after a split

    def rows_for(self, padded_length: int) -> int:
        """The plan's rows, and after an out-of-memory split at length L that left R rows, no more
        padded tokens than L × R at any length: a shorter batch that kept the full token budget
        failed again at every new length, and a longer one needs more memory per row."""
        rows = self.plan.rows_for(padded_length) if self.plan else NO_ROW_LIMIT
        for length, lowered_rows in list(self.lowered.items()):
            rows = min(rows, max(1, length * lowered_rows // padded_length))
        return rows

    def lower(self, padded_length: int, rows: int) -> None:
        self.lowered[padded_length] = min(rows, self.lowered.get(padded_length, rows))
