"""The memory formula, the fitted memory model, the probe and the plan cache."""

import dataclasses
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from pipeline.core.memory import (BucketPlan, MemoryModel, MemoryPlan, PeakMeasurement, batch_rows, corrected_rows,
                                  fit_memory_model, largest_accepted, memory_bucket_lengths, plan_buckets)
from pipeline.core.cache import write_keyed
from pipeline.core.probe import load_cached_plan
from pipeline.core.units import parse_bytes

GIB, MIB = 2**30, 2**20


def test_the_worked_example_from_practice():
    # 24 GiB available, 384 MiB worst-case activation per sample, safety 1.5 → 42 rows
    assert batch_rows(24 * GIB, 384 * MIB, 1.5) == 42
    assert batch_rows(24 * GIB, 384 * MIB, 1.0) == 64
    assert batch_rows(100, 384 * MIB, 1.5) == 0


def test_safety_must_stay_in_range():
    with pytest.raises(ValueError, match="safety"):
        batch_rows(GIB, MIB, 0.9)
    with pytest.raises(ValueError, match="safety"):
        batch_rows(GIB, MIB, 4.5)


@pytest.mark.parametrize("text, expected", [("4GiB", 4 * GIB), ("512MiB", 512 * MIB), ("2GB", 2 * 10**9),
                                            ("1.5 GiB", int(1.5 * GIB)), ("1000", 1000), (77, 77)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_rejects_nonsense():
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


def test_fit_recovers_known_coefficients_from_noisy_measurements():
    truth = MemoryModel(base_bytes=3 * MIB, linear_bytes=40_000, quadratic_bytes=200)
    rng = np.random.default_rng(0)
    measurements = [PeakMeasurement(r, length, truth.peak_bytes(r, length) * (1 + rng.normal(0, 0.01)))
                    for r in (2, 8, 32) for length in (64, 128, 256)]
    fitted = fit_memory_model(measurements)
    assert fitted.linear_bytes == pytest.approx(truth.linear_bytes, rel=0.1)
    assert fitted.quadratic_bytes == pytest.approx(truth.quadratic_bytes, rel=0.15)
    for rows, length in ((16, 100), (64, 256)):
        assert fitted.peak_bytes(rows, length) == pytest.approx(truth.peak_bytes(rows, length), rel=0.03)


def test_fit_never_returns_negative_coefficients():
    # purely linear memory with a little noise would give a tiny negative L² term in plain least squares
    measurements = [PeakMeasurement(r, length, 1000 * r * length + (7 if r == 8 else -7))
                    for r in (2, 8) for length in (64, 128, 256)]
    fitted = fit_memory_model(measurements)
    assert min(fitted.base_bytes, fitted.linear_bytes, fitted.quadratic_bytes) >= 0
    assert fitted.linear_bytes == pytest.approx(1000, rel=0.01)


def test_fit_refuses_flat_measurements():
    with pytest.raises(ValueError, match="does not grow"):
        fit_memory_model([PeakMeasurement(r, 64, 5000.0) for r in (1, 2, 4)])


MODEL = MemoryModel(base_bytes=MIB, linear_bytes=50_000, quadratic_bytes=100)


def test_longer_buckets_never_get_more_rows():
    rows = [MODEL.rows_within(2 * GIB, 1.5, length) for length in memory_bucket_lengths(512)]
    assert rows == sorted(rows, reverse=True) and rows[-1] > 0


def test_half_the_budget_gives_about_half_the_rows():
    for length in (64, 256, 512):
        full, half = MODEL.rows_within(8 * GIB, 1.5, length), MODEL.rows_within(4 * GIB, 1.5, length)
        assert half == pytest.approx(full / 2, abs=1)


def test_bucket_lengths_are_multiples_of_eight_up_to_max_length():
    assert memory_bucket_lengths(256) == [32, 64, 96, 128, 160, 192, 224, 256]
    assert memory_bucket_lengths(20) == [8, 16, 20]


def test_largest_accepted_is_a_binary_search():
    calls = []

    def accept(rows):
        calls.append(rows)
        return rows <= 37

    assert largest_accepted(100, accept) == 37
    assert len(calls) <= 8
    assert largest_accepted(100, lambda rows: False) == 0


def test_plan_buckets_shrinks_where_the_device_says_no():
    # the "device" needs twice what the model predicts above 128 tokens
    def measure(rows, length):
        return MODEL.peak_bytes(rows, length) * (2.0 if length > 128 else 1.0)

    buckets = plan_buckets(MODEL, GIB, 1.5, [64, 128, 256], max_batch_rows=100_000, max_batch_tokens=None,
                           measure=measure)
    by_length = {b.length: b for b in buckets}
    assert by_length[64].probed_rows == by_length[64].planned_rows  # formula was right
    assert by_length[256].probed_rows < by_length[256].planned_rows  # shrunk
    most = largest_accepted(by_length[256].planned_rows, lambda rows: measure(rows, 256) <= GIB)
    assert 0.8 * most <= by_length[256].probed_rows <= most  # near the most that fits (CORRECTION_AIM), never over
    assert by_length[256].measured_peak_bytes <= GIB


def test_a_size_near_the_budget_needs_three_rounds_and_a_failing_round_ends_the_check():
    calls = []
    peaks = iter([0.9 * GIB, 1.5 * GIB] + [0.1 * GIB] * 100)  # near the budget, then over it

    def measure(rows, length):
        calls.append(rows)
        return next(peaks)

    [bucket] = plan_buckets(MODEL, GIB, 1.5, [64], max_batch_rows=40, max_batch_tokens=None, measure=measure)
    assert calls[:2] == [40, 40] and 40 not in calls[2:]  # no third round once one is over
    # next the size 1.5 GiB at 40 rows predicts at 82% of the budget, clearly within: one round
    assert calls[2:] == [corrected_rows(40, 1.5 * GIB, MIB, GIB)] == [bucket.probed_rows] == [21]


def test_a_corrected_size_that_still_exceeds_falls_back_to_the_binary_search():
    calls = []

    def measure(rows, length):  # the device needs far more per row than the first measurement says
        calls.append(rows)
        return 1.5 * GIB if rows == 40 else (0.1 * GIB if rows <= 10 else 2 * GIB)

    [bucket] = plan_buckets(MODEL, GIB, 1.5, [64], max_batch_rows=40, max_batch_tokens=None, measure=measure)
    assert bucket.probed_rows == 10 and calls[:2] == [40, 21] and max(calls[2:]) < 21


def test_a_size_clearly_within_the_budget_passes_in_one_round_and_one_near_it_in_three():
    for first_peak, rounds in ((0.85 * GIB, 1), (0.86 * GIB, 3)):
        calls = []

        def measure(rows, length):
            calls.append(rows)
            return first_peak

        [bucket] = plan_buckets(MODEL, GIB, 1.5, [64], max_batch_rows=40, max_batch_tokens=None, measure=measure)
        assert bucket.probed_rows == 40 and calls == [40] * rounds


def test_plan_buckets_respects_token_and_row_caps():
    buckets = plan_buckets(MODEL, 8 * GIB, 1.5, [64, 256], max_batch_rows=50, max_batch_tokens=4096,
                           measure=lambda rows, length: MODEL.peak_bytes(rows, length))
    assert [(b.planned_rows, b.probed_rows) for b in buckets] == [(50, 50), (16, 16)]


def test_plan_cache_round_trip_and_key_mismatch(tmp_path):
    plan = MemoryPlan(GIB, 1.5, MODEL, [BucketPlan(64, 10, 8, 8, 1.0, 2.0)], key={"model": "x"})
    write_keyed(tmp_path / "abc.json", plan.key, dataclasses.asdict(plan))
    loaded = load_cached_plan(tmp_path / "abc.json", {"model": "x"})
    assert loaded.buckets == plan.buckets and loaded.coefficients == MODEL
    assert loaded.source.endswith("abc.json")
    assert load_cached_plan(tmp_path / "abc.json", {"model": "y"}) is None
    assert load_cached_plan(tmp_path / "missing.json", {"model": "x"}) is None
    with pytest.raises(ValueError):
        plan.rows_for(65)


def test_lengths_inside_a_bucket_keep_its_probed_token_count():
    # the bucket up to 96 tokens was probed at 42 rows × 96 = 4,032 tokens; a batch padded to 72
    # may hold as many tokens (56 rows), not only the 42 rows of the longest length
    plan = MemoryPlan(GIB, 1.5, MODEL, [BucketPlan(64, 90, 64, 64, 1.0, 2.0), BucketPlan(96, 50, 42, 42, 1.0, 2.0)])
    assert [plan.rows_for(length) for length in (96, 72, 64, 32, 8)] == [42, 56, 64, 128, 512]
    assert all(plan.rows_for(length) * length <= 42 * 96 for length in range(65, 97))
    shrunk = MemoryPlan(GIB, 1.5, MODEL, [BucketPlan(64, 90, 64, 0, 1.0, 2.0)])
    assert shrunk.rows_for(32) == 0  # not even one row fit: the packer runs rows alone, back-off handles it


@pytest.mark.slow
def test_cpu_probe_on_a_tiny_model_shrinks_under_a_tight_budget(tiny_encoder_path):
    from jobs.registry import get_job
    from pipeline.core.probe import probe_memory_plan

    job = get_job("embed")
    model = job.load(tiny_encoder_path, torch.device("cpu"), torch.float32)
    roomy = probe_memory_plan(job, model, torch.device("cpu"), 2 * GIB, 1.5, 256, 4096, None)
    budget = 16 * MIB
    tight = probe_memory_plan(job, model, torch.device("cpu"), budget, 1.5, 256, 4096, None)
    assert roomy.coefficients.linear_bytes + roomy.coefficients.quadratic_bytes > 0
    for small, large in zip(tight.buckets, roomy.buckets):
        assert small.probed_rows < large.probed_rows
        assert small.measured_peak_bytes <= budget
    rows = [b.probed_rows for b in tight.buckets]
    assert rows == sorted(rows, reverse=True)


def test_garbage_frozen_keeps_earlier_objects_out_of_collections_and_leaves_anothers_freeze_alone():
    import gc

    from pipeline.core.device import garbage_frozen

    assert gc.get_freeze_count() == 0
    with garbage_frozen(torch.device("cpu")):
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # torch's objects: a collection inside scans none of them
        cycle: list = []
        cycle.append(cycle)  # garbage made inside is still collected
        del cycle
        assert gc.collect() >= 1
    assert gc.get_freeze_count() == 0
    with garbage_frozen(torch.device("cuda")):
        assert gc.get_freeze_count() == 0
    gc.freeze()  # a caller's own freeze (a pre-forking server) is not undone
    try:
        before = gc.get_freeze_count()
        with garbage_frozen(torch.device("cpu")):
            assert gc.get_freeze_count() == before
        assert gc.get_freeze_count() == before
    finally:
        gc.unfreeze()


def test_buckets_capped_by_rows_are_covered_by_the_longest_one_run_at_full_size():
    """At a roomy budget every bucket is capped at 512 rows: running the longest at 512 rows
    covers all shorter ones (memory grows with rows and length), so only it runs at full size."""
    calls = []

    def measure(rows, length):
        calls.append((rows, length))
        return MODEL.peak_bytes(rows, length)

    lengths = memory_bucket_lengths(256)
    buckets = plan_buckets(MODEL, 64 * GIB, 1.5, lengths, max_batch_rows=512, max_batch_tokens=None, measure=measure)
    assert calls == [(512, 256)]
    assert [b.probed_rows for b in buckets] == [512] * 8
    assert [b.check for b in buckets] == ["covered by 256"] * 7 + ["measured"]


def test_memory_bound_buckets_between_the_verified_ones_are_interpolated_within_the_budget():
    """The device needs 1.3x what the small-batch fit says, plus a length-dependent error: the
    verified buckets shrink to fit, and the interpolated ones, planned from a fit through the
    full-size measurements, stay within the budget without being run."""
    def device_peak(rows, length):
        return 1.3 * MODEL.peak_bytes(rows, length) * (1 + 0.1 * length / 256)

    measured_lengths = []

    def measure(rows, length):
        measured_lengths.append(length)
        return device_peak(rows, length)

    lengths = memory_bucket_lengths(256)
    small = [PeakMeasurement(r, n, MODEL.peak_bytes(r, n)) for r in (2, 8) for n in (64, 128, 256)]
    buckets = plan_buckets(MODEL, GIB, 1.0, lengths, max_batch_rows=100_000, max_batch_tokens=None,
                           measure=measure, fit_measurements=small)
    assert set(measured_lengths) == {256, 128, 64, 32}
    by_check = {b.length: b.check for b in buckets}
    assert [n for n, check in by_check.items() if check == "measured"] == [32, 64, 128, 256]
    assert all(by_check[n] == "interpolated" for n in (96, 160, 192, 224))
    for bucket in buckets:
        assert device_peak(bucket.probed_rows, bucket.length) <= GIB
        # and not timid: verified ones near CORRECTION_AIM, interpolated ones near INTERPOLATION_AIM
        assert device_peak(bucket.probed_rows, bucket.length) >= 0.75 * GIB, bucket
    rows = [b.probed_rows for b in buckets]
    assert rows == sorted(rows, reverse=True)


def test_a_plan_for_a_larger_budget_is_scaled_down_and_one_for_a_little_less_is_reused():
    from pipeline.core.memory import plan_for_budget

    model = MemoryModel(base_bytes=1 * GIB, linear_bytes=MIB, quadratic_bytes=0.0)
    # length 8: --max-batch-tokens capped it at 100 rows (memory allowed 400); 64 and 256: memory set them
    plan = MemoryPlan(9 * GIB, 1.5, model, [BucketPlan(8, 400, 100, 100, 1.0, 2.0), BucketPlan(64, 80, 80, 60, 1.0, 2.0),
                                            BucketPlan(256, 20, 20, 16, 1, 2)], source="cache.json")
    assert plan_for_budget(plan, 9 * GIB) is plan
    assert plan_for_budget(plan, 10 * GIB) is plan  # a GiB more free: the smaller plan still fits
    assert plan_for_budget(plan, 13 * GIB) is None  # much more: probe for it
    half = plan_for_budget(plan, 5 * GIB)  # (5 - 1) / (9 - 1) of the rows above the base
    assert [b.probed_rows for b in half.buckets] == [100, 30, 8] and half.available_bytes == 5 * GIB
    assert half.source == "cache.json, made for 9.00 GiB, scaled to 5.00 GiB"
    assert plan.buckets[1].probed_rows == 60  # the cached plan is left as it was
    # the capped bucket keeps its rows only while the formula allows them: (2 - 1) GiB / (8 MiB × 1.5) = 85
    assert [b.probed_rows for b in plan_for_budget(plan, 2 * GIB).buckets] == [85, 7, 2]
    assert plan_for_budget(plan, GIB) is None  # the base alone fills it


@pytest.mark.slow
def test_free_memory_moving_by_a_gib_reuses_the_cached_plan(tmp_path, tiny_encoder_path):
    """The plan's key is what determines it, not the budget of the moment: a second budget
    reuses (or scales) the first plan instead of probing and caching another."""
    from pipeline.runtime.model import load_model
    from pipeline.core.probe import memory_plan_for
    from pipeline.offline.config import RunConfig

    def plan_with(budget: int):
        config = RunConfig.of(input=(), output="", model=tiny_encoder_path, device="cpu", dtype="float32",
                              max_length=64, memory_budget=budget, plan_cache=str(tmp_path), max_batch_rows=4096,
                              max_batch_tokens=2**20)
        loaded = load_model(config.model, config.batch, cache=config.cache)
        return memory_plan_for(config.batch, config.cache, "embed", 64, loaded.job, loaded.model, tiny_encoder_path,
                               loaded.choice.device)

    first = plan_with(64 * MIB)
    assert first.source.startswith("probed") and len(list(tmp_path.glob("*.json"))) == 1
    more = plan_with(65 * MIB)
    assert more.source.startswith("from cache") and more.buckets == first.buckets
    less = plan_with(48 * MIB)
    assert less.source.startswith("from cache") and "made for 64 MiB, scaled to 48 MiB" in less.source
    assert all(b.probed_rows <= a.probed_rows for a, b in zip(first.buckets, less.buckets))
    assert len(list(tmp_path.glob("*.json"))) == 1  # one plan cached, not one per budget


@pytest.mark.slow
def test_free_memory_falling_by_a_gib_between_two_runs_leaves_their_outputs_identical(tmp_path, sample_table,
                                                                                      tiny_encoder_path):
    """A plan scaled down from a larger budget keeps the rows --max-batch-tokens set where memory allowed more:
    the second run packs the same batches and writes the same bits (it lowered them to 58 of 64 rows, and two
    identical runs of the feeder's test differed in their last bits when the suite's load took a GiB)."""
    from tests.conftest import run_to_table

    texts = sample_table["text"].to_pylist()[:300]
    texts[40] = " ".join(texts[41:60])  # longer than max_length: its segments run too
    table = sample_table.slice(0, 300).set_column(1, "text", pa.array(texts, pa.string()))
    settings = dict(model=tiny_encoder_path, max_length=32, window_rows=64, long_text="split",
                    plan_cache=str(tmp_path / "plans"))
    first, first_summary = run_to_table(tmp_path, "first", table, [100, 130, 70], memory_budget=11 * GIB, **settings)
    second, second_summary = run_to_table(tmp_path, "second", table, [100, 130, 70], memory_budget=10 * GIB,
                                          **settings)
    assert "made for 11.00 GiB, scaled to 10.00 GiB" in second_summary["batch_plan"]
    assert second_summary["batch_plan"].split("; ")[1:] == first_summary["batch_plan"].split("; ")[1:]  # rows
    assert second_summary["batches"] == first_summary["batches"]
    assert second.equals(first)


# ── large CPU checks through the first blocks ─────────────────────────────────────────


def test_only_large_uncompiled_cpu_checks_run_through_the_first_blocks():
    from pipeline.core.probe import check_through_first_blocks

    threshold = 32 * MIB
    large = dict(rows=393, length=128, hidden_size=384, element_bytes=4, mmap_threshold_bytes=threshold)  # 77 MiB
    assert check_through_first_blocks("cpu", False, 6, **large)
    assert not check_through_first_blocks("cuda", False, 6, **large)  # a GPU runs the checks in moments
    assert not check_through_first_blocks("cpu", True, 6, **large)  # a compiled graph is the whole model
    assert not check_through_first_blocks("cpu", False, 1, **large)  # nothing to leave out
    small = dict(large, rows=64)  # 12.6 MiB hidden states come from the fragmenting heap: run whole
    assert not check_through_first_blocks("cpu", False, 6, **small)


def test_a_shortened_check_counts_the_hidden_state_the_later_blocks_hold():
    from pipeline.core.probe import shortened_check_bytes

    assert shortened_check_bytes(740 * MIB, rows=393, length=128, hidden_size=384, element_bytes=4) == \
        740 * MIB + 393 * 128 * 384 * 4
    assert shortened_check_bytes(math.inf, rows=393, length=128, hidden_size=384, element_bytes=2) == math.inf


def test_repeated_blocks_finds_the_encoder_layers_and_first_blocks_restores_them(minilm_path):
    from jobs.registry import get_job
    from pipeline.core.probe import KEPT_BLOCKS, first_blocks, repeated_blocks

    model = get_job("embed").load(minilm_path, torch.device("cpu"), torch.float32)
    stack = repeated_blocks(model)
    parent, attribute, blocks = stack
    assert len(blocks) == model.config.num_hidden_layers == 6 and getattr(parent, attribute) is blocks
    with pytest.raises(RuntimeError), first_blocks(stack):
        assert len(getattr(parent, attribute)) == KEPT_BLOCKS
        raise RuntimeError("a check that fails")
    assert getattr(parent, attribute) is blocks  # restored, even after an error


@pytest.mark.slow
def test_a_large_check_through_the_first_blocks_peaks_as_high_as_the_whole_model(minilm_path):
    """The assumption the probe's speed rests on, measured on the real MiniLM-L6: at a size
    whose hidden states glibc maps on their own, the first block plus one hidden state peaks
    within 2% of all six blocks. Measured in a fresh process, as a run's probe is: the heap a
    long test session leaves behind moved either figure by up to a fifth."""
    import subprocess
    import sys

    script = f"""
import torch
from jobs.registry import get_job
from pipeline.core.device import keep_freed_host_memory
from pipeline.core.probe import first_blocks, forward_peak_bytes, repeated_blocks, shortened_check_bytes
job, cpu = get_job("embed"), torch.device("cpu")
model = job.load({minilm_path!r}, cpu, torch.float32)
keep_freed_host_memory(cpu)
forward_peak_bytes(job, model, cpu, 1, 8)
rows, length = 96, 256  # 36 MiB hidden states
with first_blocks(repeated_blocks(model)):
    forward_peak_bytes(job, model, cpu, rows, length)  # the first forward of a shape pays one-off buffers
    shortened = shortened_check_bytes(forward_peak_bytes(job, model, cpu, rows, length), rows, length,
                                      model.config.hidden_size, 4)
forward_peak_bytes(job, model, cpu, rows, length)  # and so does the whole model's
print(shortened, forward_peak_bytes(job, model, cpu, rows, length))
"""
    measured = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                              cwd=Path(__file__).resolve().parents[2])
    assert measured.returncode == 0, measured.stderr[-2000:]
    shortened, whole = map(float, measured.stdout.split()[-2:])
    assert abs(shortened - whole) <= 0.02 * whole, (shortened / MIB, whole / MIB)
