"""Parquet encoding in a process of its own, so that the run's process hands each output table
over as Arrow buffers and spends nothing on its Parquet pages (docs/performance.md, "The host
feeds the device": encoding a 384-float embedding cost the run's process ~4 µs a row).

The run's process keeps everything that decides what is committed: it makes the folders, counts
the rows, checks the lock and the attempt's token, renames and marks. The encoder process only
opens a temporary file, appends the tables it is sent and closes it (or removes it) when told.
It is a helper process (offline/child_process.py: a fresh interpreter that leaves Ctrl-C and SIGTERM
to its parent and exits with it): when its socket closes it removes the temporary files it still
held open; when its parent is killed it leaves them to the rerun, which removes a killed attempt's
temporary files.

It also holds the memory of the run's window output arrays (`shared_zeros`): it faults their pages in
(the kernel's zeroing and mapping of fresh pages, touched row by row as batches are stored, cost the
device loop 2.4-3 µs a row of system time), and a thread of its places each batch's rows there
(`place`, window_memory.py's `PlacingRing`): the run's process copies a batch in order into a ring and
never touches the window's pages, nor maps them in (mapping every page and unmapping them cost it
0.23 µs a row of a 128,000-row run).

Messages on one socket: (kind, path) pickled, each "write" followed by its table as an Arrow IPC
stream, each "fault" by the memory's file descriptor, "ring" by the ring's and its two pipes'; replies
(kind, path, value). A write is not answered (the socket's buffer and the process's pace bound what is
in flight); a failed write is told at once ("broken") and then answers the file's close.
"""

from __future__ import annotations

import mmap
import os
import socket
import threading
from multiprocessing.connection import Connection

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.offline.child_process import HelperProcess, child_channel, ipc_stream_bytes, portable
from pipeline.offline.window_memory import (PlacingRing, SharedRegions, fault_in, is_float_vector, place_rows,
                                            restore_columns, ring_bytes)


def parquet_writer_options(schema: pa.Schema) -> dict:
    """How output files are encoded (benchmarks/writer.py, docs/performance.md "The output writer"):
    dictionary pages only for text columns (ids, labels, errors repeat; float vectors never do, and
    dictionary-encoding a 384-float embedding column halved the writer's rows/s); zstd for every
    column but float vectors, which are stored uncompressed: zstd saved 8% of a MiniLM embedding's
    bytes and cost the writer a third of its rows/s."""
    text = [field.name for field in schema
            if pa.types.is_string(field.type) or pa.types.is_large_string(field.type)
            or pa.types.is_dictionary(field.type)
            or (pa.types.is_list(field.type) and pa.types.is_string(field.type.value_type))]
    return {"compression": {field.name: "none" if is_float_vector(field.type) else "zstd" for field in schema},
            "use_dictionary": text}


class ParquetFile:
    """One output file as it is encoded, in this process or in the encoder's: a Parquet writer on an
    open file, and the file's bytes once closed."""

    def __init__(self, file, schema: pa.Schema):
        self.file = file
        self.writer = pq.ParquetWriter(file, schema, **parquet_writer_options(schema))

    def write(self, table: pa.Table) -> None:
        self.writer.write_table(table)

    def close(self) -> int:
        """Finish the file (an object store uploads here): its bytes."""
        try:
            self.writer.close()
            return self.file.tell()
        finally:
            self.file.close()


class EncoderDied(RuntimeError):
    """The encoder process is gone (killed, out of memory): the run stops, and a rerun redoes the
    shards it had not committed."""


