"""Everything that depends on which device runs the model: choice, dtype, collate, prefetch.

The CPU path runs the same code as CUDA; only `to_device` differs (pinned memory and
non-blocking copies on CUDA).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from pipeline.errors import UsageError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """`auto` is the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise UsageError(f"unknown device {name!r}; set --device to auto, cpu or cuda[:N]") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name} asked for CUDA but torch sees no GPU; use --device cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on a CUDA device that supports it, float32 everywhere else."""
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise UsageError(f"unknown dtype {name!r}; set --dtype to auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def collate(token_ids: np.ndarray, offsets: np.ndarray, rows: np.ndarray, padded_length: int,
            pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Padded (rows, padded_length) input ids and attention mask from flat token arrays."""
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    positions = np.arange(padded_length)
    attention_mask = positions[None, :] < lengths[:, None]
    gather = np.where(attention_mask, starts[:, None] + positions[None, :], 0)
    input_ids = np.where(attention_mask, token_ids[gather], pad_token_id).astype(np.int64)
    return input_ids, attention_mask.astype(np.int64)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A tensor on `device`; on CUDA through pinned memory with a non-blocking copy."""
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


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
        thread.join()
