"""The online half: requests that arrive one by one, gathered into batches under a deadline.

    submit(text) ─tokenize thread─▶ queue, FIFO per padded-length bucket
      ─trigger (max_batch_size requests, max_batch_tokens padded tokens, or the oldest
       request's batch_timeout_ms)─▶ batch: the oldest request's bucket, then the nearest
      ─device thread: the job's forward, halved on out-of-memory─▶ each caller's own record

The batching rules (`RequestQueue`, `BatchRules`, `retry_after_s`) are pure and need no
torch; `DynamicBatcher` wires them to the event loop, one tokenizer thread and one device
thread, so the loop never blocks: deadlines are timers that fire on time even while a batch
runs, and the next batch is formed while the current one is on the device.

A request's answer is the row the offline job (`lengthwise run`) writes for the same text:
`{"id", <the job's columns>, "truncated", "error"}`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pipeline.online.config import BatcherConfig
from pipeline.online.rules import (
    BatcherClosed,
    BatcherStats,
    BatchRules,
    QueuedRequest,
    QueueFull,
    RequestQueue,
    RequestTooLarge,
    batch_padded_length,
    check_timeouts,
    retry_after_s,
)

log = logging.getLogger(__name__)


class DynamicBatcher:
    """`await batcher.submit(text)` → the offline job's record for `text`.

    Use as `async with DynamicBatcher.from_config(config) as batcher:`; leaving the block
    answers every queued request (or fails it, when the block raised). One batcher serves one
    event loop at a time.
    """

    def __init__(self, runtime, config: BatcherConfig):
        """`runtime`: a pipeline.runtime.Runtime (`open_runtime(config)`): the loaded model and its memory
        plan's limits, lowered after an out-of-memory split; `config.batch`: limits settled as the runtime's."""
        from tokenizers import Tokenizer

        from pipeline.core.buckets import bucket_bounds
        from pipeline.core.device import padding_multiple
        from pipeline.core.forward import DeviceFeeder

        check_timeouts(config.batch_timeout_ms, config.request_timeout_ms)
        if config.batch.max_batch_tokens is None:
            raise ValueError("max_batch_tokens must be settled (`open_runtime`, as `from_config` does)")
        if config.max_batch_size < 1 or config.max_queue < 1 or config.max_queue_tokens < 1 or \
                config.batch.max_batch_tokens < 1:
            raise ValueError("max_batch_size, max_batch_tokens, max_queue and max_queue_tokens must be positive")
        loaded = runtime.loaded
        if config.model.max_length is not None and config.model.max_length != loaded.choice.max_length:
            raise ValueError(f"max_length {config.model.max_length} differs from the loaded model's "
                             f"{loaded.choice.max_length}; load the model with the same settings")
        self.loaded, self.config, self.limits = loaded, config, runtime.limits
        device = loaded.choice.device
        self.rules = BatchRules(config.max_batch_size, config.batch.max_batch_tokens, config.batch_timeout_ms / 1000,
                                runtime.limits.rows_for)
        self.bounds = bucket_bounds(loaded.choice.max_length, padding_multiple(device))
        self.stats = BatcherStats()
        self._tokenizer = Tokenizer.from_str(loaded.tokenizer.tokenizer_json)
        self._feeder = DeviceFeeder(device)
        self._tokenize_thread = ThreadPoolExecutor(1, thread_name_prefix="lengthwise-tokenize")
        self._device_thread = ThreadPoolExecutor(1, thread_name_prefix="lengthwise-device",
                                                 initializer=_use_device, initargs=(device,))
        self._queue = RequestQueue()
        self._tokenizing = 0
        self._sequence = itertools.count()
        self._wake: asyncio.Event | None = None
        self._scheduler: asyncio.Task | None = None
        self._closing = False
        self._drain = True

    @classmethod
    def from_config(cls, config: BatcherConfig) -> DynamicBatcher:
        """Load the model as `lengthwise run` does and settle its token budget (None: the device's
        default for this model) and memory plan."""
        import dataclasses

        from pipeline.runtime import open_runtime

        runtime = open_runtime(config)
        return cls(runtime, dataclasses.replace(config, batch=runtime.batch))

    # ── the caller's side ──

    async def submit(self, text, request_id=None, timeout_s: float | None = None) -> dict:
        """The offline job's record for `text`. Raises QueueFull (at once, nothing queued),
        RequestTooLarge, TimeoutError (the deadline passed; a request still queued is never
        computed), BatcherClosed; cancelling the awaiting task takes the request out of the queue."""
        self._start()
        if self._closing:
            raise BatcherClosed("the batcher is closed; no new requests")
        timeout_s = self.config.request_timeout_ms / 1000 if timeout_s is None else timeout_s
        check_timeouts(self.config.batch_timeout_ms, timeout_s * 1000)
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        sequence = next(self._sequence)
        request_id = sequence if request_id is None else request_id
        self.stats.submitted += 1
        waiting = self._tokenizing + len(self._queue)
        if waiting >= self.config.max_queue:
            raise self._queue_full("requests", f"{waiting} requests wait (max_queue {self.config.max_queue})")
        self._tokenizing += 1
        self._note_depth()
        try:
            encoded = await loop.run_in_executor(self._tokenize_thread, self._encode, text)
        finally:
            self._tokenizing -= 1
            self._note_depth()
            self._wake.set()
        error = encoded.errors[0]
        if error is not None:
            self.stats.invalid_text += 1
            self.stats.answered += 1
            return self._empty_record(request_id, error)
        if self._closing and not self._drain:
            raise BatcherClosed("the batcher closed while the request was being tokenized")
        token_ids = encoded.token_ids
        padded_length = int(self.bounds[np.searchsorted(self.bounds, len(token_ids), side="left")])
        refusal = self.rules.refusal(padded_length)
        if refusal:
            self.stats.rejected_too_large += 1
            raise RequestTooLarge(refusal)
        if self._queue.padded_tokens + padded_length > self.config.max_queue_tokens:
            raise self._queue_full("tokens", f"{self._queue.padded_tokens:,} padded tokens wait, this request "
                                   f"adds {padded_length} (max_queue_tokens {self.config.max_queue_tokens:,})")
        request = QueuedRequest(request_id, token_ids, bool(encoded.truncated[0]), padded_length, arrived,
                                arrived + timeout_s, loop.create_future(), sequence=sequence)
        if loop.time() >= request.deadline:
            self.stats.timed_out_in_queue += 1
            raise TimeoutError(f"request {request_id!r}: its {timeout_s:g} s passed while it was tokenized")
        self._queue.push(request)
        request.timer = loop.call_at(request.deadline, self._expire, request, timeout_s)
        self._note_depth()
        self._wake.set()
        try:
            return await request.future
        finally:
            request.timer.cancel()
            if self._queue.remove(request):  # the caller was cancelled while the request waited
                self.stats.cancelled += 1
                self._note_depth()
                self._wake.set()
            elif request.future.cancelled():
                self.stats.cancelled += 1  # cancelled while its batch was formed or ran: not delivered

    def _queue_full(self, bound: str, what: str) -> QueueFull:
        self.stats.rejected_queue_full += 1
        rate = self.stats.rows_per_s()
        wait = retry_after_s(self._tokenizing + len(self._queue), rate, self.rules.batch_timeout_s)
        served = f"the device serves ~{rate:,.0f} requests/s" if rate else "no batch has run yet"
        return QueueFull(f"queue full: {what}; retry in about {wait:.2f} s ({served}), or raise --max-queue"
                         f"{'-tokens' if bound == 'tokens' else ''}", bound, wait)

    def _encode(self, text):
        from pipeline.core.tokenize import encode_texts

        return encode_texts([text], self._tokenizer, self.loaded.tokenizer)

    def _expire(self, request: QueuedRequest, timeout_s: float) -> None:
        """The deadline timer: the caller gets TimeoutError now, whatever the device is doing."""
        if request.future.done():
            return
        queued = self._queue.remove(request)
        if queued:
            self.stats.timed_out_in_queue += 1
            self._note_depth()
            self._wake.set()
        else:
            self.stats.timed_out_in_batch += 1
        where = "in the queue, so it was not computed" if queued else "while its batch was prepared or ran"
        request.future.set_exception(TimeoutError(f"request {request.request_id!r} not answered within "
                                                  f"{timeout_s * 1000:g} ms; it expired {where}"))

    def _note_depth(self) -> None:
        stats = self.stats
        stats.queue_depth = self._tokenizing + len(self._queue)
        stats.queued_tokens = self._queue.padded_tokens
        stats.max_queue_depth = max(stats.max_queue_depth, stats.queue_depth)

    # ── the scheduler: forms batches on the event loop, runs them on the device thread ──

    def _start(self) -> None:
        if self._scheduler is None:
            self._wake = asyncio.Event()
            self._scheduler = asyncio.get_running_loop().create_task(self._schedule(), name="lengthwise-batcher")

    async def _schedule(self) -> None:
        running: asyncio.Task | None = None
        try:
            while True:
                batch = await self._next_batch()
                if batch is None:
                    break
                if running is not None:  # the next batch is formed; it goes to the device once this one is done
                    await running
                    # topped up with what arrived during that forward, in place of callers that gave up
                    batch = self._queue.take_batch(self.rules, [r for r in batch if not r.future.done()])
                    self._note_depth()
                running = asyncio.create_task(self._run_batch(batch))
            if running is not None:
                await running
        except BaseException as error:
            self._fail_queued(BatcherClosed(f"the batcher stopped: {error!r}"))
            raise

    async def _next_batch(self) -> list[QueuedRequest] | None:
        """Wait until a batch is due and take it; None once closing with nothing left."""
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            if self._closing and not self._queue and not self._tokenizing:
                return None
            wait = self._queue.due_in(loop.time(), self.rules)
            if wait is not None and (wait <= 0 or self._closing):
                trigger = self._queue.full(self.rules) or ("timeout" if wait <= 0 else "close")
                self.stats.triggers[trigger] += 1
                batch = self._queue.take_batch(self.rules)
                self._note_depth()
                return batch
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=wait)
            except TimeoutError:
                pass

    async def _run_batch(self, batch: list[QueuedRequest]) -> None:
        """Drop requests whose callers gave up, compute the rest, answer each caller."""
        live = [request for request in batch if not request.future.done()]
        if not live:
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            result, compute_s = await loop.run_in_executor(self._device_thread, self._forward, live)
            records = self._records(live, result)
        except Exception as error:  # noqa: BLE001 - every caller of the batch gets it; the batcher goes on
            log.warning(f"a batch of {len(live)} failed: {error!r}")
            for request in live:
                if not request.future.done():
                    self.stats.failed += 1
                    request.future.set_exception(RuntimeError(f"the batch of request {request.request_id!r} "
                                                              f"failed: {error!r}"))
            return
        stats = self.stats
        stats.batches += 1
        stats.rows_computed += len(live)
        stats.oom_splits += result.splits
        stats.batch_sizes.append(len(live))
        stats.batch_padded_tokens.append(len(live) * batch_padded_length(live))
        stats.compute_s.append(compute_s)
        stats.wait_s.extend(started - request.arrived for request in live)
        for request, record in zip(live, records):
            if request.future.done():  # expired or cancelled while the batch ran: counted there
                continue
            stats.answered += 1
            request.future.set_result(record)

    def _forward(self, batch: list[QueuedRequest]):
        """On the device thread: collate, forward with out-of-memory halving, lower the memory
        plan's rows after a split (as the offline device loop does)."""
        import time

        import torch

        from pipeline.core.collate import collate, has_padding
        from pipeline.core.forward import HostCopy, forward_splitting_on_oom

        started = time.perf_counter()
        padded_length = batch_padded_length(batch)
        lengths = np.array([request.length for request in batch], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        token_ids = np.concatenate([request.token_ids for request in batch])
        input_ids, attention_mask = collate(token_ids, offsets, np.arange(len(batch)), padded_length,
                                            self.loaded.tokenizer.pad_token_id)
        job, model, device = self.loaded.job, self.loaded.model, self.loaded.choice.device
        padded = has_padding(lengths, padded_length)

        def forward(ids, mask):  # inputs left on the host (no room for their copy) move here, under the back-off
            return job.forward(model, ids.to(device, non_blocking=True), mask.to(device, non_blocking=True), padded)

        with torch.inference_mode():
            tensors, copied = self._feeder.send(input_ids, attention_mask)
            input_ids, attention_mask = self._feeder.receive(tensors, copied)
            result = HostCopy(forward_splitting_on_oom(forward, input_ids, attention_mask, device), device).read()
        if result.splits:
            self.limits.lower(padded_length, max(1, result.largest_ok_rows))
        return result, time.perf_counter() - started

    def _records(self, batch: list[QueuedRequest], result) -> list[dict]:
        """Each request's row as the offline job writes it (see `output_records`)."""
        from pipeline.core.device import dtype_name
        from pipeline.core.forward import failed_rows

        errors: list[str | None] = [None] * len(batch)
        for rows, error in failed_rows(result.outputs, result.failed, dtype_name(self.loaded.choice.dtype),
                                       batch_padded_length(batch), non_finite_fix="use --dtype float32"):
            for position in np.flatnonzero(rows):
                errors[position] = error
        return output_records(self.loaded.job, self.loaded.model, [r.request_id for r in batch], result.outputs,
                              [r.truncated for r in batch], errors)

    def _empty_record(self, request_id, error: str) -> dict:
        return output_records(self.loaded.job, self.loaded.model, [request_id], {}, [False], [error])[0]

    # ── shutdown ──

    async def close(self, drain: bool = True) -> None:
        """Stop taking requests; compute every queued one (`drain`) or fail it with
        BatcherClosed; return once every caller has its answer and the threads are stopped."""
        self._closing = True
        self._drain = self._drain and drain
        if not drain:
            self._fail_queued(BatcherClosed("the batcher closed before this request was computed"))
        if self._scheduler is not None:
            self._wake.set()
            await self._scheduler
        self._tokenize_thread.shutdown(wait=False, cancel_futures=True)
        self._device_thread.shutdown(wait=True)

    def _fail_queued(self, error: Exception) -> None:
        while self._queue:
            request = self._queue.oldest()
            self._queue.remove(request)
            if not request.future.done():
                request.future.set_exception(error)
        self._note_depth()

    async def __aenter__(self) -> DynamicBatcher:
        self._start()
        return self

    async def __aexit__(self, exc_type, exc, traceback) -> None:
        await self.close(drain=exc_type is None)


def _use_device(device) -> None:
    """The device thread makes cuda:N its current device (current devices are per thread)."""
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)


def output_records(job, model, request_ids: list, outputs: dict, truncated: list[bool],
                   errors: list[str | None]) -> list[dict]:
    """Rows as the offline job writes them: id, the job's columns (null where there is an
    error), truncated, error; through the job's own Arrow conversion, so the values match."""
    import pyarrow as pa

    from pipeline.core.tokenize import rows_without_error

    valid = rows_without_error(errors)
    if outputs:
        columns = job.to_columns(model, outputs, valid)
    else:
        columns = {f.name: pa.nulls(len(request_ids), f.type) for f in job.output_schema(model)}
    table = pa.table({**columns, "truncated": pa.array([t and v for t, v in zip(truncated, valid)], pa.bool_()),
                      "error": pa.array(errors, pa.string())})
    return [{"id": request_id, **row} for request_id, row in zip(request_ids, table.to_pylist())]
