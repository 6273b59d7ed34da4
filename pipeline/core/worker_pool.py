"""A pool of spawned worker processes that costs the run's process no thread.

Python's ProcessPoolExecutor keeps two threads in the caller's process: a feeder that pickles each task
into the workers' queue and a manager that waits on every worker, reads each result off the pipe and
unpickles it, waking for each under the GIL (0.23-0.33 µs a row of the run's process on 2 cores,
docs/performance.md). Here the caller's own thread does both, on two Unix `SOCK_SEQPACKET` socket pairs
that every worker shares: a record is one whole message, read by one worker, so whichever worker is free
takes the next task and no lock is needed. Each record starts with its task's number and outcome, outside
the pickle, so a value that cannot be unpickled becomes that task's error. A message larger than
`INLINE_BYTES` travels as a memory file whose descriptor rides with the record (a few bytes of the
socket's buffer, while the file holds the message until it is read). The sockets' buffers are bounded
(~210 KB, a few hundred records): a caller whose next task does not fit reads results while it waits (they
are kept for their `result`), so workers blocked handing results back are never waited for forever. A worker that dies
breaks the pool (`BrokenProcessPool`, with its exit code) and the others are stopped; the caller's wait
watches the workers' sentinels beside the results.
"""

from __future__ import annotations

import array
import itertools
import multiprocessing
import os
import pickle
import select
import socket
import struct
import threading
import time
import traceback
from concurrent.futures.process import BrokenProcessPool

from pipeline.core.shared_arrays import read_exactly, write_all

INLINE_BYTES = 16 * 1024  # a message up to this size travels in its record; a larger one, in a memory file
_INLINE, _IN_FILE = b"M", b"F"
_HEADER = struct.Struct("<cq?")  # how the message travels, its task's number (`_UP`: a worker is up), succeeded
_UP = -1


def _record(task: int, succeeded: bool, message: bytes) -> tuple[bytes, int | None]:
    """A record of `message` for `task`, and the memory file holding the message where it is too large."""
    if len(message) <= INLINE_BYTES:
        return _HEADER.pack(_INLINE, task, succeeded) + message, None
    memory = os.memfd_create("lengthwise-message", os.MFD_CLOEXEC)
    try:
        write_all(memory, memoryview(message), 0)
    except BaseException:
        os.close(memory)
        raise
    return _HEADER.pack(_IN_FILE, task, succeeded), memory


def _send(channel: socket.socket, record: bytes, memory: int | None, flags: int = 0) -> None:
    """`socket.send_fds` is not used: before Python 3.12 it drops its `flags` (MSG_DONTWAIT)."""
    if memory is None:
        channel.send(record, flags)
    else:
        channel.sendmsg([record], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [memory]))], flags)


def send_message(channel: socket.socket, task: int, succeeded: bool, message: bytes) -> None:
    """One record of `channel`, waiting for room in its buffer."""
    record, memory = _record(task, succeeded, message)
    try:
        _send(channel, record, memory)
    finally:
        if memory is not None:
            os.close(memory)  # a record in flight holds its own reference


def receive_message(channel: socket.socket) -> tuple[int, bool, bytes | bytearray]:
    """The next record's (task, succeeded, message); EOFError once every other end has closed."""
    data, descriptors, flags, _ = socket.recv_fds(channel, _HEADER.size + INLINE_BYTES, 1)
    try:
        if not data:
            raise EOFError("the channel was closed")
        if flags & socket.MSG_TRUNC:  # never sent so (`_record`), but a cut record must not be read
            raise OSError("a worker pool record was larger than its limit")
        how, task, succeeded = _HEADER.unpack_from(data)
        if how == _INLINE:
            return task, succeeded, data[_HEADER.size:]
        return task, succeeded, read_exactly(descriptors[0], bytearray(os.fstat(descriptors[0]).st_size), 0)
    finally:
        for descriptor in descriptors:
            os.close(descriptor)


class WorkerError(Exception):
    """The traceback, in the worker, of an error a task raised (the error's cause in the caller)."""


def _serve(tasks: socket.socket, results: socket.socket, initializer, initargs: tuple) -> None:
    """A worker: set itself up, say so, then run tasks until the caller closes the pool (or is gone)."""
    initializer(*initargs)
    try:
        send_message(results, _UP, True, b"")
        while True:
            task, _, message = receive_message(tasks)
            try:
                function, args = pickle.loads(message)
                outcome, succeeded = function(*args), True
            except BaseException as error:  # handed to the caller, which raises it
                outcome, succeeded = (error, traceback.format_exc()), False
            try:
                message = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as error:  # a value or an error that does not pickle
                message, succeeded = pickle.dumps((RuntimeError(f"a task's outcome could not be pickled: {error!r}"),
                                                   traceback.format_exc())), False
            try:
                send_message(results, task, succeeded, message)
            except (BrokenPipeError, ConnectionResetError):
                raise
            except OSError as error:  # no memory file for a large outcome (EMFILE, ENOSPC): say so, in a small one
                send_message(results, task, False, pickle.dumps(
                    (OSError(f"a task's outcome could not be handed back: {error!r}"), traceback.format_exc())))
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the caller closed the pool, or died
        return


