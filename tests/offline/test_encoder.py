"""The output encoder process: a run's Parquet encoding happens in a process of its own, with the
same bytes as in the run's process; its errors travel back with their errno; it exits with its
parent; window output arrays are reused zeroed (docs/performance.md, "The host feeds the device")."""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline.offline.sink as sink_module
from pipeline.core.errors import StorageError, as_storage_error
from pipeline.core.process_memory import huge_page_switch, numpy_multiarray
from pipeline.offline.encoder import EncoderDied, OutputEncoder
from pipeline.offline.window_memory import PlacingRing, SharedRegions
from pipeline.offline.windows import OutputArrays, ProcessMemory
from tests.conftest import run_to_table


def embeddings(rows: int, start: int = 0) -> pa.Table:
    values = np.arange(start * 8, (start + rows) * 8, dtype=np.float32) / 7
    return pa.table({"id": pa.array([f"row-{i}" for i in range(start, start + rows)]),
                     "embedding": pa.FixedSizeListArray.from_arrays(pa.array(values), 8,
                                                                    mask=pa.array(np.arange(rows) % 5 == 3)),
                     "error": pa.array([None if i % 5 != 3 else "text is null" for i in range(rows)])})


def test_a_run_encodes_its_outputs_in_another_process_with_the_same_cells(tmp_path, rows_with_bad_ones,
                                                                          tiny_encoder_path, monkeypatch):
    """No output file is opened by the run's process; the encoder is a process of its own that has
    exited by the run's end and read the embeddings from the window memory it shares; the outputs
    equal those the run's process encodes itself, cell for cell."""
    encoders, opened_here, memory_in_run = [], [], []
    real_init, real_writer = OutputEncoder.__init__, pq.ParquetWriter

    def recording_init(self):
        real_init(self)
        encoders.append(self)
        memory_in_run.append((pa.default_memory_pool().backend_name, huge_page_advice()))

    def recording_writer(where, schema, *args, **kwargs):
        if "embedding" in schema.names:  # an output's, not the text-hash file's
            opened_here.append(where)
        return real_writer(where, schema, *args, **kwargs)

    referenced = []  # the embedding columns that travelled as references to shared window memory
    real_by_reference = SharedRegions.by_reference

    def recording_by_reference(regions, table):
        sent, references = real_by_reference(regions, table)
        referenced.extend(reference.field.name for reference in references)
        return sent, references

    placed = []  # rows the encoder process put in their places
    real_place = PlacingRing.place
    monkeypatch.setattr(PlacingRing, "place",
                        lambda ring, *args: placed.append(len(args[3])) or real_place(ring, *args))
    monkeypatch.setattr(OutputEncoder, "__init__", recording_init)
    monkeypatch.setattr(pq, "ParquetWriter", recording_writer)
    monkeypatch.setattr(SharedRegions, "by_reference", recording_by_reference)
    pa.set_memory_pool(pa.mimalloc_memory_pool())  # pyarrow's default on Linux, which gives freed blocks back
    multiarray = numpy_multiarray()
    multiarray._set_madvise_hugepage(True)  # numpy's default
    output, summary = run_to_table(tmp_path, "encoder", rows_with_bad_ones, [120, 80], model=tiny_encoder_path,
                                   max_length=32)
    assert [e.process.pid != os.getpid() and e.process.returncode for e in encoders] == [0]
    assert memory_in_run == [("system", False)]  # the run's process keeps what it frees, asks for no huge pages
    assert pa.default_memory_pool().backend_name == "mimalloc" and huge_page_advice()  # and is left as it was
    assert opened_here == []  # the outputs' Parquet writers were all in the encoder process
    assert output["id"].to_pylist() == rows_with_bad_ones["id"].to_pylist() and summary["rows"] == 200
    assert summary["error_rows"] == 4
    assert referenced == ["embedding", "embedding"]  # one block a shard, its values never copied to the encoder
    assert sum(placed) == 196  # every row that ran, put in its place by the encoder process

    windows, _ = run_to_table(tmp_path, "windows", rows_with_bad_ones, [120, 80], model=tiny_encoder_path,
                              max_length=32, window_rows=48)  # window memory reused, each after the encoder read it
    assert len(referenced) > 4

    monkeypatch.setattr(sink_module.ShardSink, "uses_encoder", property(lambda sink: False))
    here, _ = run_to_table(tmp_path, "here", rows_with_bad_ones, [120, 80], model=tiny_encoder_path, max_length=32)
    assert len(encoders) == 2 and len(opened_here) == 2  # one writer a shard, in this process
    assert sum(placed) == 2 * 196  # the run in windows of 48 too; none since
    assert output.equals(here)
    windows_here, _ = run_to_table(tmp_path, "windows-here", rows_with_bad_ones, [120, 80], model=tiny_encoder_path,
                                   max_length=32, window_rows=48)
    assert windows.equals(windows_here)
    for name in ("part-00000.parquet", "part-00001.parquet"):
        assert (tmp_path / "encoder-out" / name).read_bytes() == (tmp_path / "here-out" / name).read_bytes()


