"""The run's helper processes (the output encoder, the shard reader): how each starts, stops and tells errors.

Each is a fresh interpreter (`python -m MODULE FD`, as spawn starts one: never a fork of a process that
may hold CUDA) talking to the run over one socket: pickled messages on a `Connection`, file descriptors
beside them. It ignores Ctrl-C and SIGTERM (its parent decides how to stop) and exits when its parent
does, even by SIGKILL: it sees its socket close, or its parent change.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pyarrow as pa

from pipeline.core.process_memory import keep_freed_memory

CLOSE_TIMEOUT_S = 30.0  # a helper told to stop that has not exited by then is killed


def start_child(module: str) -> tuple[subprocess.Popen, socket.socket]:
    """Start `python -m module` with one end of a socket pair: the process and this process's end."""
    ours, theirs = socket.socketpair()
    package_root = str(Path(__file__).resolve().parents[2])  # where `pipeline` is imported from
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    process = subprocess.Popen([sys.executable, "-m", module, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                               stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": path})
    theirs.close()
    return process, ours


def child_channel() -> tuple[Connection, socket.socket]:
    """In the child: signals left to the parent, an exit with it, Arrow's memory kept for the next block;
    the socket it was started with, as a connection and as a socket (for file descriptors)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and a group's SIGTERM reach here too: the parent decides
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), name="lengthwise-parent-watch",
                     daemon=True).start()
    keep_freed_memory()
    channel = socket.socket(fileno=int(sys.argv[1]))
    return Connection(os.dup(channel.fileno())), channel


def stop_child(process: subprocess.Popen, connection: Connection, channel: socket.socket) -> None:
    """Close the socket (the child ends its loop and exits) and wait for it; idempotent."""
    connection.close()
    channel.close()
    try:
        process.wait(timeout=CLOSE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def exit_code(process: subprocess.Popen) -> int | None:
    """The exit code of a child whose socket broke (None: it did not exit within 5 s)."""
    try:
        return process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return None


def ipc_stream_bytes(table: pa.Table | pa.RecordBatch, sink) -> int:
    """Write `table` (a table or one record batch) to `sink` as an Arrow IPC stream: the bytes written. Tables
    travel so between the run and its helpers."""
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write(table)
    return sink.tell()


def portable(error: BaseException) -> BaseException:
    """`error` as it can travel to the parent: itself (an OSError keeps its errno), or its words."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def exit_with_parent(parent: int) -> None:
    """A parent killed while this process works: exit without waiting for the socket's end."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)
