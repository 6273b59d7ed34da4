"""Out-of-memory back-off: halve and retry, lose nothing, compute nothing twice."""

import numpy as np
import pytest
import torch

import jobs.registry
from jobs.embed import EmbedJob
from pipeline.core.forward import forward_splitting_on_oom
from tests.offline.test_run import run_to_table


class OutOfMemoryAbove(EmbedJob):
    """The embed job on a device that runs out of memory above `max_rows` rows, and for any
    batch longer than `max_padded_length` even alone. Counts the rows it computed."""

    name = "embed-oom"

    def __init__(self, max_rows: int, max_padded_length: int = 10_000, max_tokens: int | None = None):
        self.max_rows, self.max_padded_length, self.max_tokens = max_rows, max_padded_length, max_tokens
        self.rows_computed = 0
        self.failed_lengths: list[int] = []

    def forward(self, model, input_ids, attention_mask, padded=True, packing=None):
        rows, length = input_ids.shape
        if rows > self.max_rows or length > self.max_padded_length or (
                self.max_tokens is not None and rows * length > self.max_tokens):
            self.failed_lengths.append(length)
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {rows * length} units")
        self.rows_computed += rows
        return super().forward(model, input_ids, attention_mask, padded, packing)


@pytest.fixture
def oom_job(monkeypatch):
    def install(**limits):
        job = OutOfMemoryAbove(**limits)
        monkeypatch.setitem(jobs.registry.JOBS, job.name, job)
        return job

    return install


def test_split_forward_keeps_row_order_and_computes_each_row_once():
    seen = []

    def forward(ids, mask):
        if ids.shape[0] > 3:
            raise torch.OutOfMemoryError("out of memory")
        seen.extend(ids[:, 0].tolist())
        return {"double": ids.float() * 2}

    ids = torch.arange(10).reshape(10, 1)
    result = forward_splitting_on_oom(forward, ids, torch.ones_like(ids), torch.device("cpu"))
    assert result.outputs["double"][:, 0].tolist() == [2.0 * i for i in range(10)]
    assert sorted(seen) == list(range(10)) and len(seen) == 10
    assert not result.failed.any()
    assert result.splits == 3  # 10 → 5+5 → (2+3)+(2+3)
    assert result.largest_ok_rows == 3


def test_other_errors_are_not_swallowed():
    def forward(ids, mask):
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError, match="a bug"):
        forward_splitting_on_oom(forward, torch.zeros(4, 2), torch.zeros(4, 2), torch.device("cpu"))


@pytest.mark.slow
def test_outputs_equal_an_unconstrained_run_and_splits_are_reported(tmp_path, oom_job, baseline, rows_with_bad_ones,
                                                                    tiny_encoder_path):
    job = oom_job(max_rows=5)
    # no memory plan: the batches are sized by the row limit alone, so they do run out of memory
    output, summary = run_to_table(tmp_path, "oom", rows_with_bad_ones, [200], model=tiny_encoder_path,
                                   max_length=128, job=job.name, max_batch_rows=64, probe=False)
    expected, _ = baseline
    assert output["id"].to_pylist() == expected["id"].to_pylist()
    assert output["error"].to_pylist() == expected["error"].to_pylist()
    np.testing.assert_allclose(np.array([v for v in output["embedding"].to_pylist() if v is not None]),
                               np.array([v for v in expected["embedding"].to_pylist() if v is not None]), atol=2e-5)
    assert job.rows_computed == 196  # every valid row exactly once
    assert summary["oom_splits"] > 0
    assert summary["lowered_batch_rows"] and max(summary["lowered_batch_rows"].values()) <= 5


def test_a_lowered_limit_caps_the_padded_tokens_of_every_length():
    from pipeline.core.buckets import BatchLimits

    limits = BatchLimits(None)
    limits.lower(256, 4)  # 1,024 padded tokens ran at length 256
    assert [limits.rows_for(length) for length in (64, 128, 256, 512, 2048)] == [16, 8, 4, 2, 1]
    limits.lower(64, 8)  # a later split at 64 lowers the shorter lengths further
    assert [limits.rows_for(length) for length in (32, 64, 128, 256)] == [16, 8, 4, 2]


def test_after_one_out_of_memory_split_shorter_lengths_do_not_fail_again(tmp_path, oom_job, tiny_encoder_path):
    """A device whose memory holds 1,024 padded tokens, batches sized for 16,384, 40 rows at each
    of four lengths: the first (longest) batch is split, and every shorter length is then packed
    within the tokens that ran (before, each new length ran out of memory again)."""
    import pyarrow as pa

    words = [n for n in (100, 70, 45, 20) for _ in range(40)]
    table = pa.table({"id": list(range(len(words))), "text": [" ".join(["hello"] * n) for n in words]})
    job = oom_job(max_rows=10_000, max_tokens=1024)
    output, summary = run_to_table(tmp_path, "cascade", table, [len(words)], model=tiny_encoder_path,
                                   max_length=128, job=job.name, max_batch_tokens=16384, max_batch_rows=4096,
                                   probe=False, dedupe=False)  # 40 identical texts a length: run each of them
    assert job.rows_computed == len(words)
    assert len(set(job.failed_lengths)) == 1, job.failed_lengths  # only the first length ever failed
    assert output["id"].to_pylist() == table["id"].to_pylist()


