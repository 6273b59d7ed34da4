"""Reading shards in a process of its own, so that the run's process decodes no input.

Decoding a shard's id, text and kept columns cost the run's reading thread ~0.8 µs a row of the
short texts of `benchmarks/host_rate.py` (docs/performance.md, "The host feeds the device"). A
reader process (offline/child_process.py: a fresh interpreter that exits with its parent) runs
`read_blocks` itself, with its retries, and hands each block over as an Arrow IPC stream in a
memory file of its own (`memfd`): the run's process maps it and takes the block's arrays from the
mapping without copying or decoding them, and its tokenizer workers map it too
(core/shared_arrays.py). Blocks are the same as `read_blocks` gives in the run's process, failures
(a row-less block with its `failure`) and errors included; a reader's log lines are logged by the
run's process.

Messages on one socket: ("read", arguments of read_blocks) starts a stream, each ("next",) is
answered by ("block", what the block is) with the memory's file descriptor after it, or ("end",),
or ("error", the exception); ("log", logger, level, message) may come first.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import threading
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection

import pyarrow as pa

from pipeline.core.shared_arrays import share
from pipeline.offline.child_process import ForwardLogs, HelperProcess, child_channel, ipc_stream_bytes, portable
from pipeline.offline.source import RowBlock, Shard, read_blocks

READER_PROCESS_MIN_ROWS = 100_000  # fewer rows are read in the run's process: a reader's start (~0.4 s of CPU,
# its imports) costs more than the reading it moves


class ReaderDied(RuntimeError):
    """The reader process is gone (killed, out of memory): the run stops, and a rerun redoes the shards
    it had not committed."""


class ShardReader(HelperProcess):
    """The run's handle on one reader process; one stream of blocks at a time (`blocks`)."""

    MODULE, NAME = "pipeline.offline.reader", "shard reader"
    Died = ReaderDied
    available = hasattr(os, "memfd_create")  # Linux; elsewhere the run's process reads

    def __init__(self):
        super().__init__()  # block memory's descriptors travel on the socket
        self.idle = True  # no stream begun and not ended: reusable for the next one

    def blocks(self, shards: Sequence[Shard], id_column: str, text_column: str, block_rows: int,
               storage_options: dict | None = None, keep_columns: Sequence[str] = (),
               pair_column: str | None = None) -> Iterator[RowBlock]:
        """`read_blocks` of these arguments, read by the process; a stream left before its end leaves the
        reader not `idle` (it is closed, not reused)."""
        self.idle = False
        self._send(("read", (list(shards), id_column, text_column, block_rows, storage_options or {},
                             list(keep_columns), pair_column)))
        while True:
            self._send(("next",))
            message = self._receive()
            if message[0] == "end":
                self.idle = True
                return
            if message[0] == "error":
                raise message[1]
            yield self._block(message[1])

    def _block(self, described: tuple) -> RowBlock:
        """The block the process read, its arrays in the memory it sent (mapped, never copied)."""
        shard_index, first_row, is_last_of_shard, failure, has_memory = described
        if not has_memory:
            nothing = pa.array([], pa.string())
            return RowBlock(shard_index, first_row, nothing, nothing, is_last_of_shard, failure=failure)
        memory = self._receive_descriptor()
        try:
            mapped = mmap.mmap(memory, os.fstat(memory).st_size, prot=mmap.PROT_READ,
                               flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            os.close(memory)
            raise
        batch = pa.ipc.open_stream(share(mapped, memory)).read_next_batch()  # the file is closed with the mapping
        columns = dict(zip(batch.schema.names, batch.columns))
        return RowBlock(shard_index, first_row, columns.pop("ids"), columns.pop("texts"), is_last_of_shard,
                        errors=columns.pop("errors", None), pairs=columns.pop("pairs", None),
                        kept={name.removeprefix("kept:"): values for name, values in columns.items()})



class ShardReaders:
    """The reader processes of one runner, kept from one stream to the next: a Ray actor reads its next
    shard while the current one runs, so two streams may be open at once."""

    def __init__(self):
        self._idle: list[ShardReader] = []
        self._lock = threading.Lock()

    def blocks(self, shards: Sequence[Shard], *args, **kwargs) -> Iterator[RowBlock]:
        """`read_blocks(shards, *args, **kwargs)`: in a reader process when the shards hold at least
        READER_PROCESS_MIN_ROWS rows and this system has one, else here."""
        if not ShardReader.available or sum(shard.num_rows for shard in shards) < READER_PROCESS_MIN_ROWS:
            yield from read_blocks(shards, *args, **kwargs)
            return
        with self._lock:
            reader = self._idle.pop() if self._idle else None
        reader = reader or ShardReader()
        try:
            yield from reader.blocks(shards, *args, **kwargs)
        finally:
            if reader.idle:
                with self._lock:
                    self._idle.append(reader)
            else:  # left in the middle of its stream (an error, --fail-fast, a stop): not reused
                reader.close()

    def close(self) -> None:
        """Stop the idle readers (one still streaming stops when its stream is left)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for reader in idle:
            reader.close()


def block_memory(block: RowBlock) -> int:
    """A memory file holding `block`'s arrays as an Arrow IPC stream: the file descriptor (the caller
    closes it)."""
    columns = {"ids": block.ids, "texts": block.texts,
               **({"errors": block.errors} if block.errors is not None else {}),
               **({"pairs": block.pairs} if block.pairs is not None else {}),
               **{f"kept:{name}": values for name, values in block.kept.items()}}
    batch = pa.RecordBatch.from_arrays(list(columns.values()), names=list(columns))
    size = ipc_stream_bytes(batch, pa.MockOutputStream())
    memory = os.memfd_create("lengthwise-shard-block", os.MFD_CLOEXEC)
    try:
        os.ftruncate(memory, size)
        ipc_stream_bytes(batch, pa.FixedSizeBufferWriter(pa.py_buffer(mmap.mmap(memory, size))))  # unmapped when dropped
    except BaseException:
        os.close(memory)
        raise
    return memory


def serve(connection: Connection, channel: socket.socket) -> None:
    """The reader process: stream the blocks asked for until the socket closes."""
    forward = ForwardLogs(connection.send, threading.get_ident())  # the reading thread's (a transient error's retry)
    logging.getLogger("pipeline").addHandler(forward)
    try:
        _serve(connection, channel)
    finally:
        logging.getLogger("pipeline").removeHandler(forward)


def _serve(connection: Connection, channel: socket.socket) -> None:
    blocks: Iterator[RowBlock] = iter(())
    while True:
        try:
            kind, *arguments = connection.recv()
        except (EOFError, OSError):
            return
        if kind == "read":
            blocks = read_blocks(*arguments[0])
            continue
        try:
            block = next(blocks, None)
        except Exception as error:
            connection.send(("error", portable(error)))
            continue
        if block is None:
            connection.send(("end",))
            continue
        has_memory = block.failure is None
        connection.send(("block", (block.shard_index, block.first_row, block.is_last_of_shard, block.failure,
                                   has_memory)))
        if has_memory:
            memory = block_memory(block)
            try:
                socket.send_fds(channel, [b"b"], [memory])
            finally:
                os.close(memory)


def main() -> None:
    serve(*child_channel())


if __name__ == "__main__":
    main()
