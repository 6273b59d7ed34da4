"""Collating padded batches and the prefetch thread."""

import resource
import threading
import time

import numpy as np
import pytest
import torch

from pipeline.core.collate import collate
from pipeline.core.forward import finite_rows, prefetch
from pipeline.core.device import keep_freed_host_memory, resolve_device, resolve_dtype
from pipeline.core.errors import UsageError


def test_collate_pads_each_row_to_the_batch_length():
    token_ids = np.array([1, 2, 3, 4, 5, 6], dtype=np.int32)
    offsets = np.array([0, 3, 4, 6])
    ids, mask = collate(token_ids, offsets, rows=np.array([2, 0, 1]), padded_length=4, pad_token_id=9)
    assert ids.tolist() == [[5, 6, 9, 9], [1, 2, 3, 9], [4, 9, 9, 9]]
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]
    assert ids.dtype == np.int64


@pytest.mark.parametrize("seed", range(4))
def test_collate_equals_padding_each_row_by_hand(seed):
    """Differential: random rows (empty ones too), picked in any order, padded row by row in Python."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 12, 40)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    token_ids = rng.integers(1, 1000, offsets[-1]).astype(np.int32)
    type_ids = rng.integers(0, 2, offsets[-1]).astype(np.int8)
    rows = rng.permutation(40)[:25]
    padded = int(lengths[rows].max()) + int(rng.integers(0, 3))
    ids, mask, types = collate(token_ids, offsets, rows, padded, 7, type_ids)
    for index, row in enumerate(rows):
        real = slice(offsets[row], offsets[row + 1])
        pad = padded - lengths[row]
        assert ids[index].tolist() == token_ids[real].tolist() + [7] * pad
        assert mask[index].tolist() == [1] * lengths[row] + [0] * pad
        assert types[index].tolist() == type_ids[real].tolist() + [0] * pad
    assert ids.dtype == mask.dtype == types.dtype == np.int64


@pytest.mark.parametrize("seed", range(4))
def test_finite_rows_equals_checking_each_row(seed):
    """Differential: nan, +inf and -inf at random places of two outputs (or none), against a row-by-row check."""
    rng = np.random.default_rng(seed)
    outputs = {"embedding": rng.normal(size=(30, 8)).astype(np.float32),
               "scores": rng.normal(size=(30, 2, 3)).astype(np.float32)}
    for values in outputs.values():
        flat = values.reshape(-1)
        flat[rng.integers(0, len(flat), seed)] = rng.choice([np.nan, np.inf, -np.inf], seed)
    expected = [all(np.isfinite(values[row]).all() for values in outputs.values()) for row in range(30)]
    assert finite_rows(outputs).tolist() == expected


def test_prefetch_keeps_order_and_stays_at_most_depth_ahead():
    produced = []

    def items():
        for i in range(20):
            produced.append(i)
            yield i

    seen = []
    for item in prefetch(items(), depth=3):
        time.sleep(0.01)
        # the consumer holds one item, the queue at most 3, the producer one waiting to be put
        assert len(produced) - len(seen) <= 5
        seen.append(item)
    assert seen == list(range(20))


def test_prefetch_raises_producer_errors_in_the_consumer():
    def items():
        yield 1
        raise ValueError("broken shard")

    with pytest.raises(ValueError, match="broken shard"):
        list(prefetch(items(), depth=2))


def test_leaving_the_loop_stops_the_producer():
    def items():
        i = 0
        while True:
            yield i
            i += 1

    before = threading.active_count()
    for item in prefetch(items(), depth=2):
        if item == 3:
            break
    assert threading.active_count() == before


def test_auto_device_and_dtype_on_this_machine():
    device = resolve_device("auto")
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(UsageError, match="--dtype"):
        resolve_dtype("float8", torch.device("cpu"))
    with pytest.raises(UsageError, match="--device"):
        resolve_device("tpu-ish")


def _minor_faults_of_repeated_allocations(count: int, bytes_each: int) -> int:
    """Page faults taken while allocating, writing and freeing a block `count` times, as each
    batch's activations are."""
    for _ in range(5):  # the heap grows to its working size first, faulting in either case
        torch.ones(bytes_each // 4).sum()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(count):
        torch.ones(bytes_each // 4).sum()  # written page by page, then freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_freed_activation_memory_is_reused_without_page_faults():
    block = 24 * 2**20  # one attention-score tensor of an 8 × 256-token batch
    pages_per_block = block // resource.getpagesize()
    if not keep_freed_host_memory(torch.device("cpu")):
        pytest.skip("not glibc: its malloc thresholds cannot be set")
    faults = _minor_faults_of_repeated_allocations(20, block)
    # Without the setting each block is mapped afresh: 20 × 6,144 faults on 4 KiB pages. With it,
    # a few blocks' worth still happen now and then (the kernel reclaiming idle pages).
    assert faults < 5 * pages_per_block, f"{faults} page faults for 20 reused {block >> 20} MiB blocks"


def test_a_cpu_peak_since_an_earlier_point_counts_what_earlier_calls_kept():
    """The probe counts every peak from before its first forward: buffers a forward keeps
    (thread pools, kernel caches) are a fresh process's first batches' too."""
    from pipeline.core.device import measure_peak_bytes, resident_bytes

    cpu, kept = torch.device("cpu"), []
    since = resident_bytes()
    measure_peak_bytes(lambda: kept.append(np.ones(64 * 2**20, dtype=np.uint8)), cpu)  # a one-off buffer
    counted_from_before = measure_peak_bytes(lambda: None, cpu, since)
    counted_from_the_call = measure_peak_bytes(lambda: None, cpu)
    # not quite 64 MiB: what the process held before may have shrunk since (garbage collected, trimmed)
    assert counted_from_before > 56 * 2**20 > 8 * 2**20 > counted_from_the_call
    assert kept[0].sum() == 64 * 2**20


def test_the_allocator_setting_is_left_alone_on_other_devices():
    assert keep_freed_host_memory(torch.device("cuda")) is False


def test_gpus_before_ampere_get_float16_not_emulated_bfloat16():
    from pipeline.core.device import gpu_auto_dtype

    assert gpu_auto_dtype((7, 5)) == "float16"  # T4
    assert gpu_auto_dtype((8, 0)) == "bfloat16"  # A100
    assert gpu_auto_dtype((9, 0)) == "bfloat16"  # H100, H200
