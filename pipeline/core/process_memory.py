"""A process that streams rows keeps the memory it frees for the next block: Arrow's pool is the system
allocator.

A run reads, converts and drops blocks of tens of MB all night. pyarrow's default pool on Linux
(mimalloc) hands freed memory back to the kernel soon after a block is dropped and takes it again for
the next, and the run's reading thread then spent more CPU in those system calls than in decoding:
reading 128,000 short texts cost it 2.5 µs a row with mimalloc (1.9 of it system time), 0.8 with the
system allocator or jemalloc; 50,000 long reviews, 8.7 with mimalloc, 3.6 with jemalloc and 3.1 with
the system allocator (`benchmarks/host_rate.py`'s pipeline, 2-core Zen 4 EPYC). The system
allocator is in every pyarrow build.
"""

from __future__ import annotations

import pyarrow as pa


def keep_freed_memory() -> None:
    """Make the system allocator this process's default Arrow pool (for every allocation from now on;
    buffers already made keep theirs)."""
    pool = pa.system_memory_pool()
    if pa.default_memory_pool().backend_name != pool.backend_name:
        pa.set_memory_pool(pool)