def huge_page_advice() -> bool:
    """Whether numpy asks for huge pages now (its switch returns the setting it replaces)."""
    switch = huge_page_switch()
    advice = switch(True)
    switch(advice)
    return advice


def test_overlapping_runs_hold_streaming_memory_until_the_last_ends_and_then_leave_the_process_as_it_was():
    from pipeline.core.process_memory import StreamingMemory

    pa.set_memory_pool(pa.mimalloc_memory_pool())
    numpy_multiarray()._set_madvise_hugepage(True)
    memory = StreamingMemory()
    memory.hold()
    memory.hold()  # a Ray actor's next shard starts while one runs
    memory.release()
    assert (pa.default_memory_pool().backend_name, huge_page_advice()) == ("system", False)
    memory.release()
    assert (pa.default_memory_pool().backend_name, huge_page_advice()) == ("mimalloc", True)


def test_an_encoder_writes_aborts_and_tells_errors_with_their_errno(tmp_path):
    encoder = OutputEncoder()
    try:
        kept, dropped = str(tmp_path / "kept.parquet"), str(tmp_path / "dropped.parquet")
        encoder.write(kept, embeddings(30))
        encoder.write(dropped, embeddings(10))
        encoder.write(kept, embeddings(20, start=30))
        assert encoder.close_file(kept) == os.path.getsize(kept)
        assert pq.read_table(kept).equals(pa.concat_tables([embeddings(30), embeddings(20, start=30)]))
        assert pq.read_metadata(kept).num_row_groups == 2  # one a table, as a writer in this process makes
        encoder.abort_file(dropped)
        assert not os.path.exists(dropped)

        nowhere = str(tmp_path / "missing" / "x.parquet")
        encoder.write(nowhere, embeddings(5))
        with pytest.raises(FileNotFoundError) as refused:
            encoder.close_file(nowhere)
        assert refused.value.errno == 2 and refused.value.filename == nowhere
        encoder.abort_file(nowhere)
        full = as_storage_error(OSError(28, "No space left on device"), nowhere)  # what the sink makes of errno 28
        assert isinstance(full, StorageError)
    finally:
        encoder.close()
    assert encoder.process.returncode == 0


def test_a_killed_encoder_stops_the_run_with_a_clear_error(tmp_path):
    encoder = OutputEncoder()
    path = str(tmp_path / "a.parquet")
    encoder.write(path, embeddings(10))
    encoder.process.kill()
    encoder.process.wait()
    with pytest.raises(EncoderDied, match=r"the output encoder process \(pid \d+\) exited with code -9; the shards "
                                          r"not committed are redone by a rerun of the same command"):
        for _ in range(100):  # the first writes may still fit the socket's buffer
            encoder.write(path, embeddings(1000))
        encoder.close_file(path)
    encoder.close()


PARENT = """
import sys, time
from pipeline.offline.encoder import OutputEncoder
encoder = OutputEncoder()
encoder.write(sys.argv[1], __import__("tests.offline.test_encoder", fromlist=["x"]).embeddings(10))
print(encoder.process.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM])
def test_the_encoder_exits_with_its_parent_and_leaves_no_file_open(tmp_path, stop):
    """SIGKILL of the run's process (or a SIGTERM that ends it without cleanup) leaves no encoder behind."""
    path = tmp_path / "open.parquet"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(path)], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    pid = int(parent.stdout.readline())
    assert psutil.Process(pid).cmdline()[1:3] == ["-m", "pipeline.offline.encoder"]
    parent.send_signal(stop)
    parent.wait()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the encoder outlived its parent"
        time.sleep(0.05)


def test_output_arrays_come_back_as_left_and_no_more_are_kept_than_asked():
    arrays = OutputArrays(keep=1)
    first = arrays.take((4, 3), np.float32)
    assert not first.any()  # a new one is zeroed
    first[:] = 7
    second = arrays.take((4, 3), np.float32)
    arrays.give_back([first, second])
    again = arrays.take((4, 3), np.float32)
    assert again is first and (again == 7).all()  # the kept one, as the last window left it
    assert arrays.take((4, 3), np.float32) is not second  # only one was kept
    assert arrays.take((5, 3), np.float32).shape == (5, 3)


