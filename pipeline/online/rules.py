"""The online batcher's pure parts: batch rules, the bounded request queue and its fast-fail
errors, and the batch statistics."""

from __future__ import annotations

import itertools
import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pipeline.core.buckets import batch_capacity

STATS_WINDOW = 100_000  # recent batches and requests the stats keep


class QueueFull(Exception):
    """The queue is at its bound: the request was not queued. `retry_after_s` says when the
    queue is expected to have room at the recent service rate."""

    def __init__(self, message: str, bound: str, retry_after_s: float):
        super().__init__(message)
        self.bound = bound  # requests | tokens
        self.retry_after_s = retry_after_s


class RequestTooLarge(ValueError):
    """A request that no batch may hold, refused at submit rather than looped on."""


class BatcherClosed(RuntimeError):
    """The batcher is closed (or closing without draining): the request will not be computed."""


@dataclass(frozen=True)
class BatchRules:
    """When a batch runs and what it may hold."""

    max_batch_size: int
    max_batch_tokens: int | None
    batch_timeout_s: float
    memory_rows: Callable[[int], int] | None = None  # rows the memory plan allows per padded length

    def capacity(self, padded_length: int) -> int:
        return batch_capacity(padded_length, self.max_batch_tokens, self.max_batch_size, self.memory_rows)

    def refusal(self, padded_length: int) -> str | None:
        """Why a request of this padded length can never run, or None."""
        if self.max_batch_tokens is not None and padded_length > self.max_batch_tokens:
            return (f"the request pads to {padded_length} tokens, more than max_batch_tokens "
                    f"{self.max_batch_tokens} on its own; shorten it or raise --max-batch-tokens")
        if self.memory_rows is not None and self.memory_rows(padded_length) < 1:
            return (f"the memory plan allows no batch of padded length {padded_length} on this device; "
                    "shorten the text or lower --max-length")
        return None


@dataclass(eq=False)
class QueuedRequest:
    """One waiting request: its tokens, its bucket, when it came and when its caller gives up."""

    request_id: object
    token_ids: np.ndarray
    truncated: bool
    padded_length: int
    arrived: float  # loop time of the submit
    deadline: float  # loop time the caller gives up
    future: object = None  # asyncio.Future of the answer
    timer: object = None  # the deadline's timer handle
    sequence: int = 0  # submit order: ties in `arrived` keep it

    @property
    def length(self) -> int:
        return len(self.token_ids)


class RequestQueue:
    """Waiting requests, FIFO within each padded-length bucket, counted in requests and padded tokens."""

    def __init__(self):
        self._buckets: dict[int, deque[QueuedRequest]] = {}
        self.requests = 0
        self.padded_tokens = 0

    def __len__(self) -> int:
        return self.requests

    def push(self, request: QueuedRequest) -> None:
        self._buckets.setdefault(request.padded_length, deque()).append(request)
        self.requests += 1
        self.padded_tokens += request.padded_length

    def remove(self, request: QueuedRequest) -> bool:
        """Take `request` out (cancelled, expired); False if it is not queued (already in a batch)."""
        bucket = self._buckets.get(request.padded_length)
        if not bucket:
            return False
        try:
            bucket.remove(request)
        except ValueError:
            return False
        self._forget(request, bucket)
        return True

    def _forget(self, request: QueuedRequest, bucket: deque) -> None:
        self.requests -= 1
        self.padded_tokens -= request.padded_length
        if not bucket:
            del self._buckets[request.padded_length]

    def oldest(self) -> QueuedRequest | None:
        """The request that has waited longest: the oldest bucket head (each bucket is FIFO)."""
        heads = [bucket[0] for bucket in self._buckets.values()]
        return min(heads, key=lambda r: (r.arrived, r.sequence)) if heads else None

    def full(self, rules: BatchRules) -> str | None:
        """Which size trigger holds: `size` (max_batch_size requests wait), `tokens`
        (max_batch_tokens padded tokens wait), or None."""
        if self.requests >= rules.max_batch_size:
            return "size"
        if rules.max_batch_tokens is not None and self.padded_tokens >= rules.max_batch_tokens:
            return "tokens"
        return None

    def due_in(self, now: float, rules: BatchRules) -> float | None:
        """Seconds until a batch must run: 0 when a size trigger holds (`full`), else when the
        oldest request has waited batch_timeout; None when empty."""
        oldest = self.oldest()
        if oldest is None:
            return None
        if self.full(rules):
            return 0.0
        return max(0.0, oldest.arrived + rules.batch_timeout_s - now)

    def take_batch(self, rules: BatchRules, batch: list[QueuedRequest] | None = None) -> list[QueuedRequest]:
        """The next batch: the oldest request's bucket first, then the buckets nearest in padded
        length (shorter first on a tie), each FIFO, while the batch fits its capacity at its
        padded length. A request that does not fit stays at the head of its bucket. Given a
        `batch` formed earlier (waiting for the device), tops it up the same way, around its
        first request's length, with what arrived since."""
        batch = list(batch or [])
        anchor = batch[0] if batch else self.oldest()
        if anchor is None:
            return []
        padded_length = max([anchor.padded_length] + [request.padded_length for request in batch])
        order = sorted(self._buckets, key=lambda length: (length != anchor.padded_length,
                                                           abs(length - anchor.padded_length), length))
        for length in order:
            bucket = self._buckets[length]
            while bucket:
                longest = max(padded_length, length)
                if len(batch) + 1 > rules.capacity(longest):
                    break
                request = bucket.popleft()
                self._forget(request, bucket)
                batch.append(request)
                padded_length = longest
            if len(batch) >= rules.max_batch_size:
                break
        return batch


