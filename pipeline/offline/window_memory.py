"""Window output memory that the run's process and its encoder process share (offline/encoder.py).

A window's outputs (a 384-float embedding: ~1.5 KB a row) live in shared memory that the encoder
process faults in (`fault_in`) and keeps mapped. The run's process hands a float-vector column that
lies in that memory to the encoder as a reference (`SharedRegions.by_reference`: which memory, where,
how long) instead of its bytes: the encoder rebuilds the same column from its own mapping
(`restore_columns`), so neither process copies the values through the socket.

Nor does the run's process put a batch's rows in their places (rows of a batch lie scattered over the
window: a store page by page that cost its device loop 0.3 µs a row, three times a copy in order): it
copies the batch, as it comes, into a ring of shared memory and tells the encoder process where it goes
(`PlacingRing`); a thread there places the rows (`place_rows`) and tells each place back. What reads a
window's outputs here first waits for every place sent (`PlacingRing.wait_placed`).
"""

from __future__ import annotations

import collections
import mmap
import os
import struct
import sys
import threading
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

PAGE_BYTES = mmap.PAGESIZE


@dataclass(frozen=True)
class ColumnReference:
    """A float-vector column whose values are bytes `offset:offset + size` of shared memory `key`;
    the table sent holds its validity (a bool column of the same name) in its place."""

    index: int
    field: pa.Field
    key: int
    offset: int
    size: int


def is_float_vector(kind: pa.DataType) -> bool:
    return pa.types.is_fixed_size_list(kind) and pa.types.is_floating(kind.value_type)


class SharedRegions:
    """The run's process's record of the shared memory the encoder process maps too: key → (address,
    bytes). A region is forgotten when its array is freed (`add` registers that); the keys forgotten
    wait in `forgotten` for the next message to the encoder."""

    def __init__(self):
        self._regions: dict[int, tuple[int, int]] = {}
        self._located: dict[int, tuple[weakref.ref, tuple[int, int]]] = {}  # id → (the array, its key and offset)
        self._next_key = 0
        self._key_lock = threading.Lock()
        self.forgotten: list[int] = []

    def new_key(self) -> int:
        with self._key_lock:
            self._next_key += 1
            return self._next_key

    def add(self, key: int, array: np.ndarray) -> None:
        """`array` (the whole mapping: its views keep it) is region `key` until it is freed (and
        forgotten before its memory is unmapped, so no later column is placed in a stale region)."""
        address, size = array.__array_interface__["data"][0], array.nbytes
        self._regions[key] = (address, size)
        weakref.finalize(array, self._forget, key)

    def _forget(self, key: int) -> None:  # before the memory is unmapped: no later column can point into it
        self._regions.pop(key, None)
        self.forgotten.append(key)

    def locate(self, array: np.ndarray) -> tuple[int, int] | None:
        """(key, offset) of `array`'s first byte in a shared region, or None (memory of this process's own);
        remembered while `array` lives (a window's array is placed into batch after batch)."""
        known = self._located.get(id(array))
        if known is not None and known[0]() is array:
            return known[1]
        start = array.__array_interface__["data"][0]
        for key, (address, size) in list(self._regions.items()):
            if address <= start and start + array.nbytes <= address + size:
                self._located[id(array)] = (weakref.ref(array, lambda _, at=id(array): self._located.pop(at, None)),
                                            (key, start - address))
                return key, start - address
        return None

    def by_reference(self, table: pa.Table) -> tuple[pa.Table, list[ColumnReference]]:
        """`table` with each float-vector column that lies whole in a shared region replaced by its
        validity, and the references that rebuild those columns; other columns travel as they are."""
        references = []
        regions = list(self._regions.items())
        for index, field in enumerate(table.schema):
            column = table.column(index)
            if not regions or not is_float_vector(field.type) or column.num_chunks != 1:
                continue
            place = _place(column.chunk(0), regions)
            if place is not None:
                references.append(ColumnReference(index, field, *place))
        for reference in references:
            table = table.set_column(reference.index, pa.field(reference.field.name, pa.bool_()),
                                     table.column(reference.index).is_valid())
        return table, references


