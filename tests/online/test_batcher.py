"""The online batcher with the real MiniLM on the CPU, real asyncio, real threads.

No sleep stands in for the model: where a test needs the device busy, it runs a real batch
of long texts. Asyncio tests are plain functions around asyncio.run.
"""

import asyncio
import time

import numpy as np
import pyarrow as pa
import pytest
import torch
from click.testing import CliRunner

import jobs.registry
from pipeline.online.rules import BatcherClosed, QueueFull, RequestTooLarge
from pipeline.online.batcher import DynamicBatcher
from pipeline.cli import cli
from pipeline.online.config import BatcherConfig
from pipeline.core.settings import BatchSettings, ModelSettings
from pipeline.runtime import Runtime
from pipeline.runtime.model import load_model
from pipeline.core.buckets import BatchLimits
from tests.conftest import read_outputs, write_shards
from tests.core.test_out_of_memory_backoff import OutOfMemoryAbove

LONG_WINDOW_MS = 30_000  # a window no test waits for: a batch must come from another trigger
JITTER_S = 0.5  # how late a busy 2-core machine may wake a task: CI and development machines are shared

@pytest.fixture(scope="module")
def minilm(minilm_path):
    return load_model(ModelSettings(model=minilm_path, dtype="float32"), BatchSettings())


@pytest.fixture(scope="module")
def minilm_128(minilm_path):
    """MiniLM at 128 tokens a row: the long texts' batches take a while, but not too long."""
    return load_model(ModelSettings(model=minilm_path, dtype="float32", max_length=128), BatchSettings())


@pytest.fixture(scope="module")
def long_texts(sample_table) -> list[str]:
    """Texts that fill 128 tokens: a batch of them keeps the CPU busy for a while."""
    text = " ".join(sample_table["text"].to_pylist()[:8])
    return [f"{number} {text}" for number in range(32)]


def batcher_for(loaded, limits=None, **settings) -> DynamicBatcher:
    settings.setdefault("max_batch_tokens", 10**6)  # no token budget unless a test sets one
    settings.setdefault("request_timeout_ms", 2 * LONG_WINDOW_MS)  # the first forwards on a busy CPU are slow
    runtime = Runtime(loaded, BatchSettings(), "", None, limits or BatchLimits(None), {})  # no memory plan
    return DynamicBatcher(runtime, BatcherConfig.of(**settings))