class OutputEncoder(HelperProcess):
    """The run's handle on its encoder process; safe to share between threads. `close` stops it once its
    files are closed or removed."""

    MODULE, NAME = "pipeline.offline.encoder", "output encoder"
    Died = EncoderDied
    shares_memory = hasattr(os, "memfd_create")  # `shared_zeros` (Linux); elsewhere windows keep their own memory

    def __init__(self):
        super().__init__()  # window memory's descriptors travel on the socket (`shared_zeros`)
        self._broken: dict[str, BaseException] = {}  # path → the error its write met, told ahead of its close
        self._lock = threading.Lock()
        self._buffer: pa.Buffer | None = None  # the last table's IPC stream (`_serialized`)
        self._shared = SharedRegions()  # window output memory the process maps too (`shared_zeros`)
        self._ring: PlacingRing | None = None  # started at the first `place`

    def write(self, path: str, table: pa.Table) -> None:
        """Append `table` to the Parquet file at `path` (opened at its first table); raises the
        error an earlier write to `path` met."""
        with self._lock:
            while self._connection.poll():
                self._receive()
            if path in self._broken:
                raise self._broken.pop(path)
            table, references = self._shared.by_reference(table)
            self._send(("write", path, references), self._serialized(table))

    def _serialized(self, table: pa.Table) -> memoryview:
        """`table` as an Arrow IPC stream in a buffer kept from one table to the next: one copy of its
        values, into memory already mapped (a new buffer each time page-faulted all of it in)."""
        size = ipc_stream_bytes(table, pa.MockOutputStream())
        if self._buffer is None or self._buffer.size < size:
            self._buffer = pa.allocate_buffer(size + size // 4, resizable=False)
        ipc_stream_bytes(table, pa.FixedSizeBufferWriter(self._buffer))
        return memoryview(self._buffer)[:size]

    def shared_zeros(self, shape: tuple, dtype: np.dtype) -> np.ndarray:
        """A zeroed array in shared memory whose pages the encoder process has faulted in and keeps
        mapped: its rows are put in their places there (`place`), and its float-vector columns reach
        the encoder as references (window_memory.py). This process maps it without touching a page."""
        size = max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1)
        memory = os.memfd_create("lengthwise-window-outputs", os.MFD_CLOEXEC)
        try:
            os.ftruncate(memory, size)
            key = self._shared.new_key()
            self._hand_over(("fault", (key, size)), [memory], "faulted")
            mapped = mmap.mmap(memory, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(memory)  # the mapping keeps the memory; it is freed with the array
        whole = np.frombuffer(mapped, np.uint8)
        self._shared.add(key, whole)
        return whole[:int(np.prod(shape)) * np.dtype(dtype).itemsize].view(dtype).reshape(shape)

    zeros = shared_zeros  # as a window memory (windows.py's OutputArrays.memory)

    def place(self, array: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
        """`array[rows] = values`: by the encoder process for an array of `shared_zeros` (here for
        another, or for rows too wide for the ring); read it after `wait_placed`."""
        if not len(rows):
            return
        where = self._shared.locate(array)
        ring = self._placing_ring(values.nbytes) if where is not None else None
        if ring is None or not ring.takes(array):
            array[rows] = values
            return
        ring.place(*where, array, rows, values)

    def wait_placed(self) -> None:
        """Return once every row `place` handed to the encoder process is in its place."""
        if self._ring is not None:
            self._ring.wait_placed()

    def _placing_ring(self, batch_bytes: int) -> PlacingRing:
        """The ring the rows to place travel in (sized by the first batch), and the encoder's thread that
        places them, started once."""
        if self._ring is None:
            size = ring_bytes(batch_bytes)
            memory = os.memfd_create("lengthwise-placing-ring", os.MFD_CLOEXEC)
            doorbell_read, doorbell_write = os.pipe()
            landed_read, landed_write = os.pipe()
            try:
                os.ftruncate(memory, size)
                self._hand_over(("ring", size), [memory, doorbell_read, landed_write], "ringed")
                mapped = mmap.mmap(memory, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            except BaseException:
                os.close(doorbell_write)
                os.close(landed_read)
                raise
            finally:
                for descriptor in (memory, doorbell_read, landed_write):  # the encoder holds its own now
                    os.close(descriptor)
            self._ring = PlacingRing(np.frombuffer(mapped, np.uint8), doorbell_write, landed_read, self._died)
        return self._ring

    def close(self) -> None:
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.close()
        super().close()

    def _hand_over(self, message: tuple, descriptors: list[int], reply: str) -> None:
        """Send `message` with `descriptors` beside it and wait for the encoder's `reply`."""
        with self._lock:
            self._send(message)
            try:
                socket.send_fds(self._socket, [b"f"], descriptors)
            except OSError as error:
                raise self._died() from error
            while self._receive()[0] != reply:
                pass

    def settle(self) -> None:
        """Return once the encoder process has read every table sent so far: the window memory they
        refer to may then be reused."""
        self._request("settle", None)

    def close_file(self, path: str) -> int:
        """Finish the file at `path`: the bytes it holds; raises the error its writing met."""
        return self._request("close", path)

    def abort_file(self, path: str) -> None:
        """Close the file at `path` if open and remove it."""
        self._request("abort", path)

    def _request(self, kind: str, path: str):
        with self._lock:
            self._send((kind, path))
            while True:
                reply, replied_path, value = self._receive()
                if replied_path == path and reply in ("closed", "aborted", "failed", "settled"):
                    self._broken.pop(path, None)
                    if reply == "failed":
                        raise value
                    return value

    def _send(self, message: tuple, data: memoryview | None = None) -> None:  # window memory and tables too
        try:
            while self._shared.forgotten:  # window memory this process freed: the encoder unmaps it too
                self._connection.send(("forget", self._shared.forgotten.pop()))
            self._connection.send(message)
            if data is not None:
                self._connection.send_bytes(data)
        except OSError as error:
            raise self._died() from error

    def _receive(self) -> tuple:
        message = super()._receive()
        if message[0] == "broken":
            self._broken[message[1]] = message[2]
        return message


def serve(connection: Connection, channel: socket.socket) -> None:
    """The encoder process: write tables into their files until the socket closes; fault in the
    shared memory it is handed (on `channel`, the same socket)."""
    open_files: dict[str, ParquetFile] = {}
    failed: dict[str, BaseException] = {}  # path → the error its writing met
    mapped: dict = {}  # key → window memory of the parent's, faulted in here (window_memory.py)

    def drop(path: str) -> None:
        file = open_files.pop(path, None)
        try:
            if file is not None:
                file.close()
        except Exception:  # the storage that failed the write (a full disk) may fail the close: the file goes
            pass
        if os.path.exists(path):
            os.remove(path)

    try:
        while True:
            try:
                kind, path, *references = connection.recv()
                data = connection.recv_bytes() if kind == "write" else None
            except (EOFError, OSError):  # the parent is gone (SIGKILL), even between a table's header and bytes
                return
            if kind == "write":
                if path in failed:
                    continue
                try:
                    table = restore_columns(pa.ipc.open_stream(data).read_all(), references[0], mapped)
                    if path not in open_files:
                        open_files[path] = ParquetFile(open(path, "wb"), table.schema)
                    open_files[path].write(table)
                except Exception as error:
                    failed[path] = error
                    connection.send(("broken", path, portable(error)))
            elif kind == "close":
                try:
                    if path in failed:
                        raise failed.pop(path)
                    connection.send(("closed", path, open_files.pop(path).close()))
                except Exception as error:  # the parent's abort removes the file
                    connection.send(("failed", path, portable(error)))
            elif kind == "abort":
                failed.pop(path, None)
                drop(path)
                connection.send(("aborted", path, None))
            elif kind == "fault":
                _, (memory,), _, _ = socket.recv_fds(channel, 1, 1)
                key, size = path
                mapped[key] = fault_in(memory, size)
                connection.send(("faulted", None, None))
            elif kind == "ring":  # rows to place come through it (window_memory.py), placed on a thread
                _, (memory, doorbell, landed), _, _ = socket.recv_fds(channel, 1, 3)
                threading.Thread(target=place_rows, args=(doorbell, landed, fault_in(memory, path), mapped),
                                 name="lengthwise-placing", daemon=True).start()
                connection.send(("ringed", None, None))
            elif kind == "forget":
                mapped.pop(path, None)  # unmapped once no table still holds it
            elif kind == "settle":
                connection.send(("settled", None, None))
    except (BrokenPipeError, ConnectionResetError):  # the parent went while it was being answered
        return
    finally:  # the parent is gone or done: nothing it did not close is kept
        for path in list(open_files):
            drop(path)


def main() -> None:
    serve(*child_channel())


if __name__ == "__main__":
    main()