def _place(vectors: pa.FixedSizeListArray, regions: list) -> tuple[int, int, int] | None:
    """(key, offset, bytes) of the values of `vectors` in one of `regions`, or None."""
    values = vectors.values
    if values.null_count or values.buffers()[1] is None:
        return None
    width, item = vectors.type.list_size, values.type.byte_width
    start = values.buffers()[1].address + (values.offset + vectors.offset * width) * item
    size = len(vectors) * width * item
    for key, (address, length) in regions:
        if address <= start and start + size <= address + length:
            return key, start - address, size
    return None


def fault_in(memory: int, size: int) -> mmap.mmap:
    """Map the shared memory `memory` (a file descriptor, closed here) and touch every page, so that
    the kernel allocates and zeroes them on this process's time: the mapping, kept for
    `restore_columns`."""
    try:
        mapped = mmap.mmap(memory, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(memory)
    np.frombuffer(mapped, np.uint8)[::PAGE_BYTES] = 0
    return mapped


def restore_columns(table: pa.Table, references: list[ColumnReference], mapped: dict[int, mmap.mmap]) -> pa.Table:
    """The table as the run's process built it: each referenced column rebuilt from the shared
    memory, null where its validity (in its place in `table`) says so."""
    for reference in references:
        kind = reference.field.type
        valid = table.column(reference.index).combine_chunks()
        data = pa.py_buffer(memoryview(mapped[reference.key])[reference.offset:reference.offset + reference.size])
        values = pa.Array.from_buffers(kind.value_type, reference.size // kind.value_type.byte_width, [None, data])
        vectors = pa.FixedSizeListArray.from_arrays(values, type=kind,
                                                    mask=None if valid.false_count == 0 else pc.invert(valid))
        table = table.set_column(reference.index, reference.field, vectors)
    return table


PLACE_RECORD = struct.Struct("<6q")  # a place: its number, the region's key, the array's offset there, the bytes
# of one row, the rows, where in the ring they lie (their positions as int64, then their values)
LANDED = struct.Struct("<q")  # a place's number, told back once its rows are in their places
RING_BATCHES = 8  # batches the ring holds (of its first batch's bytes), within 4-32 MiB: the placing thread
RING_BYTES = (4 * 2**20, 32 * 2**20)  # keeps up with the device loop; the run's process maps all of it
RING_ALIGN = 64


def ring_bytes(batch_bytes: int) -> int:
    """A placing ring's size for batches of `batch_bytes` (`RING_BATCHES` of them, within `RING_BYTES`)."""
    return min(RING_BYTES[1], max(RING_BYTES[0], -(-RING_BATCHES * batch_bytes // PAGE_BYTES) * PAGE_BYTES))


class PlacingRing:
    """The run's end of the encoder process's placing thread (`place_rows`). `place` copies a batch's row
    positions and values into the ring (shared memory this process maps whole: it writes there in order,
    every page already mapped) and rings the doorbell (a pipe) with where they go; the thread tells each
    place's number back on another pipe, read here by a thread of its own (where no signal handler runs, so
    an interrupt never falls between a number read and its count), and its bytes in the ring are then free.
    Places land in the order sent. `died()` makes the error that stops the run when a pipe breaks (the
    process is gone)."""

    def __init__(self, ring: np.ndarray, doorbell: int, landed: int, died: Callable[[], BaseException]):
        self._ring, self._doorbell, self._died = ring, doorbell, died
        self._head = self._tail = 0  # ring bytes handed out, and freed, since the start
        self._sent = self._landed = 0  # places sent, and landed
        self._ends: collections.deque[tuple[int, int]] = collections.deque()  # (place, its end in ring bytes)
        self._gone = False  # the landed pipe closed: the process is gone
        self._changed = threading.Condition()  # the device loop places, the writer waits, the reader counts
        self._reader = threading.Thread(target=self._read_landed, args=(landed,), name="lengthwise-landed",
                                        daemon=True)
        self._reader.start()

    def takes(self, array: np.ndarray) -> bool:
        """Whether `array`'s rows are small enough for the ring (a few to half of it)."""
        return array.strides[0] * 4 <= len(self._ring)  # a row's bytes: window arrays are C-contiguous

    def place(self, key: int, offset: int, array: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
        """`array[rows] = values` (one row at least), done by the encoder process; `array` lies at `offset`
        in region `key` (and its rows are ones the ring `takes`)."""
        row_bytes = array.strides[0]
        rows = np.asarray(rows, np.int64)
        values = np.ascontiguousarray(values, array.dtype).reshape(len(rows), -1).view(np.uint8)
        most = (len(self._ring) // 2 - RING_ALIGN) // (8 + row_bytes)  # a larger batch goes in parts
        for start in range(0, len(rows), most):
            self._place(key, offset, row_bytes, rows[start:start + most], values[start:start + most])

    def _place(self, key: int, offset: int, row_bytes: int, rows: np.ndarray, values: np.ndarray) -> None:
        capacity = len(self._ring)
        size = -(-len(rows) * (8 + row_bytes) // RING_ALIGN) * RING_ALIGN
        with self._changed:
            while True:
                at = self._head % capacity
                skipped = capacity - at if at + size > capacity else 0  # the ring's end is too short: start over
                if self._head + skipped + size - self._tail <= capacity:
                    break
                self._wait_for_more()
            at = 0 if skipped else at
            self._ring[at:at + rows.nbytes] = rows.view(np.uint8)
            self._ring[at + rows.nbytes:at + rows.nbytes + values.nbytes] = values.reshape(-1)
            number = self._sent + 1
            try:
                os.write(self._doorbell, PLACE_RECORD.pack(number, key, offset, row_bytes, len(rows), at))
            except OSError as error:
                raise self._died() from error
            # counted once sent: an interrupt before the write leaves nothing to wait for; one just after it,
            # a place not waited for, of a batch whose window is then never written
            self._sent, self._head = number, self._head + skipped + size
            self._ends.append((number, self._head))

    def wait_placed(self) -> None:
        """Return once every place sent so far has landed."""
        with self._changed:
            sent = self._sent
            while self._landed < sent:
                self._wait_for_more()

    def _wait_for_more(self) -> None:
        """Under the condition: wait for a number told back, or raise if the process is gone."""
        if self._gone:
            raise self._died()
        self._changed.wait()

    def _read_landed(self, pipe: int) -> None:
        """The reader thread: each number told back counted, the ring's bytes before it freed, until the pipe
        closes (the placing thread ended, or its process is gone)."""
        unread = b""  # a part of a number, read before its rest
        try:
            while True:
                try:
                    data = unread + os.read(pipe, 65536)
                except OSError:
                    data = unread
                if len(data) == len(unread):
                    return
                whole = len(data) // LANDED.size * LANDED.size
                unread = data[whole:]
                if whole:
                    with self._changed:
                        self._landed = LANDED.unpack_from(data, whole - LANDED.size)[0]
                        while self._ends and self._ends[0][0] <= self._landed:
                            self._tail = self._ends.popleft()[1]
                        self._changed.notify_all()
        finally:
            os.close(pipe)
            with self._changed:
                self._gone = True
                self._changed.notify_all()

    def close(self) -> None:
        """The placing thread sees the doorbell close and ends, and so does the reader; idempotent."""
        doorbell, self._doorbell = self._doorbell, -1
        if doorbell >= 0:
            os.close(doorbell)
            self._reader.join(timeout=5)


def place_rows(doorbell: int, landed: int, ring: mmap.mmap, mapped: dict[int, mmap.mmap]) -> None:
    """In the encoder process, on a thread of its own: each place rung on `doorbell` copied from `ring`
    into its region of `mapped`, its number then told back on `landed`, until the doorbell closes. A
    region already forgotten (its array freed in the run's process) takes nothing. A failure here ends
    the process (the run's process sees its pipes close and stops with the encoder's error)."""
    ring_view = np.frombuffer(ring, np.uint8)
    try:
        while True:
            record = _read_exactly(doorbell, PLACE_RECORD.size)
            if record is None:
                return
            number, key, offset, row_bytes, rows, at = PLACE_RECORD.unpack(record)
            region = mapped.get(key)
            if region is not None:
                positions = ring_view[at:at + 8 * rows].view(np.int64)
                values = ring_view[at + 8 * rows:at + rows * (8 + row_bytes)].reshape(rows, row_bytes)
                whole_rows = (len(region) - offset) // row_bytes
                np.frombuffer(region, np.uint8, whole_rows * row_bytes, offset).reshape(whole_rows, row_bytes)[
                    positions] = values
            os.write(landed, LANDED.pack(number))
    except BrokenPipeError:  # the run's process is gone
        return
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        os._exit(1)
    finally:
        os.close(doorbell)
        os.close(landed)  # the run's reader of the numbers sees the end


def _read_exactly(pipe: int, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        more = os.read(pipe, size - len(data))
        if not more:
            return None
        data += more
    return data
