"""A pool of spawned worker processes that costs the run's process no thread.

Python's ProcessPoolExecutor keeps two threads in the caller's process: a feeder that pickles each task
into the workers' queue and a manager that waits on every worker, reads each result off the pipe and
unpickles it, waking for each under the GIL (0.3-0.4 µs a row of the run's process on 2 cores,
docs/performance.md). Here the caller's own thread does both, on two Unix `SOCK_SEQPACKET` socket pairs
that every worker shares: a record is one whole message, read by one worker, so whichever worker is free
takes the next task and no lock is needed. A message larger than `INLINE_BYTES` travels as a memory file
whose descriptor rides with a one-byte record, so neither side ever waits on the other's reading. A worker
that dies breaks the pool (`BrokenProcessPool`) as the executor does: the caller's wait watches the
workers' sentinels beside the results.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import select
import socket
import threading
import time
import traceback
from concurrent.futures.process import BrokenProcessPool

INLINE_BYTES = 16 * 1024  # a message up to this size is the record itself; a larger one, a memory file
_INLINE, _IN_FILE = b"M", b"F"


def send_message(channel: socket.socket, message) -> None:
    """`message` pickled as one record of `channel`, or in a memory file whose descriptor the record carries."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) <= INLINE_BYTES:
        channel.send(_INLINE + data)
        return
    memory = os.memfd_create("lengthwise-message", os.MFD_CLOEXEC)
    try:
        view, written = memoryview(data), 0
        while written < len(data):
            written += os.write(memory, view[written:])
        socket.send_fds(channel, [_IN_FILE], [memory])
    finally:
        os.close(memory)  # the record holds its own reference until it is read


def receive_message(channel: socket.socket):
    """The next record's message; EOFError once the other side has closed."""
    data, descriptors, flags, _ = socket.recv_fds(channel, INLINE_BYTES + 1, 1)
    if not data:
        raise EOFError("the channel was closed")
    if flags & socket.MSG_TRUNC:  # never sent so (send_message), but a truncated record must not be unpickled
        raise OSError("a worker pool record was larger than its limit")
    if data[:1] == _INLINE:
        return pickle.loads(data[1:])
    memory = descriptors[0]
    try:
        size, chunks, read = os.fstat(memory).st_size, [], 0
        while read < size:
            chunk = os.pread(memory, size - read, read)
            if not chunk:
                raise OSError(f"a worker pool message ended after {read} of {size} bytes")
            chunks.append(chunk)
            read += len(chunk)
        return pickle.loads(b"".join(chunks))
    finally:
        os.close(memory)


class WorkerError(Exception):
    """The traceback, in the worker, of an error a task raised (the error's cause in the caller)."""


def _serve(tasks: socket.socket, results: socket.socket, initializer, initargs: tuple) -> None:
    """A worker: set itself up, say so, then run tasks until the caller closes the pool."""
    initializer(*initargs)
    send_message(results, (None, True, os.getpid()))
    while True:
        try:
            task_id, function, args = receive_message(tasks)
        except EOFError:
            return
        try:
            outcome = (task_id, True, function(*args))
        except BaseException as error:  # handed to the caller, which raises it
            outcome = (task_id, False, (error, traceback.format_exc()))
        try:
            send_message(results, outcome)
        except (pickle.PicklingError, TypeError, AttributeError) as error:  # a value or an error that does not pickle
            send_message(results, (task_id, False, (RuntimeError(f"a task's outcome could not be pickled: {error}"),
                                                    traceback.format_exc())))


class WorkerPool:
    """`workers` spawned processes, each set up by `initializer(*initargs)`, running `function(*args)`
    tasks in the order they are submitted; `result(task)` waits for one in the caller's thread."""

    def __init__(self, workers: int, initializer, initargs: tuple = ()):
        context = multiprocessing.get_context("spawn")
        self._tasks, tasks_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._results, results_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lock = threading.Lock()  # one reader of the results at a time
        self._next_task, self._finished, self._up = 0, {}, 0
        self._closed = False
        self._broken: str | None = None  # why the pool cannot go on (a worker ended, or it was closed)
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
        self._watch = select.poll()
        self._watch.register(self._results, select.POLLIN)
        for process in self.processes:
            self._watch.register(process.sentinel, select.POLLIN)

    def wait_until_up(self, timeout_s: float) -> str | None:
        """Wait until every worker is set up; None, or why not ("exited while starting (exit code 1, after
        0.4s)", "did not start in 120s"): a worker that dies while starting would otherwise be waited for."""
        started = time.monotonic()
        while self._up < len(self.processes):
            left = timeout_s - (time.monotonic() - started)
            if left <= 0:
                return f"did not start in {timeout_s:.0f}s"
            try:
                self._receive(left)
            except BrokenProcessPool:
                dead = [p.exitcode for p in self.processes if p.exitcode is not None]
                return f"exited while starting (exit code {dead[0] if dead else 'unknown'}, " \
                       f"after {time.monotonic() - started:.1f}s)"
        return None

    def submit(self, function, *args) -> int:
        """Queue `function(*args)` for the next free worker; its task number, for `result`."""
        self._raise_if_broken()
        task, self._next_task = self._next_task, self._next_task + 1
        try:
            send_message(self._tasks, (task, function, args))
        except OSError as error:
            raise BrokenProcessPool(f"a worker process ended: the pool's task channel failed ({error})") from error
        return task

    def result(self, task: int):
        """Task `task`'s return value (its error raised here), waiting for it; BrokenProcessPool if a worker
        ended (killed, crashed) or the pool was closed first."""
        with self._lock:
            while task not in self._finished:
                self._receive(None)
            succeeded, value = self._finished.pop(task)
        if succeeded:
            return value
        error, worker_traceback = value
        raise error from WorkerError(worker_traceback)

    def _receive(self, timeout_s: float | None) -> None:
        """Take one message off the results, or raise BrokenProcessPool once a worker has ended and none is
        left; returns without one when `timeout_s` runs out."""
        self._raise_if_broken()
        ready = dict(self._watch.poll(None if timeout_s is None else max(1, int(timeout_s * 1000))))
        self._raise_if_broken()
        if ready.get(self._results.fileno(), 0) & select.POLLIN:
            task, succeeded, value = receive_message(self._results)
            if task is None:
                self._up += 1
            else:
                self._finished[task] = (succeeded, value)
            return
        ended = [p for p in self.processes if p.sentinel in ready]
        if ended:
            ended[0].join(timeout=1)
            self._broken = (f"a worker process ended unexpectedly (exit code {ended[0].exitcode}): killed (the OOM "
                            "killer?) or crashed; the pool's tasks are lost")
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
        with contextlib.suppress(OSError):
            self._tasks.close()
        with self._lock:  # after a waiting `result` has seen the workers end
            self._results.close()
