"""A process that streams rows keeps the memory it frees for the next block, and takes fresh memory
without asking the kernel for huge pages.

A run reads, converts and drops blocks of tens of MB all night. pyarrow's default pool on Linux
(mimalloc) hands freed memory back to the kernel soon after a block is dropped and takes it again for
the next, and the run's reading thread then spent more CPU in those system calls than in decoding:
reading 128,000 short texts cost it 2.5 µs a row with mimalloc (1.9 of it system time), 0.8 with the
system allocator or jemalloc; 50,000 long reviews, 8.7 with mimalloc, 3.6 with jemalloc and 3.1 with
the system allocator (`benchmarks/host_rate.py`'s pipeline, 2-core Zen 4 EPYC). The system
allocator is in every pyarrow build.

numpy asks for transparent huge pages (madvise) on every array of 4 MiB or more, such as a window's
token ids. Under the common `defrag: madvise` setting each first touch of such memory then waits for
the kernel to compact memory into a free 2 MiB page; where it finds none (a long-running host, a VM)
it falls back to a 4 KiB page after the wait: writing a fresh 14 MB array took 40 ms instead of 9 on a
2-core AVX2 EPYC VM that granted no huge page, and the run's process spent ~0.3-0.5 µs a row less
without the advice (host_rate.py, 128,000 rows, five alternated runs each: a median of 3.28 against
2.73). Where huge pages are granted the advice saves little on memory that is written once and read once.

Tokenizer workers and helper processes exist only to stream and keep the setting; the run's own process
holds it while a run lasts (`STREAMING_MEMORY`) and gets back what it had after.
"""

from __future__ import annotations

import threading

import pyarrow as pa


def prepare_streaming_memory() -> tuple[pa.MemoryPool, bool | None]:
    """Make the system allocator this process's default Arrow pool (for every allocation from now on;
    buffers already made keep theirs) and turn numpy's huge-page advice off. Returns what it found:
    the pool and the advice (None: this numpy has no switch)."""
    found = pa.default_memory_pool()
    pool = pa.system_memory_pool()
    if found.backend_name != pool.backend_name:
        pa.set_memory_pool(pool)
    switch = huge_page_switch()
    return found, None if switch is None else bool(switch(False))


class StreamingMemory:
    """`prepare_streaming_memory` for the run's own process, for as long as a run holds it: the first
    hold keeps what it found and the last release puts it back, so that a process that calls
    `pipeline.api.run` (a notebook, an Airflow task) keeps its own Arrow pool and numpy advice after the
    run. Runs may overlap (a Ray actor starts its next shard while one runs)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._holds = 0
        self._found: tuple[pa.MemoryPool, bool | None] | None = None

    def hold(self) -> None:
        with self._lock:
            found = prepare_streaming_memory()
            if self._holds == 0:
                self._found = found
            self._holds += 1

    def release(self) -> None:
        with self._lock:
            self._holds -= 1
            if self._holds == 0 and self._found is not None:
                pool, advice = self._found
                pa.set_memory_pool(pool)
                if advice is not None:
                    huge_page_switch()(advice)
                self._found = None


STREAMING_MEMORY = StreamingMemory()  # one for the process


def huge_page_switch():
    """numpy's switch of its huge-page advice (it returns the setting it replaces), or None where this
    numpy has none: the switch behind NUMPY_MADVISE_HUGEPAGE=0, which numpy reads only at its import."""
    return getattr(numpy_multiarray(), "_set_madvise_hugepage", None)


def numpy_multiarray():
    """numpy's `multiarray` module, where its huge-page switch is (numpy 2 moved it)."""
    try:
        from numpy._core import multiarray  # numpy 2
    except ImportError:
        from numpy.core import multiarray
    return multiarray
