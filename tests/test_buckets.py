"""Bucketing and packing: pure numpy, checked against a slow obviously-correct packer."""


import numpy as np
import pytest

from pipeline.core.buckets import Batch, batch_capacity, bucket_bounds, padded_lengths, padding_efficiency, plan_batches


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
    """Row by row: take rows longest first (ties in input order) while the batch fits."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, current, current_pad = [], [], 0
    for i in order:
        pad = min(b for b in bounds if b >= lengths[i])
        if not current:
            current, current_pad = [i], pad
        elif len(current) + 1 <= max_batch_rows and (len(current) + 1) * current_pad <= max_batch_tokens:
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
    # the 13th long batch is topped up with 4 short rows rather than left half empty
    assert sizes == [(256, 8)] * 13 + [(8, 96)]


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
