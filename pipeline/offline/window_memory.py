"""Window output memory that the run's process and its encoder process share (offline/encoder.py).

A window's outputs (a 384-float embedding: ~1.5 KB a row) live in shared memory that the encoder
process faults in (`fault_in`) and keeps mapped. The run's process then stores into pages already
there, and hands a float-vector column that lies in that memory to the encoder as a reference
(`SharedRegions.by_reference`: which memory, where, how long) instead of its bytes: the encoder
rebuilds the same column from its own mapping (`restore_columns`), so neither process copies the
values through the socket.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
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