@pytest.mark.slow
def test_a_row_that_cannot_run_alone_gets_an_error_and_the_run_goes_on(tmp_path, oom_job, rows_with_bad_ones,
                                                                       tiny_encoder_path):
    job = oom_job(max_rows=1000, max_padded_length=64)
    output, summary = run_to_table(tmp_path, "too-long", rows_with_bad_ones, [120, 80], model=tiny_encoder_path,
                                   max_length=128, job=job.name, probe=False)
    errors = output["error"].to_pylist()
    too_long = [e for e in errors if e and e.startswith("out of memory even alone")]
    assert too_long and all(v is None for v, e in zip(output["embedding"].to_pylist(), errors) if e)
    assert sum(v is not None for v in output["embedding"].to_pylist()) == 196 - len(too_long)
    assert summary["error_rows"] == 4 + len(too_long) and summary["rows"] == 200
    assert output["id"].to_pylist() == rows_with_bad_ones["id"].to_pylist()


@pytest.mark.slow
def test_the_probe_shrinks_batches_that_run_out_of_memory_on_the_device(oom_job, tiny_encoder_path):
    """A device that fails above the fitting grid's larger batch: the probe's search lands on it
    for every bucket it runs, and the buckets between them get no more rows than the shorter
    verified one."""
    from pipeline.core.memory import fit_rows
    from pipeline.core.probe import probe_memory_plan

    _, grid_rows = fit_rows("cpu", 32, 128, 32, 4, None)  # the 32-wide model's grid at 32–128 tokens
    job = oom_job(max_rows=5)
    model = job.load(tiny_encoder_path, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="even the fitting batches"):
        probe_memory_plan(job, model, torch.device("cpu"), 2**30, 1.5, 128, 512, None)
    job.max_rows = grid_rows  # the fitting grid fits; bigger batches do not
    plan = probe_memory_plan(job, model, torch.device("cpu"), 2**30, 1.5, 128, 512, None)
    measured = [b for b in plan.buckets if b.check == "measured"]
    assert [b.length for b in measured] == [16, 32, 64, 128] and [b.probed_rows for b in measured] == [grid_rows] * 4
    assert [b.probed_rows for b in plan.buckets] == [grid_rows] * len(plan.buckets)
    assert plan.buckets[0].planned_rows > grid_rows  # the formula asked for more


class NonFiniteForSomeRows(EmbedJob):
    """The embed job on a model that overflows (nan) for rows whose second token id is odd."""

    name = "embed-nan"

    def forward(self, model, input_ids, attention_mask, padded=True, packing=None):
        outputs = super().forward(model, input_ids, attention_mask, padded, packing)
        overflowing = input_ids[:, 1] % 2 == 1
        outputs["embedding"][overflowing] = float("nan")
        return outputs


@pytest.mark.slow
def test_a_non_finite_output_becomes_the_rows_error_not_a_result(tmp_path, monkeypatch, baseline, rows_with_bad_ones,
                                                                 tiny_encoder_path):
    monkeypatch.setitem(jobs.registry.JOBS, "embed-nan", NonFiniteForSomeRows())
    output, summary = run_to_table(tmp_path, "nan", rows_with_bad_ones, [120, 80], model=tiny_encoder_path,
                                   max_length=128, job="embed-nan")
    expected, _ = baseline
    errors, vectors = output["error"].to_pylist(), output["embedding"].to_pylist()
    broken = [i for i, e in enumerate(errors) if e and e.startswith("the model gave a non-finite output")]
    assert broken and summary["error_rows"] == 4 + len(broken) and summary["rows"] == 200
    assert all(vectors[i] is None for i in broken)
    assert not any(np.isnan(v).any() for v in vectors if v is not None)
    kept = [i for i, v in enumerate(vectors) if v is not None]
    np.testing.assert_allclose(np.array([vectors[i] for i in kept]),
                               np.array([expected["embedding"][i].as_py() for i in kept]), atol=2e-5)
    assert "rerun with --dtype float32" in errors[broken[0]]


def test_after_an_out_of_memory_error_its_tensors_are_freed_without_a_full_collection():
    """The failed attempt's activations are held by its traceback's frames, here inside a cycle (a frame
    that caught the error and re-raised it), which refcounting alone never frees: clearing the frames
    frees them with the cyclic collector off."""
    import gc
    import weakref

    import torch

    from pipeline.core.device import release_cached_memory

    held = []

    def forward():
        activations = torch.ones(1024, 1024)
        held.append(weakref.ref(activations))
        try:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except RuntimeError as error:
            caught = error  # noqa: F841 (the frame now holds its own error: a cycle)
            raise

    gc.disable()
    try:
        try:
            forward()
        except RuntimeError as error:
            release_cached_memory(torch.device("cpu"), error)
            assert held[0]() is None, "the activations outlived the release"
    finally:
        gc.enable()


def test_rows_without_outputs_get_the_one_wording_of_the_run_and_the_batcher():
    from pipeline.core.forward import failed_rows

    outputs = {"embedding": np.array([[0.1, 0.2], [np.nan, 0.3], [0.0, 0.0], [np.inf, 1.0]], dtype=np.float32)}
    out_of_memory = np.array([False, False, False, True])
    (non_finite, first), (alone, second) = failed_rows(outputs, out_of_memory, "float16", 128)
    assert non_finite.tolist() == [False, True, False, False] and alone.tolist() == out_of_memory.tolist()
    assert first == "the model gave a non-finite output (nan or inf) in float16; rerun with --dtype float32"
    assert second == "out of memory even alone at padded length 128; lower --max-length or use a larger device"
    assert failed_rows({}, np.zeros(2, bool), "float32", 64) == []  # nothing failed: no error
    [(_, online)] = failed_rows(outputs, np.zeros(4, bool), "float16", 128, non_finite_fix="use --dtype float32")
    assert online.endswith("in float16; use --dtype float32")
