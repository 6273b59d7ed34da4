"""The run's helper processes (the output encoder, the shard reader): how each starts, stops and tells errors
(`HelperProcess`, the run's end of one).

Each is a fresh interpreter (`python -m MODULE FD`, as spawn starts one: never a fork of a process that
may hold CUDA) talking to the run over one socket: pickled messages on a `Connection`, file descriptors
beside them. It ignores Ctrl-C and SIGTERM (its parent decides how to stop) and exits when its parent
does, even by SIGKILL: it sees its socket close, or its parent change. Its log lines travel as ("log", logger,
level, message) messages (`ForwardLogs`), logged by the run's process as it receives them.
"""

from __future__ import annotations

import logging
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

from pipeline.core.process_memory import prepare_streaming_memory

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
    prepare_streaming_memory()
    channel = socket.socket(fileno=int(sys.argv[1]))
    return Connection(os.dup(channel.fileno())), channel


class HelperProcess:
    """The run's end of a helper process: the process, the socket file descriptors travel on and a
    connection on that socket for pickled messages. A subclass names its `MODULE`, its `NAME` and the
    error (`Died`) that stops the run when the process is gone."""

    MODULE: str
    NAME: str
    Died: type[RuntimeError]

    def __init__(self):
        self.process, self._socket = start_child(self.MODULE)
        self._connection = Connection(os.dup(self._socket.fileno()))

    def _send(self, message: tuple) -> None:
        try:
            self._connection.send(message)
        except OSError as error:
            raise self._died() from error

    def _receive(self) -> tuple:
        """The next message that is not a log line: those the process forwarded are logged here, as they come."""
        while True:
            try:
                message = self._connection.recv()
            except (EOFError, OSError) as error:
                raise self._died() from error
            if message[0] != "log":
                return message
            logging.getLogger(message[1]).log(message[2], message[3])

    def _receive_descriptor(self) -> int:
        """The file descriptor the process sent beside its last message (the caller closes it)."""
        try:
            _, (descriptor,), _, _ = socket.recv_fds(self._socket, 1, 1)
        except OSError as error:
            raise self._died() from error
        return descriptor

    def _died(self) -> RuntimeError:
        """The error of a process whose socket broke, with its exit code (None: not exited within 5 s)."""
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return self.Died(f"the {self.NAME} process (pid {self.process.pid}) exited with code {code}; the shards not "
                         "committed are redone by a rerun of the same command")

    def close(self) -> None:
        """Close the socket (the process ends its loop and exits) and wait for it; idempotent."""
        self._connection.close()
        self._socket.close()
        try:
            self.process.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ForwardLogs(logging.Handler):
    """In a helper process: its log lines, sent to the run's process to log (`send`: a locked send where other
    threads send too); `thread`: only that thread's."""

    def __init__(self, send, thread: int | None = None):
        super().__init__()
        self.send, self.thread = send, thread

    def emit(self, record: logging.LogRecord) -> None:
        if self.thread is None or record.thread == self.thread:
            self.send(("log", record.name, record.levelno, record.getMessage()))


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
