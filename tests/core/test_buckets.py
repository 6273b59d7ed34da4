"""Bucketing and packing: pure numpy, checked against a slow obviously-correct packer."""


import numpy as np
import pytest

from pathlib import Path

from pipeline.core.buckets import (
    MAX_BATCH_PADDING,
    Batch,
    batch_capacity,
    bucket_bounds,
    padded_lengths,
    padding_efficiency,
    plan_batches,
)



def list_batches(*args) -> list[Batch]:
    return list(plan_batches(*args))


def test_a_limit_lowered_while_packing_applies_to_the_next_batches():
    """The device loop lowers the memory rows after an out-of-memory split; the rest of the
    window must be packed to the lowered limit, not only the next window."""
    limit = {"rows": 8}
    batches = plan_batches(np.full(40, 16), None, 512, bucket_bounds(64), lambda length: limit["rows"])
    first = next(batches)
    limit["rows"] = 3
    rest = list(batches)
    assert len(first.rows) == 8
    assert [len(b.rows) for b in rest] == [3] * 10 + [2]
    assert sorted(np.concatenate([first.rows] + [b.rows for b in rest]).tolist()) == list(range(40))


def test_bucket_bounds_are_multiples_of_eight_ending_at_max_length():
    assert bucket_bounds(32).tolist() == [8, 16, 24, 32]
    assert bucket_bounds(20).tolist() == [8, 16, 20]
    assert bucket_bounds(5).tolist() == [5]


def test_padded_lengths_round_up_to_the_next_bound():
    bounds = bucket_bounds(256)
    assert padded_lengths(np.array([1, 8, 9, 255, 256]), bounds).tolist() == [8, 8, 16, 256, 256]
    with pytest.raises(ValueError):
        padded_lengths(np.array([257]), bounds)
    with pytest.raises(ValueError):
        padded_lengths(np.array([0]), bounds)


def slow_plan(lengths, max_batch_tokens, max_batch_rows, bounds):
    """Row by row: take rows longest first (ties in input order) while the batch fits and the
    row pads by no more than MAX_BATCH_PADDING of the batch's padded length."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, current, current_pad = [], [], 0
    for i in order:
        pad = min(b for b in bounds if b >= lengths[i])
        if not current:
            current, current_pad = [i], pad
        elif (len(current) + 1 <= max_batch_rows and (len(current) + 1) * current_pad <= max_batch_tokens
              and pad >= (1 - MAX_BATCH_PADDING) * current_pad):
            current.append(i)
        else:
            batches.append((current, current_pad))
            current, current_pad = [i], pad
    if current:
        batches.append((current, current_pad))
    return batches


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_batch_tokens", [1, 64, 500, 4096])
@pytest.mark.parametrize("max_batch_rows", [1, 3, 512])
@pytest.mark.parametrize("max_length", [8, 100, 256])
def test_plan_matches_the_slow_packer(seed, max_batch_tokens, max_batch_rows, max_length):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_length + 1, size=int(rng.integers(0, 300)))
    bounds = bucket_bounds(max_length)
    plan = list_batches(lengths, max_batch_tokens, max_batch_rows, bounds)
    expected = slow_plan(lengths.tolist(), max_batch_tokens, max_batch_rows, bounds.tolist())
    assert [(b.rows.tolist(), b.padded_length) for b in plan] == expected


@pytest.mark.parametrize("seed", range(5))
def test_plan_covers_every_row_once_within_budget_longest_first(seed):
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(1, 40, 500), rng.integers(200, 257, 50)])
    bounds = bucket_bounds(256)
    plan = list_batches(lengths, 2048, 64, bounds)
    planned = np.concatenate([b.rows for b in plan])
    assert sorted(planned.tolist()) == list(range(len(lengths)))
    for batch in plan:
        assert len(batch.rows) <= 64
        assert batch.padded_tokens <= 2048 or len(batch.rows) == 1
        assert lengths[batch.rows].max() <= batch.padded_length
        assert batch.padded_length in bounds
    assert [b.padded_length for b in plan] == sorted((b.padded_length for b in plan), reverse=True)


def test_short_rows_travel_in_big_batches_and_long_rows_in_small_ones():
    lengths = np.array([8] * 100 + [256] * 100)
    plan = list_batches(lengths, 2048, 512, bucket_bounds(256))
    sizes = [(b.padded_length, len(b.rows)) for b in plan]
    # the last long batch is left short rather than padding short rows to 256
    assert sizes == [(256, 8)] * 12 + [(256, 4), (8, 100)]


def test_a_batch_closes_before_a_row_that_would_pad_by_more_than_an_eighth():
    lengths = np.array([64] * 3 + [56] * 3 + [48] * 3)
    plan = list_batches(lengths, 1 << 20, 4096, bucket_bounds(64))
    assert [(b.padded_length, b.rows.tolist()) for b in plan] == [(64, [0, 1, 2, 3, 4, 5]), (48, [6, 7, 8])]


def shared_lengths(name: str) -> np.ndarray:
    """Token lengths (≤ 256, as MiniLM's tokenizer counts them, without truncation) of a shared data set:
    all 27,070 tweets and the first 16,668 imdb reviews (its first 2 files), kept in the checkout so that the
    padding goal is held on a fresh clone too (made by tokenizing `../shared/data/<name>/shard-*.parquet`)."""
    with np.load(Path(__file__).resolve().parents[1] / "data" / "shared_token_lengths.npz") as lengths:
        return lengths[name.replace("-", "_")].astype(np.int64)


@pytest.mark.parametrize("name, window_rows, floor", [("tweets", 8192, 0.88), ("tweets", 65536, 0.88),
                                                      ("imdb-reviews", 16384, 0.96)])
def test_gpu_sized_batches_of_real_lengths_are_mostly_text(name, window_rows, floor):
    """At the CUDA budget (262,144 tokens, 4,096 rows) a batch no longer spans a window's whole
    length range: 0.47 of tweet tokens were text before, with 8,192-row windows."""
    lengths = np.random.default_rng(0).permutation(shared_lengths(name))
    bounds = bucket_bounds(256)
    real = padded = 0
    for start in range(0, len(lengths), window_rows):
        window = lengths[start:start + window_rows]
        for batch in plan_batches(window, 262144, 4096, bounds):
            real += int(window[batch.rows].sum())
            padded += batch.padded_tokens
    assert padding_efficiency(real, padded) >= floor
def test_a_row_longer_than_the_budget_still_gets_a_batch_of_one():
    plan = list_batches(np.array([256, 256]), 100, 512, bucket_bounds(256))
    assert [b.rows.tolist() for b in plan] == [[0], [1]]


def test_equal_lengths_keep_input_order():
    plan = list_batches(np.array([5, 5, 5, 5]), 16, 2, bucket_bounds(8))
    assert [b.rows.tolist() for b in plan] == [[0, 1], [2, 3]]


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="max_batch_tokens"):
        list_batches(np.array([1]), 0, 1, bucket_bounds(8))


def test_capacity_and_efficiency():
    assert batch_capacity(256, 4096, 512) == 16
    assert batch_capacity(8, 4096, 100) == 100
    assert batch_capacity(512, 256, 100) == 1
    assert Batch(np.arange(3), 16).padded_tokens == 48
    assert padding_efficiency(90, 100) == 0.9
    assert padding_efficiency(0, 0) == 1.0