def retry_after_s(waiting: int, rows_per_s: float | None, batch_timeout_s: float) -> float:
    """When a rejected caller may expect room: the time to serve what waits at the recent rate,
    at least one batch window (no rate known yet: one window)."""
    if not rows_per_s or rows_per_s <= 0 or not math.isfinite(rows_per_s):
        return batch_timeout_s
    return max(batch_timeout_s, waiting / rows_per_s)


def batch_padded_length(batch: list[QueuedRequest]) -> int:
    return max(request.padded_length for request in batch)


@dataclass
class BatcherStats:
    """Counts since the last `reset` and the recent batches' sizes, waits and compute times."""

    submitted: int = 0
    answered: int = 0  # callers that got their record
    invalid_text: int = 0  # answered at once with the offline job's error record (null, empty text)
    rejected_queue_full: int = 0
    rejected_too_large: int = 0
    timed_out_in_queue: int = 0  # dropped before compute
    timed_out_in_batch: int = 0  # expired after its batch was formed: dropped if that batch had not started
    cancelled: int = 0
    failed: int = 0  # the batch raised (not out of memory): every caller in it got the error
    batches: int = 0
    rows_computed: int = 0
    oom_splits: int = 0
    queue_depth: int = 0  # requests waiting now (tokenizing or queued)
    queued_tokens: int = 0  # padded tokens queued now
    max_queue_depth: int = 0
    triggers: Counter = field(default_factory=Counter)  # batches formed per trigger: size, tokens, timeout, close
    batch_sizes: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    batch_padded_tokens: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))  # rows × padded length
    # per computed request: submit to the start of its forward
    wait_s: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    compute_s: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))  # per batch: the device's time

    def reset(self) -> None:
        """Start counting afresh (the load test after its warm-up); the current depths stay."""
        depth, tokens = self.queue_depth, self.queued_tokens
        fresh = BatcherStats(queue_depth=depth, queued_tokens=tokens, max_queue_depth=depth)
        self.__dict__.update(fresh.__dict__)

    @property
    def mean_batch_size(self) -> float:
        return float(np.mean(self.batch_sizes)) if self.batch_sizes else 0.0

    def rows_per_s(self) -> float | None:
        """What the device served per second of compute over the recent batches."""
        seconds = sum(itertools.islice(reversed(self.compute_s), 50))
        rows = sum(itertools.islice(reversed(self.batch_sizes), 50))
        return rows / seconds if seconds > 0 else None


def check_timeouts(batch_timeout_ms: float, request_timeout_ms: float) -> None:
    if batch_timeout_ms < 0:
        raise ValueError(f"batch_timeout_ms must be 0 or more, got {batch_timeout_ms}")
    if request_timeout_ms <= batch_timeout_ms:
        raise ValueError(f"a request timeout of {request_timeout_ms:g} ms is not more than the batch timeout of "
                         f"{batch_timeout_ms:g} ms: a lone request would expire while it waits for company; "
                         "give it a longer timeout or lower the batch timeout")
