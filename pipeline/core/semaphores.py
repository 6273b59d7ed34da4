"""The tokenizer pool's queue semaphores, released once every worker holds them: a run killed later leaves
no semaphore in /dev/shm. Python's internals (3.10-3.13), read where they are; elsewhere nothing changes."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor


def release_semaphore_names(executor: ProcessPoolExecutor) -> int:
    """Unlink the names of the pool's queue semaphores once every worker has opened them (they
    work on by handle, as a fork context's do) and take them off the resource tracker, so that a
    run killed later (SIGKILL, the OOM killer) leaves nothing in /dev/shm and the tracker prints no
    "There appear to be N leaked semaphore objects" into its log. Returns how many."""
    from _multiprocessing import sem_unlink
    from multiprocessing import resource_tracker, util
    from multiprocessing.synchronize import SemLock

    try:  # Python's internals (3.10-3.13); elsewhere the names stay, as before, and the run goes on
        names = {item._semlock.name for queue in (executor._call_queue, executor._result_queue)
                 for item in vars(queue).values() if isinstance(item, SemLock) and item._semlock.name is not None}
        finalizers = {f._args[0]: f for f in list(util._finalizer_registry.values())
                      if getattr(f, "_callback", None) is SemLock._cleanup and f._args and f._args[0] in names}
    except AttributeError:
        return 0
    released = 0
    for name in names:
        try:
            sem_unlink(name)
        except OSError:
            continue  # left as it was: its finalizer and the tracker still clean it up
        if name in finalizers:
            finalizers[name].cancel()  # its unlink at exit is done, here
        resource_tracker.unregister(name, "semaphore")
        released += 1
    return released