def test_a_window_reads_zeros_where_it_stored_nothing_in_an_array_a_window_before_it_filled(monkeypatch):
    """Rows that did not run (an error, a failed row; a model that did not run them) read as zeros, not as
    the outputs an earlier window left in the kept array; a duplicate takes its first copy's."""
    from pipeline.core.tokenize import EncodedRows
    from pipeline.offline import windows
    from pipeline.offline.source import RowBlock

    monkeypatch.setattr(windows, "OUTPUT_ARRAYS", OutputArrays(keep=1))

    def window(rows: int) -> windows.Window:
        block = RowBlock(0, 0, pa.array(range(rows)), pa.array(["x"] * rows), True)
        return windows.Window([block], EncodedRows(np.zeros(rows, np.int32), np.arange(rows + 1),
                                                   np.zeros(rows, bool), [None] * rows, 0.0))

    earlier = window(6)
    earlier.store(np.arange(6), {"embedding": np.full((6, 2), 9, np.float32), "score": np.full(6, 5, np.float32)})
    kept = earlier.outputs["embedding"]
    earlier.release_outputs()
    later = window(6)
    later.store(np.array([4, 1]), {"embedding": np.array([[1, 2], [3, 4]], np.float32),
                                   "score": np.array([7, 8], np.float32)})
    later.store(np.array([2]), {"embedding": np.array([[5, 6]], np.float32)})  # a model that scores no row
    later.duplicate_of = np.array([0, 1, 2, 3, 4, 1])
    assert later.copy_duplicates(0, 6) == 1
    outputs = later.row_outputs(0, 6, fold=None)
    assert later.outputs["embedding"] is kept
    assert outputs["embedding"].tolist() == [[0, 0], [3, 4], [5, 6], [0, 0], [1, 2], [3, 4]]
    assert outputs["score"].tolist() == [0, 8, 0, 0, 7, 8]


class RecordedMemory(ProcessMemory):
    def __init__(self):
        self.made = []

    def zeros(self, shape, dtype):
        self.made.append(shape)
        return np.zeros(shape, dtype)


def test_output_arrays_kept_from_another_memory_are_not_handed_out():
    """A run with an encoder after one without (one process: `keep_pool`, a Ray actor) stores into
    memory the encoder maps, not into arrays the run before kept."""
    arrays, memory = OutputArrays(keep=2), RecordedMemory()
    kept = arrays.take((4, 3), np.float32)
    arrays.give_back([kept])
    arrays.memory = memory
    assert arrays.take((4, 3), np.float32) is not kept and memory.made == [(4, 3)]
    # one taken before the change and given back after it (a shard still being written) is let go too
    before = arrays.take((2, 3), np.float32)
    arrays.memory = RecordedMemory()
    arrays.give_back([before])
    assert arrays.take((2, 3), np.float32) is not before


def test_the_encoder_puts_rows_in_their_places_and_the_run_touches_no_page_of_them():
    """Batches of rows in scattered places, more bytes than the ring holds, one batch larger than half of
    it, a one-value-a-row array, an empty batch: after `wait_placed` every row holds its values, and the
    run's process has mapped none of the window's pages (it copied the rows into the ring only)."""
    encoder = OutputEncoder()
    try:
        vectors, scores = encoder.shared_zeros((40_000, 384), np.float32), encoder.shared_zeros((40_000,), np.float32)
        order = np.random.default_rng(0).permutation(40_000)
        for start, size in [(0, 0), (0, 531), (531, 30_000), (30_531, 4096), (34_627, 5373)]:
            rows = order[start:start + size]
            encoder.place(vectors, rows, np.repeat(rows[:, None], 384, axis=1).astype(np.float32))
            encoder.place(scores, rows, -rows.astype(np.float32))
        assert mapped_kib(vectors) == 0  # the run's process never touched them
        encoder.wait_placed()
        assert (vectors == np.arange(40_000, dtype=np.float32)[:, None]).all()
        assert (scores == -np.arange(40_000, dtype=np.float32)).all()
        own = np.zeros((10, 2), np.float32)  # memory of this process's own: placed here
        encoder.place(own, np.array([3, 7]), np.ones((2, 2), np.float32))
        assert own.sum() == 4
    finally:
        encoder.close()


