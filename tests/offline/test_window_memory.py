"""Window output memory shared with the encoder process: a float-vector column in it travels as a
reference and is rebuilt cell for cell; anything else travels as it is; a freed region is forgotten."""

import gc
import mmap

import numpy as np
import pyarrow as pa

from jobs.base import fixed_size_list
from pipeline.offline.window_memory import SharedRegions, restore_columns


def shared_region(regions: SharedRegions, rows: int, width: int) -> tuple[int, mmap.mmap, np.ndarray]:
    memory = mmap.mmap(-1, rows * width * 4, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(memory, np.uint8)
    key = regions.new_key()
    regions.add(key, whole)
    return key, memory, whole.view(np.float32).reshape(rows, width)


def test_a_vector_column_in_shared_memory_travels_as_a_reference_and_comes_back_the_same():
    regions = SharedRegions()
    key, memory, values = shared_region(regions, 40, 6)
    values[:] = np.arange(240, dtype=np.float32).reshape(40, 6) / 7
    valid = np.arange(10) % 4 != 1
    elsewhere = np.ones((10, 6), np.float32)
    table = pa.table({"id": pa.array([f"r{i}" for i in range(10)]),
                      "embedding": fixed_size_list(values[25:35], valid),  # rows 25:35, at an offset
                      "copied": fixed_size_list(elsewhere, valid),  # not in shared memory: sent as it is
                      "sliced": fixed_size_list(values, np.ones(40, bool)).slice(30, 10)})
    sent, references = regions.by_reference(table)
    assert [(r.field.name, r.key, r.offset, r.size) for r in references] == [
        ("embedding", key, 25 * 6 * 4, 10 * 6 * 4), ("sliced", key, 30 * 6 * 4, 10 * 6 * 4)]
    assert sent["embedding"].to_pylist() == valid.tolist() and sent["copied"].equals(table["copied"])
    shared_copy = pa.ipc.open_stream(_stream(sent)).read_all()  # as the encoder receives it
    assert restore_columns(shared_copy, references, {key: memory}).equals(table)


def test_a_freed_region_is_forgotten_and_no_longer_placed():
    regions = SharedRegions()
    key, memory, values = shared_region(regions, 8, 4)
    table = pa.table({"embedding": fixed_size_list(values, np.ones(8, bool))})
    assert len(regions.by_reference(table)[1]) == 1
    del table, values
    gc.collect()
    assert regions.forgotten == [key] and regions.by_reference(
        pa.table({"embedding": fixed_size_list(np.ones((8, 4), np.float32), np.ones(8, bool))}))[1] == []


def _stream(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()
