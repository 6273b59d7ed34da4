"""Batches planned and collated on the host (core/collate.py), with no torch: every row once, its own
tokens then padding, and the flags and layout the device loop reads."""

from __future__ import annotations

import numpy as np

from pipeline.core.buckets import BatchLimits
from pipeline.core.collate import collated_batches
from pipeline.core.tokenize import EncodedRows

PAD = 7


def encoded_rows(lengths: list[int], typed: bool = False) -> EncodedRows:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    token_ids = (np.arange(offsets[-1]) % 1000 + 100).astype(np.int32)
    type_ids = (np.arange(offsets[-1]) % 2).astype(np.int8) if typed else None
    return EncodedRows(token_ids, offsets, np.zeros(len(lengths), bool), [None] * len(lengths), 0.0,
                       type_ids=type_ids)


def test_every_planned_row_once_with_its_own_tokens_then_padding():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 40, 300).tolist()
    encoded = encoded_rows(lengths)
    rows = np.flatnonzero(rng.random(300) < 0.8)  # the rows that run (others failed or were reused)
    batches = list(collated_batches(encoded, rows, 256, 64, 40, BatchLimits(None), PAD, 8))
    assert sorted(np.concatenate([b.rows for b in batches]).tolist()) == rows.tolist()
    for batch in batches:
        input_ids, attention_mask = batch.arrays
        assert input_ids.shape == attention_mask.shape == (len(batch.rows), batch.padded_length)
        assert batch.padded_length % 8 == 0 or batch.padded_length == 40
        assert len(batch.rows) * batch.padded_length <= max(256, batch.padded_length)
        for row, ids, mask in zip(batch.rows, input_ids, attention_mask):
            start, length = encoded.offsets[row], lengths[row]
            assert ids[:length].tolist() == encoded.token_ids[start:start + length].tolist()
            assert (ids[length:] == PAD).all() and mask.tolist() == [1] * length + [0] * (batch.padded_length - length)
        assert batch.real_tokens == sum(lengths[row] for row in batch.rows)
        assert batch.padded_tokens == len(batch.rows) * batch.padded_length
        assert batch.padded == bool((attention_mask == 0).any()) and not batch.typed


def test_a_packed_layout_only_where_a_batch_has_padding_and_type_ids_beside_the_mask():
    encoded = encoded_rows([8, 8, 5, 3], typed=True)
    batches = list(collated_batches(encoded, np.arange(4), None, 2, 8, BatchLimits(None), PAD, 8, packed=True))
    full, short = batches
    assert full.rows.tolist() == [0, 1] and not full.padded and len(full.arrays) == 3  # ids, mask, types
    assert short.rows.tolist() == [2, 3] and short.padded and len(short.arrays) == 5  # and the packed layout
    positions, offsets = short.arrays[3:]
    assert offsets.tolist() == [0, 5, 8] and positions.tolist() == [0, 1, 2, 3, 4, 8, 9, 10]
    assert short.typed and short.arrays[2][1, 3:].tolist() == [0] * 5  # no token type at padding


def test_a_lowered_limit_applies_to_the_batches_planned_after_it():
    limits = BatchLimits(None)
    batches = collated_batches(encoded_rows([4] * 12), np.arange(12), None, 6, 8, limits, PAD, 8)
    assert len(next(batches).rows) == 6
    limits.lower(8, 2)
    assert [len(batch.rows) for batch in batches] == [2, 2, 2]