def mapped_kib(array: np.ndarray) -> int:
    """Resident kB of the mapping that holds `array` (its pages this process has mapped in)."""
    address, mapping = array.__array_interface__["data"][0], None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                low, high = (int(part, 16) for part in head.split("-"))
                mapping = low <= address < high
            elif mapping and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError("no mapping holds the array")


def test_a_wait_for_placed_rows_holds_no_place_back_and_the_ring_s_reader_ends_with_the_encoder():
    """The writer waiting for rows the encoder has not placed yet (here: it is stopped) does not hold the device
    loop's next place back while the ring has room; once it goes on, both land; closing ends the thread that
    reads the numbers told back."""
    encoder = OutputEncoder()
    try:
        vectors = encoder.shared_zeros((1000, 384), np.float32)
        encoder.place(vectors, np.arange(10), np.ones((10, 384), np.float32))
        encoder.wait_placed()
        os.kill(encoder.process.pid, signal.SIGSTOP)
        while psutil.Process(encoder.process.pid).status() != psutil.STATUS_STOPPED:
            time.sleep(0.01)
        encoder.place(vectors, np.arange(10, 20), np.full((10, 384), 2, np.float32))
        waiter = threading.Thread(target=encoder.wait_placed)
        waiter.start()
        time.sleep(0.2)
        assert waiter.is_alive()  # the rows are not placed while the encoder is stopped
        placed = threading.Thread(target=encoder.place, args=(vectors, np.arange(20, 30),
                                                              np.full((10, 384), 3, np.float32)))
        placed.start()
        placed.join(timeout=5)
        assert not placed.is_alive()  # the next place went into the ring while the writer waited
        os.kill(encoder.process.pid, signal.SIGCONT)
        waiter.join(timeout=10)
        encoder.wait_placed()
        assert vectors[:30, 0].tolist() == [1] * 10 + [2] * 10 + [3] * 10 and not vectors[30:].any()
    finally:
        os.kill(encoder.process.pid, signal.SIGCONT)
        encoder.close()
    assert "lengthwise-landed" not in [thread.name for thread in threading.enumerate()]


def test_a_killed_encoder_stops_the_placing_of_rows_with_a_clear_error():
    encoder = OutputEncoder()
    try:
        vectors = encoder.shared_zeros((1000, 384), np.float32)
        encoder.place(vectors, np.arange(10), np.ones((10, 384), np.float32))
        encoder.wait_placed()
        encoder.process.kill()
        encoder.process.wait()
        with pytest.raises(EncoderDied, match=r"the output encoder process \(pid \d+\) exited with code -9"):
            encoder.place(vectors, np.arange(10, 20), np.ones((10, 384), np.float32))
            encoder.wait_placed()
    finally:
        encoder.close()


def test_window_output_arrays_come_from_memory_the_encoder_process_faulted_in():
    """The encoder process allocates the pages (its minor faults grow by about one per page); the
    array here is zeroed, writable, and shares no memory with the next one."""
    encoder = OutputEncoder()
    try:
        encoder.shared_zeros((1, 1), np.float32)  # the process is up and serving
        before = _minor_faults(encoder.process.pid)
        values = encoder.shared_zeros((1024, 384), np.float32)
        assert _minor_faults(encoder.process.pid) - before >= 1024 * 384 * 4 // 4096
        assert values.shape == (1024, 384) and values.dtype == np.float32 and not values.any()
        values[[5, 1000]] = 3.5
        other = encoder.shared_zeros((1024, 384), np.float32)
        assert not other.any() and values.sum() == 2 * 384 * 3.5
    finally:
        encoder.close()
    assert encoder.process.returncode == 0
    values[0] = 1.0  # the memory outlives the process that faulted it in
    assert values[0, 0] == 1.0


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])


def test_window_memory_may_be_reused_once_the_encoder_has_settled(tmp_path):
    """A column in shared window memory is read by the encoder process when it encodes the table,
    later than `write` returns (overwriting it at once changed some files' values): after `settle`
    the memory may be overwritten (the next window's outputs) and each file holds what was sent."""
    encoder = OutputEncoder()
    try:
        values = encoder.shared_zeros((3000, 16), np.float32)
        for window in range(12):
            values[:] = window
            table = pa.table({"embedding": pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), 16)})
            encoder.write(str(tmp_path / f"{window}.parquet"), table)
            encoder.settle()
            values[:] = -1
            encoder.close_file(str(tmp_path / f"{window}.parquet"))
    finally:
        encoder.close()
    assert [np.unique(pq.read_table(tmp_path / f"{window}.parquet")["embedding"].combine_chunks().values).tolist()
            for window in range(12)] == [[window] for window in range(12)]
