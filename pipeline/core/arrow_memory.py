"""The Arrow memory pool of a process that streams rows: the system allocator, which keeps what it frees.

pyarrow's default pool on Linux (mimalloc) hands freed memory back to the kernel soon after a block
is dropped and takes it again for the next: a run, which reads, converts and drops blocks of tens of
MB all night, then spends more CPU in those system calls than in decoding. Measured in the run's
process (`benchmarks/host_rate.py`, 2-core Zen 4 EPYC): reading 128,000 short texts cost 2.5 µs a
row with mimalloc (1.9 of it system time), 0.8 with jemalloc and with the system allocator; reading
50,000 long reviews, 8.7, 3.6 and 3.1. The system allocator is in every pyarrow build.
"""

from __future__ import annotations

import pyarrow as pa


def use_system_allocator() -> str:
    """Make the system allocator this process's default Arrow pool (for every allocation from now on;
    buffers already made keep theirs); returns the pool's name."""
    pool = pa.system_memory_pool()
    if pa.default_memory_pool().backend_name != pool.backend_name:
        pa.set_memory_pool(pool)
    return pool.backend_name