class WorkerPool:
    """`workers` spawned processes, each set up by `initializer(*initargs)`, running `function(*args)`
    tasks, started in the order submitted and finished in any; `result(task)` waits for one in the
    caller's thread (once per task)."""

    def __init__(self, workers: int, initializer, initargs: tuple = ()):
        context = multiprocessing.get_context("spawn")
        self._tasks, tasks_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._results, results_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lock = threading.Lock()  # one reader of the results at a time
        self._task_numbers = itertools.count()
        self._finished: dict[int, tuple[bool, object]] = {}
        self._up = 0
        self._closed = False
        self._broken: str | None = None  # why the pool cannot go on: a worker ended
        self._ended_exitcode: int | None = None  # that worker's (not the others', which the pool then stops)
        self.processes = [context.Process(target=_serve, args=(tasks_end, results_end, initializer, initargs),
                                          name=f"lengthwise-worker-{index}", daemon=True)
                          for index in range(workers)]
        try:
            for process in self.processes:
                process.start()
        except BaseException:
            self.close()
            raise
        finally:
            tasks_end.close()  # the workers hold theirs: a worker's exit is seen, not hidden by our copy
            results_end.close()
        self._watch = select.poll()  # a result, or a worker's end
        self._watch.register(self._results, select.POLLIN)
        for process in self.processes:
            self._watch.register(process.sentinel, select.POLLIN)
        self._watch_sending = select.poll()  # that, or room for a task
        self._watch_sending.register(self._results, select.POLLIN)
        self._watch_sending.register(self._tasks, select.POLLOUT)
        for process in self.processes:
            self._watch_sending.register(process.sentinel, select.POLLIN)

    def wait_until_up(self, timeout_s: float) -> str | None:
        """Wait until every worker is set up; None, or why not ("exited while starting (exit code 1, after
        0.4s)", "did not start in 120s"): a worker that dies while starting would otherwise be waited for."""
        started = time.monotonic()
        with self._lock:
            while self._up < len(self.processes):
                left = timeout_s - (time.monotonic() - started)
                if left <= 0:
                    return f"did not start in {timeout_s:.0f}s"
                try:
                    self._receive(self._watch, left)
                except BrokenProcessPool:
                    if self._closed:
                        raise
                    return f"exited while starting (exit code {self._ended_exitcode}, " \
                           f"after {time.monotonic() - started:.1f}s)"
        return None

    def submit(self, function, *args) -> int:
        """Queue `function(*args)` for the next free worker; its task number, for `result`."""
        self._raise_if_broken()
        task = next(self._task_numbers)
        record, memory = _record(task, True, pickle.dumps((function, args), protocol=pickle.HIGHEST_PROTOCOL))
        try:
            while True:
                try:
                    _send(self._tasks, record, memory, socket.MSG_DONTWAIT)
                    return task
                except BlockingIOError:  # the workers have as many tasks as the socket holds
                    with self._lock:
                        self._receive(self._watch_sending, None)
                except OSError:  # every worker has gone (EPIPE, ECONNRESET), and no wait has seen it yet
                    with self._lock:
                        self._raise_if_broken()
                        self._break(self._first_ended())  # raises
        finally:
            if memory is not None:
                os.close(memory)

    def result(self, task: int):
        """Task `task`'s return value (its error raised here), waiting for it; BrokenProcessPool if a worker
        ended (killed, crashed) or the pool was closed first."""
        with self._lock:
            while task not in self._finished:
                self._receive(self._watch, None)
            succeeded, value = self._finished.pop(task)
        if succeeded:
            return value
        error, worker_traceback = value
        raise error from WorkerError(worker_traceback)

    def _receive(self, watch: select.poll, timeout_s: float | None) -> None:
        """Take one message off the results (kept for `result`), or raise BrokenProcessPool once a worker
        has ended and none is left; returns without one when the task channel has room (`watch` is
        `_watch_sending`) or `timeout_s` runs out."""
        self._raise_if_broken()
        ready = dict(watch.poll(None if timeout_s is None else max(1, int(timeout_s * 1000))))
        self._raise_if_broken()
        if ready.get(self._results.fileno(), 0) & (select.POLLIN | select.POLLHUP):
            try:
                task, succeeded, message = receive_message(self._results)
            except EOFError:  # every worker has gone
                self._break(self._first_ended())
            if task == _UP:
                self._up += 1
                return
            try:
                value = pickle.loads(message)
            except Exception as error:  # that task's error, not a broken pool
                succeeded, value = False, (error, "its outcome could not be unpickled in the caller's process")
            self._finished[task] = (succeeded, value)
            return
        ended = [p for p in self.processes if p.sentinel in ready]
        if ended:
            self._break(ended[0])

    def _first_ended(self) -> multiprocessing.process.BaseProcess:
        """Once every worker has gone: one that failed (a non-zero exit code) if any."""
        for process in self.processes:
            process.join(timeout=1)
        return next((p for p in self.processes if p.exitcode), self.processes[0])

    def _break(self, ended) -> None:
        """Worker `ended` has ended: its task is lost, so the pool stops (as Python's executor does) and
        raises BrokenProcessPool, saying why."""
        ended.join(timeout=1)
        self._ended_exitcode = ended.exitcode
        self._broken = (f"a worker process ended unexpectedly (exit code {ended.exitcode}): killed (the OOM "
                        "killer?) or crashed; the pool's tasks are lost")
        for process in self.processes:
            if process.exitcode is None:
                process.kill()
        self._raise_if_broken()

    def _raise_if_broken(self) -> None:
        if self._closed:
            raise BrokenProcessPool("the worker pool was closed")
        if self._broken is not None:
            raise BrokenProcessPool(self._broken)

    def close(self) -> None:
        """Stop the workers now (SIGKILL: they may ignore SIGTERM); a waiting `result` fails rather than blocks."""
        if self._closed:
            return
        self._closed = True
        for process in self.processes:
            if process.pid is not None:
                process.kill()
        for process in self.processes:
            if process.pid is not None:
                process.join(timeout=5)
        with self._lock:  # after a waiting `result` has seen the workers end
            self._tasks.close()
            self._results.close()
