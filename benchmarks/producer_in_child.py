"""An experiment for `host_rate.py --producer-in-child`: what the run's process would still spend if
the windows and batches were built by another process (docs/performance.md, "What a feeder process
would leave on the run's process").

It patches the shard runner so that everything its prefetch thread produces on the host (reading,
windows, the tokenizer pool's results, dedupe, planning, collate: `collated_parts` over the tokenized
windows) runs in a child forked when the run starts; the run's process only sends each batch to the
device (`sent_to_device`). The child hands the run's process:

- each window once, pickled without what the run's process never reads again (its token ids and
  texts), with the first item of it;
- each collated batch as where it lies in a ring of shared memory mapped before the fork (the
  run's process takes views, no copy), and its rows;
- each window part as its block and row bounds.

The run's process sends back one count a batch; the child writes into a slot only when the batch that
held it is far enough behind (`LAG`: more than the prefetch depth and the batch in flight).

Not how runs work: a fork of a process with threads is safe here only because the child touches
nothing but the producer chain (the reader processes' and the pool's sockets it inherits), and the
stage times it keeps are not sent back. It measures; it does not ship.
"""

from __future__ import annotations

import copy
import dataclasses
import mmap
import os
import pickle
import socket
from multiprocessing.connection import Connection

import numpy as np
import pyarrow as pa

SLOTS = 32
LAG = 8  # a slot is written again once the run's process has received LAG batches after its last one
SLOT_BYTES = 65536 * 17 + 4096  # host_rate's 65,536-token batches: int64 ids and mask, int8 types


def lean_window(window):
    """A copy of `window` without its token ids and texts: what the run's process stores into and writes."""
    lean = copy.copy(window)
    no_tokens = np.zeros(0, np.int32)
    lean.encoded = dataclasses.replace(window.encoded, token_ids=no_tokens)
    lean.scored = lean.encoded if window.scored is window.encoded else dataclasses.replace(window.scored,
                                                                                          token_ids=no_tokens)
    lean.blocks = [dataclasses.replace(block, texts=pa.nulls(0, pa.string())) for block in window.blocks]
    return lean


def produce(items, channel: Connection, ring: np.ndarray) -> None:
    """In the child: each of `items` (`collated_parts`) to the run's process, batches through the ring."""
    from pipeline.offline.windows import WindowBatch

    last, sent, received = None, 0, 0
    for item in items:
        window = item.window  # a window's items come together: a new one never returns to an earlier one
        lean = None if window is last else lean_window(window)
        last = window
        if isinstance(item, WindowBatch):
            while received < sent - (SLOTS - LAG):
                received = int.from_bytes(channel.recv_bytes(), "little")
            offset, arrays = (sent % SLOTS) * SLOT_BYTES, []
            if sum(values.nbytes for values in item.batch.arrays) > SLOT_BYTES:  # it would run into the next slot
                raise ValueError(f"a batch of {item.batch.padded_tokens:,} padded tokens does not fit a ring slot "
                                 f"({SLOT_BYTES:,} bytes): host_rate's 65,536-token batches do")
            for values in item.batch.arrays:
                ring[offset:offset + values.nbytes] = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
                arrays.append((offset, values.dtype.str, values.shape))
                offset += values.nbytes
            sent += 1
            message = ("batch", lean, dataclasses.replace(item.batch, arrays=arrays), item.models)
        else:
            message = ("part", lean, item.first_block, item.end_block, item.start_row, item.end_row)
        channel.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    channel.send_bytes(pickle.dumps(("end",)))
    try:  # the run's process counts the last batches back, then closes
        while True:
            channel.recv_bytes()
    except EOFError:
        pass


def producer_in_child(items):
    """`items`' batches and parts, produced by a forked child."""
    from pipeline.offline.windows import WindowBatch, WindowPart

    memory = mmap.mmap(-1, SLOTS * SLOT_BYTES, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    ring = np.frombuffer(memory, np.uint8)
    ring[:] = 0  # faulted in once, before the fork: both processes share the pages
    ours, theirs = socket.socketpair()
    child = os.fork()
    if child == 0:
        ours.close()
        code = 0
        try:
            produce(items, Connection(theirs.detach()), ring)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    theirs.close()
    channel, window, received = Connection(ours.detach()), None, 0
    try:
        while True:
            message = pickle.loads(channel.recv_bytes())
            if message[0] == "end":
                return
            window = window if message[1] is None else message[1]  # a new window's first item brings it
            if message[0] == "part":
                yield WindowPart(window, *message[2:])
                continue
            batch, models = message[2:]
            received += 1
            channel.send_bytes(received.to_bytes(8, "little"))
            views = tuple(np.frombuffer(memory, np.dtype(kind), int(np.prod(shape)), offset).reshape(shape)
                          for offset, kind, shape in batch.arrays)
            yield WindowBatch(dataclasses.replace(batch, arrays=views), window, models)
    finally:
        channel.close()
        _, status = os.waitpid(child, 0)
        if status != 0:
            raise RuntimeError(f"the producer child failed (wait status {status}): its traceback is above")


def patch_runner() -> None:
    """Make the shard runner's batches come from `producer_in_child`."""
    import pipeline.offline.runner as runner

    collated_parts = runner.collated_parts

    def parts_from_child(windows, packing, limits, computed=None):
        return producer_in_child(collated_parts(windows, packing, limits, computed))

    runner.collated_parts = parts_from_child
