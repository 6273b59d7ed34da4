"""Collate: a window's rows planned into batches (core/buckets.py) and gathered into the padded arrays a
batch is sent as, on the host. Pure numpy, no torch (tests/test_layers.py): what builds batches needs none
of the device's (core/forward.py sends them; on CUDA the feeder process, offline/feeder.py, builds them apart)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pipeline.core.buckets import BatchLimits, bucket_bounds, plan_batches
from pipeline.core.tokenize import EncodedRows


def collate(token_ids: np.ndarray, offsets: np.ndarray, rows: np.ndarray, padded_length: int,
            pad_token_id: int, type_ids: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """Padded (rows, padded_length) input ids and attention mask from flat token arrays, and the
    token type ids (0 at padding) where `type_ids` (a pair's, beside `token_ids`) are given. Each
    row's `padded_length` tokens from its start are copied at once (a sliding view of the flat
    array: no index per token) and what lies past its end is padded over: 0.58 → 0.29 µs a row
    alone against gathering each real token (64,000 rows of ~54 tokens, 2-core AVX2 EPYC; in a run,
    where memory is shared with the tokenizer workers, within noise: docs/performance.md)."""
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    attention_mask = np.arange(padded_length)[None, :] < lengths[:, None]
    input_ids = padded_rows(token_ids, starts, lengths, padded_length, attention_mask, pad_token_id)
    if type_ids is None:
        return input_ids, attention_mask.astype(np.int64)
    return input_ids, attention_mask.astype(np.int64), padded_rows(type_ids, starts, lengths, padded_length,
                                                                   attention_mask, 0)


def padded_rows(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray, padded_length: int,
                real: np.ndarray, pad: int) -> np.ndarray:
    """(rows, padded_length) int64: each row's `lengths` values from `starts` in `values`, then `pad`
    (`real`: the mask of the real positions). A row whose window would run past the array's end
    (the last few) is copied on its own."""
    out = np.empty(real.shape, np.int64)
    whole = starts + padded_length <= len(values)
    if whole.all():
        out[...] = sliding_window_view(values, padded_length)[starts]
    elif whole.any():
        out[whole] = sliding_window_view(values, padded_length)[starts[whole]]
    for index in np.flatnonzero(~whole):
        start, length = int(starts[index]), int(lengths[index])
        out[index, :length] = values[start:start + length]
    np.copyto(out, pad, where=~real)
    return out


def packed_layout(lengths: np.ndarray, padded_length: int) -> tuple[np.ndarray, np.ndarray]:
    """The unpadded forward's layout of right-padded rows of `lengths`, built on the host so that
    the device is never asked for it (a sync): each real token's position in the flat
    (rows × padded_length) batch (int64, row by row) and each row's offset in the packed tokens
    ((rows + 1,) int32: 0, l0, l0 + l1, …)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    row_of_token = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    positions = np.arange(int(offsets[-1]), dtype=np.int64) - offsets[:-1][row_of_token]
    return row_of_token * padded_length + positions, offsets


def has_padding(lengths: np.ndarray, padded_length: int) -> bool:
    """Whether a batch of rows of `lengths` padded to `padded_length` holds any padding: known on
    the host, so the device never has to be asked (a sync) whether its mask may be dropped."""
    return bool((np.asarray(lengths) < padded_length).any())


@dataclass
class CollatedBatch:
    """A batch's rows and their arrays on the host, before they are sent to the device."""

    rows: np.ndarray  # positions in the encoded rows
    padded_length: int
    arrays: tuple[np.ndarray, ...]  # input ids, attention mask (token type ids if `typed`; the packed layout)
    real_tokens: int
    padded_tokens: int
    entered: float  # when the planner handed these rows on (the sweep's row latency starts here)
    padded: bool  # some row is shorter than padded_length (else the encoder runs without a mask)
    typed: bool  # token type ids follow the mask (a pair job whose model types its texts)


def collated_batches(encoded: EncodedRows, rows: np.ndarray, max_batch_tokens: int | None, max_batch_rows: int,
                     max_length: int, limits: BatchLimits, pad_token_id: int, padding_multiple: int,
                     packed: bool = False) -> Iterator[CollatedBatch]:
    """Plan `rows` of `encoded` into batches (longest first, padded to `padding_multiple`: the device's)
    and collate each; `packed`: with its packed layout (`packed_layout`), for a model that runs padded
    batches unpadded."""
    lengths = encoded.lengths[rows]
    bounds = bucket_bounds(max_length, padding_multiple)
    for batch in plan_batches(lengths, max_batch_tokens, max_batch_rows, bounds, limits.rows_for):
        entered = time.perf_counter()
        picked = rows[batch.rows]
        arrays = collate(encoded.token_ids, encoded.offsets, picked, batch.padded_length, pad_token_id,
                         encoded.type_ids)
        batch_lengths = lengths[batch.rows]
        padded = has_padding(batch_lengths, batch.padded_length)
        if packed and padded:
            arrays += packed_layout(batch_lengths, batch.padded_length)
        yield CollatedBatch(picked, batch.padded_length, arrays, int(batch_lengths.sum()), batch.padded_tokens, entered,
                            padded, encoded.type_ids is not None)
