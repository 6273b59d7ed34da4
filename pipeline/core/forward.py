"""The shared forward: send collated batches (core/collate.py) to the device, prefetch them on a thread,
run the one device loop (`run_on_device`, halving a batch on out-of-memory) and read results back."""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.core.buckets import BatchLimits
from pipeline.core.clock import StageTimes, timed
from pipeline.core.collate import CollatedBatch, collated_batches
from pipeline.core.device import is_out_of_memory, padding_multiple, release_cached_memory
from pipeline.core.tokenize import EncodedRows


class DeviceFeeder:
    """Moves collated batches to the device ahead of use, from the prefetch thread.

    On CUDA the copy goes from pinned memory on a side stream, so it overlaps the forward
    pass running on the compute stream; the compute stream waits on the copy's event only
    when it takes the batch. On the CPU the arrays become tensors without a copy.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def send(self, *arrays: np.ndarray) -> tuple[list[torch.Tensor], object]:
        if self.stream is None:
            return [torch.from_numpy(a) for a in arrays], None
        try:
            # the current device is per thread: the prefetch thread must make cuda:N its own too
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                tensors = [torch.from_numpy(a).pin_memory().to(self.device, non_blocking=True) for a in arrays]
                copied = torch.cuda.Event()
                copied.record(self.stream)
            return tensors, copied
        except BaseException as error:
            if not is_out_of_memory(error):
                raise
        # no room for the inputs now (the forward holds it): hand them on from the host; the device
        # loop moves them inside its out-of-memory back-off, which halves the batch if need be
        return [torch.from_numpy(a) for a in arrays], None

    def receive(self, tensors: list[torch.Tensor], copied) -> list[torch.Tensor]:
        if copied is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(copied)
            for tensor in tensors:
                tensor.record_stream(compute)  # the allocator must not reuse it before compute is done
        return tensors


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


_DONE = object()


def prefetch(items: Iterable, depth: int) -> Iterator:
    """Run `items` on a background thread, at most `depth` items ahead of the consumer.

    Errors in the producer are raised in the consumer. Closing the returned generator
    (or leaving its loop) stops the producer at its next item.
    """
    buffer: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                buffer.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as error:  # handed to the consumer, which re-raises it
            put(_Failure(error))

    thread = threading.Thread(target=produce, name="lengthwise-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = buffer.get()
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join(timeout=30)  # a producer stuck in a dead stage must not hang the exit; it is a daemon


@dataclass
class SplitForward:
    """Outputs of a batch run with out-of-memory back-off."""

    outputs: dict  # per row, in batch order, zeros where `failed`: device tensors, numpy once read back
    failed: np.ndarray  # bool per row: out of memory even alone
    splits: int  # how many times a batch was halved
    largest_ok_rows: int  # the largest part that ran


def forward_splitting_on_oom(forward, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             device: torch.device, max_rows: int | None = None,
                             token_type_ids: torch.Tensor | None = None) -> SplitForward:
    """Run `forward(ids, mask) → {name: tensor}` (`forward(ids, mask, types)` with `token_type_ids`,
    a pair job's); on out-of-memory halve the batch and retry each half, down to single rows.
    Every row is computed once; a row that fails alone is reported in `failed` instead of raising.
    Outputs stay on the device (see `HostCopy`). A batch of more than `max_rows` (collated before a
    split lowered the limits) runs in parts of that many rows from the start, without failing first."""
    rows = input_ids.shape[0]

    def part(s: slice) -> SplitForward:
        return forward_splitting_on_oom(forward, input_ids[s], attention_mask[s], device,
                                        token_type_ids=None if token_type_ids is None else token_type_ids[s])

    if max_rows is not None and rows > max_rows:
        parts = [part(slice(start, start + max_rows)) for start in range(0, rows, max_rows)]
        return joined(parts, splits=sum(p.splits for p in parts))
    try:
        inputs = (input_ids, attention_mask) if token_type_ids is None else (input_ids, attention_mask, token_type_ids)
        return SplitForward(dict(forward(*inputs)), np.zeros(rows, dtype=bool), 0, rows)
    except BaseException as error:
        if not is_out_of_memory(error):
            raise
        release_cached_memory(device, error)
    if rows == 1:
        return SplitForward({}, np.ones(1, dtype=bool), 0, 0)
    half = rows // 2
    parts = [part(s) for s in (slice(0, half), slice(half, rows))]
    return joined(parts, splits=1 + sum(p.splits for p in parts))


def joined(parts: list[SplitForward], splits: int) -> SplitForward:
    """Consecutive parts of one batch as one result (zeros for the rows of a part that failed whole)."""
    shapes = next((p.outputs for p in parts if p.outputs), None)
    outputs = {}
    if shapes is not None:
        for name, values in shapes.items():
            outputs[name] = torch.cat([p.outputs[name] if p.outputs else
                                       values.new_zeros((len(p.failed), *values.shape[1:])) for p in parts])
    return SplitForward(outputs, np.concatenate([p.failed for p in parts]), splits,
                        max(p.largest_ok_rows for p in parts))


class HostCopy:
    """A batch's outputs on their way to the host as float32. On CUDA a non-blocking copy into
    pinned memory, marked by an event, so the host can launch the next batch before it waits
    for this one; with CUDA events around the forward, `device_seconds` is the time the
    device spent on it. On the CPU the copy is the outputs themselves."""

    def __init__(self, result: SplitForward, device: torch.device, started=None):
        self.result = result
        self.started, self.done = started, None
        if device.type != "cuda":
            self.host = {name: values.float() for name, values in result.outputs.items()}
            return
        self.host = {}
        for name, values in result.outputs.items():
            host = torch.empty(values.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(values.float(), non_blocking=True)
            self.host[name] = host
        self.done = torch.cuda.Event(enable_timing=started is not None)
        self.done.record()

    def read(self) -> SplitForward:
        """The outputs as numpy arrays on the host, waiting for the copy if it is still running."""
        if self.done is not None:
            self.done.synchronize()
        outputs = {name: values.numpy() for name, values in self.host.items()}
        return dataclasses.replace(self.result, outputs=outputs)

    def device_seconds(self) -> float | None:
        """Device time from `started` to the end of the copy (CUDA, after `read`), else None."""
        if self.started is None or self.done is None:
            return None
        return self.started.elapsed_time(self.done) / 1000


def finite_rows(outputs: dict[str, np.ndarray]) -> np.ndarray:
    """Rows whose every output value is finite: a nan or inf (overflow in half precision, a
    broken model) becomes the row's error instead of a valid-looking result."""
    finite = None
    for values in outputs.values():
        rows = values.reshape(len(values), -1)
        # the common case, every value finite, in one reduction: half the time of one a row
        row_finite = np.ones(len(rows), bool) if np.isfinite(rows).all() else np.isfinite(rows).all(axis=1)
        finite = row_finite if finite is None else finite & row_finite
    return finite


def failed_rows(outputs: dict[str, np.ndarray], out_of_memory: np.ndarray, dtype: str, padded_length: int,
                non_finite_fix: str = "rerun with --dtype float32") -> list[tuple[np.ndarray, str]]:
    """The rows of a batch that get an error in place of outputs, as (mask, error): a non-finite output
    (in `dtype`; what to do: `non_finite_fix`), out of memory even alone at `padded_length`. The
    wording the offline run and the online batcher share."""
    failed = []
    if outputs:
        failed.append((~finite_rows(outputs) & ~out_of_memory,
                       f"the model gave a non-finite output (nan or inf) in {dtype}; {non_finite_fix}"))
    failed.append((out_of_memory, f"out of memory even alone at padded length {padded_length}; lower --max-length "
                                  "or use a larger device"))
    return [(mask, error) for mask, error in failed if mask.any()]


@dataclass
class ReadyBatch:
    """A collated batch on its way to the device, with the rows it answers for."""

    rows: np.ndarray  # positions in the encoded rows (of `window`, if any)
    padded_length: int
    tensors: list[torch.Tensor]  # input ids, attention mask (token type ids if `typed`; the packed layout), on
    # their way to the device
    copied: object  # the CUDA event of their copy, or None
    real_tokens: int
    padded_tokens: int
    window: object = None  # the offline runner's Window these rows belong to, if any
    entered: float = 0.0  # when the packer handed these rows on (the sweep's row latency starts here)
    padded: bool = True  # some row is shorter than padded_length (else the encoder runs without a mask)
    typed: bool = False  # token type ids follow the mask (a pair job whose model types its texts)
    models: tuple[str, ...] | None = None  # several models: the ones that run these rows (None: every one)


def collate_batches(encoded: EncodedRows, rows: np.ndarray, max_batch_tokens: int | None, max_batch_rows: int,
                    max_length: int, limits: BatchLimits, pad_token_id: int, feeder: DeviceFeeder,
                    times: StageTimes | None = None, packed: bool = False) -> Iterator[ReadyBatch]:
    """`collated_batches` (core/collate.py) padded to the multiple of `feeder`'s device, each sent on its
    way there (`sent`)."""
    for batch in collated_batches(encoded, rows, max_batch_tokens, max_batch_rows, max_length, limits, pad_token_id,
                                  padding_multiple(feeder.device), packed):
        yield sent(batch, feeder, times)


def sent(batch: CollatedBatch, feeder: DeviceFeeder, times: StageTimes | None = None, window: object = None,
         models: tuple[str, ...] | None = None) -> ReadyBatch:
    """A collated batch on its way to `feeder`'s device; `times.collate` counts its collate and this."""
    tensors, copied = feeder.send(*batch.arrays)
    ready = ReadyBatch(batch.rows, batch.padded_length, tensors, copied, batch.real_tokens, batch.padded_tokens,
                       window, batch.entered, batch.padded, batch.typed, models)
    if times is not None:
        times.collate += time.perf_counter() - batch.entered
    return ready


def run_on_device(items: Iterable, job, model: torch.nn.Module, device: torch.device, feeder: DeviceFeeder,
                  limits: BatchLimits, prefetch_batches: int,
                  times: StageTimes) -> Iterator[tuple[object, SplitForward | None]]:
    """The one device loop: take each collated batch from the prefetch thread, receive it on
    the device, run the job's forward (halving on out-of-memory, lowering `limits` for the
    rest of the run) and yield it with its outputs on the host. Other items pass through with
    None, in order, after every batch before them.

    On CUDA one batch stays in flight: batch N+1 is launched before batch N's outputs are read
    back, so the device never idles while the host stores results, and `times.forward` is
    device time from CUDA events. On the CPU the forward is synchronous and each batch is
    yielded at once."""
    keep_in_flight = device.type == "cuda"

    def forward(input_ids, attention_mask, token_type_ids=None, padded=True, packing=(), models=None):
        # inputs still on the host (their copy ran out of memory) move here, under the back-off; the
        # host's packed layout is the whole batch's, so a part split off after running out of memory has none
        whole = bool(packing) and input_ids.shape[0] == packing[1].shape[0] - 1
        layout = tuple(t.to(device, non_blocking=True) for t in packing) if whole else None
        types = {} if token_type_ids is None else {"token_type_ids": token_type_ids.to(device, non_blocking=True)}
        subset = {} if models is None else {"models": models}
        return job.forward(model, input_ids.to(device, non_blocking=True),
                           attention_mask.to(device, non_blocking=True), padded, layout, **types, **subset)

    def read_back(item: ReadyBatch, copy: HostCopy) -> tuple[ReadyBatch, SplitForward]:
        result = copy.read()
        device_seconds = copy.device_seconds()
        if device_seconds is not None:
            times.forward += device_seconds
        return item, result

    in_flight = None
    with torch.inference_mode():
        for item in timed(prefetch(items, prefetch_batches), times, "wait_for_batch"):
            if not isinstance(item, ReadyBatch):
                if in_flight:
                    yield read_back(*in_flight)
                    in_flight = None
                yield item, None
                continue
            started = time.perf_counter()
            started_event = device_timer_start(device)
            input_ids, attention_mask, *packing = feeder.receive(item.tensors, item.copied)
            token_type_ids = packing.pop(0) if item.typed else None
            result = forward_splitting_on_oom(functools.partial(forward, padded=item.padded, packing=packing,
                                                                models=item.models), input_ids,
                                              attention_mask, device, limits.rows_for(item.padded_length),
                                              token_type_ids=token_type_ids)
            if result.splits:
                limits.lower(item.padded_length, max(1, result.largest_ok_rows))
            launched = (item, HostCopy(result, device, started_event))
            if started_event is None:
                times.forward += time.perf_counter() - started
            if in_flight:  # the batch before this one, now that this one is launched
                yield read_back(*in_flight)
                in_flight = None
            if keep_in_flight:
                in_flight = launched
            else:
                yield read_back(*launched)
        if in_flight:
            yield read_back(*in_flight)


def device_timer_start(device: torch.device):
    """A recorded CUDA event to time the device's work from (None on the CPU, timed on the host)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
