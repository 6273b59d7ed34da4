"""The worker pool under the tokenizer pool (core/worker_pool.py): real spawned processes, their faults."""

import os
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool

import pytest

from pipeline.core.worker_pool import WorkerError, WorkerPool


@pytest.fixture
def one_worker():
    pool = WorkerPool(1, int)  # int(): a set-up that needs nothing
    assert pool.wait_until_up(60) is None
    yield pool
    pool.close()


def test_an_error_a_task_raises_is_raised_in_the_caller_with_the_workers_traceback(one_worker):
    good, bad, large = one_worker.submit(int, "7"), one_worker.submit(int, "x"), one_worker.submit(bytes, 100_000)
    assert one_worker.result(large) == bytes(100_000) and one_worker.result(good) == 7  # any order
    with pytest.raises(ValueError, match="invalid literal") as raised:
        one_worker.result(bad)
    assert isinstance(raised.value.__cause__, WorkerError) and "Traceback" in str(raised.value.__cause__)


@pytest.mark.parametrize("large", [False, True])
def test_more_tasks_than_the_sockets_hold_neither_side_waits_forever(one_worker, large):
    """Tasks submitted without reading any result fill both sockets' buffers (~210 KB each): the caller reads
    results while it waits for room, and keeps them. A task over the inline limit travels as a memory file
    (its record sent without waiting too: `socket.send_fds` dropped MSG_DONTWAIT before Python 3.12)."""
    function, args = (len, (b"x" * 20_000,)) if large else (os.getpid, ())
    submitted: list[int] = []
    submitting = threading.Thread(target=lambda: submitted.extend(one_worker.submit(function, *args)
                                                                  for _ in range(3000)), daemon=True)
    submitting.start()
    submitting.join(120)
    assert not submitting.is_alive(), f"submit blocked after {len(submitted)} tasks"
    expected = 20_000 if large else one_worker.processes[0].pid
    assert [one_worker.result(task) for task in reversed(submitted)] == [expected] * 3000


def test_a_pool_whose_only_worker_died_is_broken_with_its_exit_code(one_worker):
    task = one_worker.submit(time.sleep, 30)
    os.kill(one_worker.processes[0].pid, signal.SIGKILL)
    time.sleep(1)  # its end of the sockets is closed: the results read as ended, not as a message
    with pytest.raises(BrokenProcessPool, match="exit code -9"):
        one_worker.result(task)
    with pytest.raises(BrokenProcessPool, match="exit code -9"):
        one_worker.submit(int, "1")


def test_a_submit_that_first_meets_the_dead_pool_names_the_exit_code(one_worker):
    os.kill(one_worker.processes[0].pid, signal.SIGKILL)
    one_worker.processes[0].join(10)
    with pytest.raises(BrokenProcessPool, match="exit code -9"):
        one_worker.submit(int, "1")


def test_when_one_worker_dies_the_others_are_stopped():
    pool = WorkerPool(2, int)
    try:
        assert pool.wait_until_up(60) is None
        tasks = [pool.submit(time.sleep, 30) for _ in range(2)]
        os.kill(pool.processes[1].pid, signal.SIGKILL)
        with pytest.raises(BrokenProcessPool, match="exit code -9"):
            pool.result(tasks[0])
        pool.processes[0].join(10)
        assert pool.processes[0].exitcode == -signal.SIGKILL  # not left tokenizing for a run that has failed
    finally:
        pool.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_worker_that_exits_while_starting_is_reported_with_its_exit_code(workers):
    """With two, the first to exit is named, not the other the pool then stops (exit code -9)."""
    pool = WorkerPool(workers, os._exit, (3,))
    try:
        assert pool.wait_until_up(60).startswith("exited while starting (exit code 3")
    finally:
        pool.close()


def test_a_closed_pool_fails_a_waiting_result_instead_of_blocking(one_worker):
    task = one_worker.submit(time.sleep, 30)
    failures: list[BaseException] = []

    def wait() -> None:
        try:
            one_worker.result(task)
        except BaseException as error:
            failures.append(error)

    waiting = threading.Thread(target=wait, daemon=True)
    waiting.start()
    time.sleep(0.5)
    one_worker.close()
    waiting.join(30)
    assert not waiting.is_alive() and isinstance(failures[0], BrokenProcessPool) and "closed" in str(failures[0])