@pytest.mark.slow
def test_each_caller_gets_the_row_lengthwise_run_writes_for_its_text(tmp_path, minilm_path, minilm, sample_table):
    texts = sample_table["text"].to_pylist()[:48]
    texts[5], texts[11] = "   ", " ".join(texts[:30])  # an error row and a truncated one
    table = pa.table({"id": [f"row-{i}" for i in range(len(texts))], "text": texts})
    write_shards(tmp_path / "in", table, [len(texts)])
    result = CliRunner().invoke(cli, ["run", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                                      "--model", minilm_path, "--dtype", "float32", "--tokenize-workers", "0",
                                      "--no-probe", "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    offline = {row["id"]: row for row in read_outputs(tmp_path / "out").to_pylist()}

    async def serve():
        async with batcher_for(minilm, max_batch_size=8, batch_timeout_ms=5) as batcher:
            answers = await asyncio.gather(*[batcher.submit(text, request_id=f"row-{i}")
                                             for i, text in enumerate(texts)])
            return answers, batcher.stats

    answers, stats = asyncio.run(serve())
    assert [a["id"] for a in answers] == [f"row-{i}" for i in range(len(texts))]
    assert stats.batches > 1 and max(stats.batch_sizes) <= 8  # really batched, with other rows each time
    for answer in answers:
        expected = offline[answer["id"]]
        assert answer.keys() == expected.keys()
        assert (answer["truncated"], answer["error"]) == (expected["truncated"], expected["error"])
        if expected["embedding"] is None:
            assert answer["embedding"] is None
        else:
            np.testing.assert_allclose(answer["embedding"], expected["embedding"], atol=2e-5)
    assert offline["row-11"]["truncated"] and offline["row-5"]["error"] == "text is empty or whitespace only"


def test_classify_answers_are_the_offline_jobs_labels_and_scores(tmp_path, tiny_classifier_path, sample_table):
    from tests.conftest import run_to_table

    texts = sample_table["text"].to_pylist()[:12]
    offline, _ = run_to_table(tmp_path, "cls", pa.table({"id": list(range(12)), "text": texts}), [12],
                              job="classify", model=tiny_classifier_path, probe=False)
    loaded = load_model(ModelSettings(job="classify", model=tiny_classifier_path, dtype="float32"), BatchSettings())

    async def serve():
        async with batcher_for(loaded, max_batch_size=5, batch_timeout_ms=5) as batcher:
            return await asyncio.gather(*[batcher.submit(text, request_id=i) for i, text in enumerate(texts)])

    for answer, expected in zip(asyncio.run(serve()), offline.to_pylist()):
        assert (answer["id"], answer["label"]) == (expected["id"], expected["label"])
        np.testing.assert_allclose(answer["scores"], expected["scores"], atol=1e-5)


def test_a_lone_request_returns_within_the_window_plus_one_forward(minilm):
    window_s = 0.2

    async def serve():
        async with batcher_for(minilm, max_batch_size=16, batch_timeout_ms=window_s * 1000) as batcher:
            await batcher.submit("warm the model up")
            started = time.perf_counter()
            answer = await batcher.submit("a lonely comment")
            return time.perf_counter() - started, answer, batcher.stats

    latency, answer, stats = asyncio.run(serve())
    assert answer["error"] is None and len(answer["embedding"]) == 384
    assert list(stats.batch_sizes) == [1, 1] and stats.triggers == {"timeout": 2}
    assert window_s <= latency < window_s + stats.compute_s[-1] + JITTER_S


def test_a_burst_of_max_batch_size_runs_as_one_batch_without_waiting_for_the_window(minilm):
    async def serve():
        async with batcher_for(minilm, max_batch_size=8, batch_timeout_ms=LONG_WINDOW_MS) as batcher:
            started = time.perf_counter()
            answers = await asyncio.gather(*[batcher.submit(f"comment {i}", request_id=i) for i in range(8)])
            return time.perf_counter() - started, answers, batcher.stats

    seconds, answers, stats = asyncio.run(serve())
    assert seconds < 5 and [a["id"] for a in answers] == list(range(8))
    assert list(stats.batch_sizes) == [8] and stats.triggers == {"size": 1}


def test_max_queue_plus_k_submits_get_exactly_k_queue_full_at_once(minilm):
    async def serve():
        async with batcher_for(minilm, max_batch_size=32, batch_timeout_ms=LONG_WINDOW_MS, max_queue=5) as batcher:
            tasks = [asyncio.create_task(batcher.submit(f"comment {i}")) for i in range(8)]
            await asyncio.sleep(0)  # one pass of the loop: each submit ran up to its first wait
            refused = [task for task in tasks if task.done()]
            errors = [task.exception() for task in refused]
            depth = batcher.stats.queue_depth
        answered = [task.result() for task in tasks if task not in refused]  # close computed the queued ones
        return errors, depth, answered, batcher.stats

    errors, depth, answered, stats = asyncio.run(serve())
    assert len(errors) == 3 and all(isinstance(error, QueueFull) for error in errors)
    assert errors[0].bound == "requests" and errors[0].retry_after_s > 0
    assert "5 requests wait (max_queue 5); retry in about" in str(errors[0])
    assert depth == 5 and len(answered) == 5 and all(a["error"] is None for a in answered)
    assert (stats.rejected_queue_full, stats.rows_computed) == (3, 5)


def test_the_queue_is_bounded_in_padded_tokens_too(minilm_128, long_texts):
    async def serve():
        async with batcher_for(minilm_128, batch_timeout_ms=LONG_WINDOW_MS, max_queue_tokens=300) as batcher:
            first = asyncio.create_task(batcher.submit(long_texts[0]))
            second = asyncio.create_task(batcher.submit(long_texts[1]))
            third = asyncio.create_task(batcher.submit(long_texts[2]))
            too_many = r"256 padded tokens wait, this request adds 128 \(max_queue_tokens 300\)"
            with pytest.raises(QueueFull, match=too_many):
                await third
        return first.result(), second.result()  # leaving the block computed the queued two

    assert [a["error"] for a in asyncio.run(serve())] == [None, None]


async def fill_the_device(batcher, long_texts):
    """A real batch of 32 × 128 tokens; returns once it is on the device."""
    busy = asyncio.gather(*[batcher.submit(text) for text in long_texts])
    while not (batcher.stats.max_queue_depth == len(long_texts) and batcher.stats.queue_depth == 0):
        await asyncio.sleep(0.005)
    return busy


@pytest.fixture(scope="module")
def busy_s(minilm_128, long_texts) -> float:
    """How long the 32 long texts keep this machine's device busy (the second of two runs), so
    the deadline tests scale their window and deadlines to it instead of assuming a speed."""

    async def serve():
        async with batcher_for(minilm_128, max_batch_size=32, batch_timeout_ms=LONG_WINDOW_MS) as batcher:
            for _ in range(2):
                await asyncio.gather(*[batcher.submit(text) for text in long_texts])
            return batcher.stats.compute_s[-1]

    return asyncio.run(serve())


def test_an_expired_request_is_never_computed_and_its_deadline_fires_during_a_forward(minilm_128, long_texts,
                                                                                      busy_s):
    """A batch of 32 long texts keeps the device busy; a second request waits as the next batch
    (formed after the window, an eighth of that forward); a third, whose deadline is a quarter of
    the forward, waits in the queue behind them and expires while the big batch still runs."""
    window_s, deadline_s = busy_s / 8, busy_s / 4

    async def serve():
        async with batcher_for(minilm_128, max_batch_size=32, batch_timeout_ms=window_s * 1000) as batcher:
            busy = await fill_the_device(batcher, long_texts)
            prepared = asyncio.create_task(batcher.submit("formed while the big batch runs"))
            while batcher.stats.queue_depth or batcher.stats.submitted < 33:
                await asyncio.sleep(0.005)
            started = time.perf_counter()
            with pytest.raises(TimeoutError, match="expired in the queue, so it was not computed"):
                await batcher.submit("gives up soon", timeout_s=deadline_s)
            timed_out = time.perf_counter() - started
            still_busy = not busy.done()
            await busy
            await prepared
            return timed_out, still_busy, batcher.stats

    timed_out, still_busy, stats = asyncio.run(serve())
    assert still_busy, "the big batch should still run when the deadline fires"
    assert deadline_s <= timed_out < deadline_s + min(JITTER_S, busy_s / 2)  # on time, not after the forward
    assert stats.timed_out_in_queue == 1 and stats.rows_computed == 33 and list(stats.batch_sizes) == [32, 1]


def test_a_request_that_expires_in_the_prepared_batch_is_dropped_before_compute(minilm_128, long_texts, busy_s):
    window_s, deadline_s = busy_s / 8, busy_s / 4

    async def serve():
        async with batcher_for(minilm_128, max_batch_size=32, batch_timeout_ms=window_s * 1000) as batcher:
            busy = await fill_the_device(batcher, long_texts)
            with pytest.raises(TimeoutError, match="while its batch was prepared or ran"):
                await batcher.submit("gives up while prepared", timeout_s=deadline_s)
            still_busy = not busy.done()
            await busy
            return still_busy, batcher.stats

    still_busy, stats = asyncio.run(serve())
    assert still_busy and stats.timed_out_in_batch == 1
    assert stats.rows_computed == 32 and list(stats.batch_sizes) == [32]  # the prepared batch had no one left


def test_cancelling_the_caller_takes_its_request_out_of_the_queue(minilm):
    async def serve():
        async with batcher_for(minilm, batch_timeout_ms=LONG_WINDOW_MS) \
                as batcher:
            waiting = asyncio.create_task(batcher.submit("never mind"))
            while batcher.stats.queued_tokens == 0:  # tokenized and queued
                await asyncio.sleep(0.001)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            depth = (batcher.stats.queue_depth, batcher.stats.queued_tokens)
        return depth, batcher.stats

    depth, stats = asyncio.run(serve())
    assert depth == (0, 0) and stats.cancelled == 1 and stats.rows_computed == 0 and stats.batches == 0


def test_close_answers_every_queued_request_or_fails_it(minilm):
    async def serve(drain: bool):
        batcher = batcher_for(minilm, batch_timeout_ms=LONG_WINDOW_MS)
        tasks = [asyncio.create_task(batcher.submit(f"comment {i}")) for i in range(5)]
        while batcher.stats.queued_tokens == 0 or batcher.stats.queue_depth < 5:
            await asyncio.sleep(0.001)
        started = time.perf_counter()
        await batcher.close(drain=drain)
        closed_in = time.perf_counter() - started
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        with pytest.raises(BatcherClosed):
            await batcher.submit("too late")
        return closed_in, outcomes, batcher.stats

    closed_in, outcomes, stats = asyncio.run(serve(drain=True))
    assert closed_in < 5 and all(o["error"] is None for o in outcomes) and stats.rows_computed == 5
    assert set(stats.triggers) == {"close"}  # drained at once, not by the 30 s window
    _, outcomes, stats = asyncio.run(serve(drain=False))
    assert all(isinstance(o, BatcherClosed) for o in outcomes) and stats.rows_computed == 0


def test_leaving_the_block_on_an_error_fails_the_queued_requests_none_hang(minilm):
    async def serve():
        tasks = []
        with pytest.raises(KeyError):
            async with batcher_for(minilm, batch_timeout_ms=LONG_WINDOW_MS) as batcher:
                tasks = [asyncio.create_task(batcher.submit(f"comment {i}")) for i in range(3)]
                await asyncio.sleep(0.05)
                raise KeyError("the service broke")
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=5)

    assert all(isinstance(outcome, BatcherClosed) for outcome in asyncio.run(serve()))


def test_bad_timeouts_and_oversized_requests_are_refused_at_once(minilm, long_texts):
    with pytest.raises(ValueError, match="request timeout of 20 ms is not more than the batch timeout of 20 ms"):
        batcher_for(minilm, batch_timeout_ms=20, request_timeout_ms=20)

    async def serve():
        async with batcher_for(minilm, batch_timeout_ms=20, max_batch_tokens=64) as batcher:
            with pytest.raises(ValueError, match="request timeout of 10 ms is not more than"):
                await batcher.submit("hello", timeout_s=0.01)
            with pytest.raises(RequestTooLarge, match="more than max_batch_tokens 64 on its own"):
                await batcher.submit(long_texts[0])
            return await batcher.submit("short enough"), batcher.stats

    answer, stats = asyncio.run(serve())
    assert answer["error"] is None and stats.rejected_too_large == 1 and stats.rows_computed == 1


def test_out_of_memory_splits_the_batch_and_every_caller_gets_its_own_answer(monkeypatch, minilm_path, minilm):
    job = OutOfMemoryAbove(max_rows=2)
    monkeypatch.setitem(jobs.registry.JOBS, job.name, job)
    failing = load_model(ModelSettings(job=job.name, model=minilm_path, dtype="float32"), BatchSettings())
    limits = BatchLimits(None)
    texts = [f"comment number {i} about nothing" for i in range(8)]

    async def serve(loaded, limits):
        async with batcher_for(loaded, limits, max_batch_size=8, batch_timeout_ms=LONG_WINDOW_MS) as batcher:
            return await asyncio.gather(*[batcher.submit(t, request_id=i) for i, t in enumerate(texts)]), batcher.stats

    answers, stats = asyncio.run(serve(failing, limits))
    reference, _ = asyncio.run(serve(minilm, None))
    assert stats.oom_splits == 3 and job.rows_computed == 8 and list(stats.batch_sizes) == [8]
    assert [a["id"] for a in answers] == list(range(8))
    np.testing.assert_allclose([a["embedding"] for a in answers], [a["embedding"] for a in reference], atol=2e-5)
    padded = max(len(t.split()) for t in texts)  # every text pads to the same length here
    assert limits.lowered and min(limits.lowered.values()) == 2 and padded > 0


def test_a_row_out_of_memory_even_alone_gets_an_error_record(monkeypatch, minilm_path, long_texts):
    job = OutOfMemoryAbove(max_rows=8, max_padded_length=32)
    monkeypatch.setitem(jobs.registry.JOBS, job.name, job)
    loaded = load_model(ModelSettings(job=job.name, model=minilm_path, dtype="float32", max_length=128), BatchSettings())

    async def serve():
        async with batcher_for(loaded, max_batch_size=2, batch_timeout_ms=LONG_WINDOW_MS) as batcher:
            return await asyncio.gather(batcher.submit(long_texts[0], request_id="long"),
                                        batcher.submit(long_texts[1], request_id="also long"))

    answers = asyncio.run(serve())
    assert [a["embedding"] for a in answers] == [None, None]
    assert all(a["error"].startswith("out of memory even alone at padded length 128") for a in answers)


def test_stats_count_batches_waits_and_compute(minilm):
    async def serve():
        async with batcher_for(minilm, max_batch_size=4, batch_timeout_ms=10) as batcher:
            await asyncio.gather(*[batcher.submit(f"comment {i}") for i in range(10)])
            return batcher.stats

    stats = asyncio.run(serve())
    assert sum(stats.batch_sizes) == 10 == stats.rows_computed == stats.answered
    assert max(stats.batch_sizes) == 4 and stats.batches == len(stats.batch_sizes) == len(stats.compute_s)
    assert len(stats.wait_s) == 10 and min(stats.wait_s) > 0 and stats.max_queue_depth >= 4
    assert stats.queue_depth == 0 and 0 < stats.mean_batch_size <= 4
    stats.reset()
    assert stats.batches == 0 and not stats.batch_sizes


def test_the_forward_runs_on_the_device_thread_not_the_event_loop(minilm):
    threads = []
    original = minilm.job.forward

    class Recording:
        name = minilm.job.name

        def __getattr__(self, attribute):
            return getattr(minilm.job, attribute)

        def forward(self, model, input_ids, attention_mask, padded=True, packing=None):
            import threading

            threads.append(threading.current_thread().name)
            return original(model, input_ids, attention_mask, padded)

    from dataclasses import replace

    loaded = replace(minilm, job=Recording())

    async def serve():
        async with batcher_for(loaded, batch_timeout_ms=5) as batcher:
            return await batcher.submit("where does this run?")

    assert asyncio.run(serve())["error"] is None
    assert len(threads) == 1 and threads[0].startswith("lengthwise-device")
    assert torch.is_inference_mode_enabled() is False
