"""Memory the run's process and its tokenizer workers both map: a task's texts go to a worker as where they
lie, its token ids and result come back through a slot; only a few bytes a task cross the pool's socket.

A block the shard reader process read (offline/reader.py) is a memory file the run's process maps. Its
texts went to the tokenizer pool copied into compact buffers and pickled through the pool's pipe (three
copies of each text and the pool's feeder thread, ~0.5 µs a row of the run's process); a worker now maps
the same file (`/proc/<run's pid>/fd/<n>`, open while the block lives) and rebuilds the array from it.
Arrays elsewhere (a run that reads in its own process, --reuse's texts with the reused rows dropped) are
copied into compact buffers and pickled with the task (a memory file of its own when large,
core/worker_pool.py).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import pickle
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa


@dataclass(frozen=True)
class ArrayInMemory:
    """Where an array's buffers lie in a memory file of the run's process."""

    path: str  # /proc/<pid>/fd/<n>: the memory file, open in the run's process while the array lives
    size: int  # the file's bytes, all mapped
    type: pa.DataType
    length: int
    offset: int
    buffers: tuple  # (start, size) in the file of each of the array's buffers; None where it has none

    def array(self) -> pa.Array:
        """The array, from a mapping of the file (unmapped when the array goes)."""
        with open(self.path, "rb") as file:
            whole = pa.py_buffer(mmap.mmap(file.fileno(), self.size, prot=mmap.PROT_READ))
        buffers = [None if span is None else whole.slice(*span) for span in self.buffers]
        return pa.Array.from_buffers(self.type, self.length, buffers, offset=self.offset)


_LOCK = threading.Lock()
_SHARED: dict[int, tuple[int, int, str]] = {}  # id of a mapping → its (address, size, path)


def share(mapped: mmap.mmap, memory: int) -> pa.Buffer:
    """The mapping of memory file `memory` as a buffer whose arrays `in_memory` can hand over; the file
    stays open, for the workers to map, until the mapping goes."""
    buffer = pa.py_buffer(mapped)
    key = id(mapped)
    with _LOCK:
        _SHARED[key] = (buffer.address, buffer.size, f"/proc/{os.getpid()}/fd/{memory}")
    weakref.finalize(mapped, _forget, key, memory)
    return buffer


def _forget(key: int, memory: int) -> None:
    with _LOCK:
        _SHARED.pop(key, None)
    os.close(memory)


def in_memory(array: pa.Array) -> ArrayInMemory | None:
    """Where `array` (a flat one: strings, binaries, numbers) lies in one shared mapping, or None."""
    if pa.types.is_nested(array.type) or pa.types.is_dictionary(array.type):
        return None
    buffers = array.buffers()
    present = [buffer for buffer in buffers if buffer is not None]
    if not present:
        return None
    with _LOCK:
        regions = list(_SHARED.values())
    for address, size, path in regions:
        if all(address <= buffer.address and buffer.address + buffer.size <= address + size for buffer in present):
            spans = tuple(None if buffer is None else (buffer.address - address, buffer.size) for buffer in buffers)
            return ArrayInMemory(path, size, array.type, len(array), array.offset, spans)
    return None


def chunk_of(values: Sequence | pa.Array, start: int, rows: int) -> Sequence | pa.Array | ArrayInMemory:
    """Rows start:start+rows as a worker's task takes them: an Arrow slice in memory the workers can map as
    where it lies, any other copied into buffers of its own (a slice pickles the whole array it views)."""
    if isinstance(values, pa.Array):
        piece = values.slice(start, rows)
        return in_memory(piece) or pa.concat_arrays([piece])
    return values[start:start + rows]


def as_python(values: Sequence | pa.Array | ArrayInMemory | None) -> Sequence | None:
    """A task's values as Python values (an array in shared memory mapped here first)."""
    if isinstance(values, ArrayInMemory):
        values = values.array()
    return values.to_pylist() if isinstance(values, pa.Array) else values


class TokenSlot:
    """A memory file of the run's process that a tokenizer worker writes a task's token ids into, and its
    result after them (`into_slot`), so that neither crosses the pool's socket (core/worker_pool.py) and the
    ids are read by the kernel straight into their place. `capacity`: the most tokens the task can make (its
    rows times --max-length); a task that makes more keeps them in its result."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._memory = os.memfd_create("lengthwise-token-ids", os.MFD_CLOEXEC)
        os.ftruncate(self._memory, max(capacity, 1) * 4)  # its pages exist once written
        self.path = f"/proc/{os.getpid()}/fd/{self._memory}"
        self._closed = weakref.finalize(self, os.close, self._memory)

    def read(self, reply):
        """The task's result from a worker's `reply` (an `InSlot`: read from the slot; else the result itself)."""
        if not isinstance(reply, InSlot):
            return reply
        return pickle.loads(read_exactly(self._memory, bytearray(reply.size), reply.offset))

    def copy_into(self, encoded, out: np.ndarray) -> None:
        """A task's token ids into `out` (their place in the window's array): read from the slot, or
        copied from the result where they came with it; the file is closed. The slot is read by the
        kernel (pread), not mapped: mapping and unmapping a task's pages cost the run's process more
        than the copy (~0.1 µs a row on a 2-core VM)."""
        try:
            if len(encoded.token_ids) == len(out):
                out[:] = encoded.token_ids
                return
            read_exactly(self._memory, out.view(np.uint8), 0)
        finally:
            self._closed()


@dataclass(frozen=True)
class InSlot:
    """Where a worker pickled a task's result in its slot, after the token ids' room: what the worker
    returns instead of the result (~45 KB for 2,048 rows), so a record of a few bytes crosses the pool."""

    offset: int
    size: int


def into_slot(path: str, capacity: int, result) -> InSlot:
    """In a worker: `result`'s token ids written into the run's slot at `path` (more than `capacity` tokens
    stay in the result), then the result itself pickled after them."""
    token_ids = result.token_ids
    fits = 0 < len(token_ids) <= capacity
    data = pickle.dumps(dataclasses.replace(result, token_ids=token_ids[:0]) if fits else result,
                        protocol=pickle.HIGHEST_PROTOCOL)
    offset = max(capacity, 1) * 4
    slot = os.open(path, os.O_RDWR)
    try:
        if fits:
            write_all(slot, memoryview(np.ascontiguousarray(token_ids, np.int32)).cast("B"), 0)
        write_all(slot, memoryview(data), offset)
    finally:
        os.close(slot)
    return InSlot(offset, len(data))


def write_all(file: int, data: memoryview, offset: int) -> None:
    """All of `data` into `file` from `offset` (a write may take less than it is given)."""
    written = 0
    while written < len(data):
        written += os.pwrite(file, data[written:], offset + written)


def read_exactly(file: int, buffer, offset: int):
    """`buffer` filled from `file` at `offset`, and returned; OSError if the file ends first."""
    view, start = memoryview(buffer).cast("B"), 0
    while start < len(view):
        read = os.preadv(file, [view[start:]], offset + start)
        if read <= 0:
            raise OSError(f"a memory file ended after {start} of {len(view)} bytes")
        start += read
    return buffer
