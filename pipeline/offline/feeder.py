"""The feeder process: the producer (offline/producer.py) in a process of its own, so that on a GPU host the run's
process spends its CPU on the device and the outputs only (docs/performance.md, "The feeder process").

The run's process keeps the model, the device loop, the windows' outputs, the writer and every commit. The feeder
(offline/child_process.py: a fresh interpreter without torch that exits with its parent) owns the reader processes,
the tokenizer pool and --reuse's index, and hands the run's process what its prefetch thread would have built:

- each window once, before its first batch, without what the run's process never reads (token ids, texts);
- each collated batch as where it lies in a ring of shared memory (the run's process takes views, no copy), with
  its rows: the ring is a memory file of `slots` equal slots, replaced by a larger one when a batch does not fit;
- each window part as its bounds, with the stage times and --reuse's index size so far (a run that leaves early
  keeps them); any error at the stream's end, raised with its type (a usage error stays exit 2, a storage error
  exit 4); the producer's log lines, at the run's log level.

The run's process tells it which ring slots are free again (a batch is done with its slot once `prefetch_batches`
+ 1 items after it have been taken: the prefetch queue holds at most that many; a run begins once every batch of
the run before it is done), the rows a padded length was lowered to after running out of memory (later batches are
planned with it), and a Ray actor's next shards to start while the current ones run (read on a thread of the
feeder's own), or to forget.

Messages, run → feeder: ("open", tokenizer, workers, keep_pool, log level), ("configure", spec), ("ready",),
("start", number, shards), ("forget", number), ("run", number or None, shards), ("freed", batches),
("lowered", {length: rows}).
Feeder → run: ("ready",), ("log", logger, level, message), ("window", window), ("ring", slot_bytes, slots) with the
memory file's descriptor after it, ("batch", batch, models), ("part", bounds…, times and index rows so far),
("end", times, index rows), ("error", exception, times, index rows).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import logging
import mmap
import os
import socket
import subprocess
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import Connection

import numpy as np
import pyarrow as pa

from pipeline.core.clock import StageTimes
from pipeline.core.collate import CollatedBatch
from pipeline.core.tokenize import TokenizerSpec
from pipeline.offline.child_process import ForwardLogs, HelperProcess, child_channel, portable
from pipeline.offline.producer import BatchProducer, ProducerSpec, StartedShards
from pipeline.offline.source import Shard
from pipeline.offline.windows import Window, WindowBatch, WindowPart

ALIGN = 64  # each array of a batch starts on a cache line of its slot
FIRST_SLOT_BYTES = 2**20  # grown to the first batch that does not fit, and at least doubled
SPARE_SLOTS = 4  # slots beyond the ones the prefetch queue and the device loop may hold: the feeder's lead
FREED_EVERY = SPARE_SLOTS  # batches told free at once (a message costs the run's process ~30 µs on a 2-core VM); at
# most the spare slots, so that a feeder waiting for a slot always has one coming


class FeederDied(RuntimeError):
    """The feeder process is gone (killed, out of memory): the run stops, and a rerun redoes the shards it had not
    committed."""


def uses_feeder_process(device_type: str) -> bool:
    """Whether a run on this device builds its batches in a feeder process: on CUDA, where the run's process must
    keep up with the device; on the CPU the model takes the cores and the producer costs it little."""
    return device_type == "cuda"


def producer_for(tokenizer: TokenizerSpec, workers: int, device_type: str,
                 keep_pool: bool = False) -> BatchProducer | FeederProcess:
    """The producer of a run on this device, its tokenizer workers starting now; `keep_pool`: one pool (and
    feeder process) for every run (a Ray actor's)."""
    if uses_feeder_process(device_type):
        return FeederProcess(tokenizer, workers, keep_pool)
    return BatchProducer(tokenizer, workers, keep_pool)


class _Feeder(HelperProcess):
    MODULE, NAME = "pipeline.offline.feeder", "feeder"
    Died = FeederDied


class FeederProcess:
    """The run's handle on its feeder process: the producer's calls (`ready`, `start`, `items`, `end_run`,
    `close`), answered by the process. A run that fails, or leaves its batches before their end, stops the
    process; the next run starts another."""

    def __init__(self, tokenizer: TokenizerSpec, workers: int, keep_pool: bool = False):
        self.tokenizer, self.workers, self.keep_pool = tokenizer, workers, keep_pool
        self.spec: ProducerSpec | None = None
        self.previous_rows: int | None = None
        self._process: _Feeder | None = None
        self._ring: tuple[mmap.mmap, int] | None = None  # the process's ring, as mapped here, and its slot size
        self._lock = threading.RLock()  # a Ray actor's `start` comes from a thread of its own
        self._started = 0  # shards started so far (`start`), numbered for the process
        self._not_run: dict[int, weakref.finalize] = {}  # started shards not run yet: the feeder forgets them if
        # their StartedShards goes unused
        self._in_sync = True  # every message of the last stream was read: the process can take the next run
        self._up()  # its tokenizer workers start now, while the model loads

    def _up(self) -> _Feeder:
        """The process, started (again) if there is none or it died between runs (a Ray actor's next shard
        then starts on a new one rather than failing too)."""
        with self._lock:
            if self._process is not None and self._in_sync and self._process.process.poll() is not None:
                self._stop(quickly=True)
            if self._process is None:
                self._process = _Feeder()
                self._send(("open", self.tokenizer, self.workers, self.keep_pool,
                            logging.getLogger("pipeline").getEffectiveLevel()))
                if self.spec is not None:
                    self._send(("configure", self.spec))
            return self._process

    def _send(self, message: tuple) -> None:
        with self._lock:
            self._process._send(message)

    def configure(self, spec: ProducerSpec) -> None:
        self.spec = spec
        if self._process is not None:
            self._send(("configure", spec))

    def ready(self) -> None:
        """Wait for the process's tokenizer workers (started again if a run before failed)."""
        self._up()
        self._send(("ready",))
        message = self._process._receive()
        if message[0] == "error":
            raise message[1]

    def start(self, shards: list[Shard]) -> StartedShards:
        """Have the process read the first window of `shards` and hand it to its pool now, for a later
        `items(…, begun)`; safe while another run's `items` go on."""
        started_at = time.time()
        with self._lock:
            process = self._up()
            self._started += 1
            number = self._started
            try:
                process._send(("start", number, list(shards)))
            except FeederDied:  # it died with the run going on, which stops on it: the shards start at their run
                return StartedShards(StageTimes(), None, None, (None, number), started_at)
        started = StartedShards(StageTimes(), None, None, (process, number), started_at)
        self._not_run[number] = weakref.finalize(started, self._forget, process, number)
        return started

    def _forget(self, process: _Feeder, number: int) -> None:
        with self._lock:
            self._not_run.pop(number, None)
            if process is self._process:
                with contextlib.suppress(FeederDied):
                    self._send(("forget", number))

    def items(self, shards: list[Shard], times: StageTimes,
              begun: StartedShards | None = None) -> Iterator[WindowBatch | WindowPart]:
        """The run's batches and window parts, as the process builds them (after `ready`)."""
        process = self._process
        number = begun.pool[1] if begun is not None and begun.pool[0] is process else None  # else: started again
        if begun is not None and begun.pool[1] in self._not_run:
            self._not_run.pop(begun.pool[1]).detach()
        self._in_sync = False
        self._send(("run", number, list(shards)))
        depth = max(1, self.spec.config.prefetch_batches) + 1  # items the prefetch queue and the device loop hold
        window, batches, taken, freed = None, 0, deque(), 0
        limits, told = self.spec.limits, {}
        feeders_times = StageTimes()  # the latest the feeder told: added once, at the end or when the run leaves
        try:
            while True:
                message = self._process._receive()
                kind = message[0]
                if kind == "window":
                    window = message[1]
                    continue
                if kind == "ring":
                    self._ring = self._map_ring(*message[1:])
                    continue
                if kind != "batch":
                    feeders_times, self.previous_rows = message[-2:]
                if kind in ("end", "error"):
                    self._in_sync = True
                    if kind == "error":
                        raise message[1]
                    return
                if kind == "batch":
                    batches += 1
                    yield WindowBatch(batch_in(self._ring[0], *message[1]), window, message[2])
                else:
                    yield WindowPart(window, *message[1:5])
                taken.append(batches)  # the batches up to this item; their slots free once `depth` items follow it
                if len(taken) > depth and taken.popleft() >= freed + FREED_EVERY:
                    freed += FREED_EVERY
                    self._send(("freed", freed))
                if limits.lowered != told:
                    told = dict(limits.lowered)
                    self._send(("lowered", told))
        finally:  # a run that leaves early (--fail-fast, an error) keeps what the feeder had read and tokenized
            add_times(times, feeders_times)

    def _map_ring(self, slot_bytes: int, slots: int) -> tuple[mmap.mmap, int]:
        """The ring the process just made: mapped here (each batch's views keep the mapping), with its slot size."""
        memory = self._process._receive_descriptor()
        try:
            return mmap.mmap(memory, slot_bytes * slots, flags=mmap.MAP_SHARED), slot_bytes
        finally:
            os.close(memory)

    def end_run(self, failed: bool) -> bool:
        """After a run: the process stops unless it is kept and in step (a run that failed, or left its batches
        before their end, stops it: the next run starts another). Whether it is kept."""
        if self._process is not None and (failed or not self._in_sync or not self.keep_pool):
            self._stop(quickly=not self._in_sync)
        return self._process is not None

    def _stop(self, quickly: bool) -> None:
        """Stop the process; `quickly`: in the middle of a stream nothing it holds is worth waiting for."""
        with self._lock:
            process, self._process, self._ring, self._in_sync = self._process, None, None, True
        if quickly:
            with contextlib.suppress(OSError):  # wakes a prefetch thread still waiting on the socket
                process._socket.shutdown(socket.SHUT_RDWR)
            process._connection.close()
            process._socket.close()
            try:
                process.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                process.process.kill()
        process.close()

    def close(self) -> None:
        if self._process is not None:
            self._stop(quickly=not self._in_sync)


def batch_out(batch: CollatedBatch, arrays: tuple) -> tuple:
    """What the run's process needs to take `batch` back from the ring, its arrays placed there (`arrays`: the
    offset, dtype and shape of each): plain values, quick to unpickle (the rows as bytes)."""
    return (batch.rows.tobytes(), batch.rows.dtype.str, batch.padded_length, arrays, batch.real_tokens,
            batch.padded_tokens, batch.padded, batch.typed)


def batch_in(memory: mmap.mmap, rows: bytes, rows_dtype: str, padded_length: int, arrays: tuple, real_tokens: int,
             padded_tokens: int, padded: bool, typed: bool) -> CollatedBatch:
    """The batch `batch_out` described, its arrays as views of the ring's `memory`; entered now (the collate stage
    counts the feeder's collate, and here only the send)."""
    views = tuple(np.frombuffer(memory, kind, count, offset).reshape(shape) for offset, kind, count, shape in arrays)
    return CollatedBatch(np.frombuffer(rows, rows_dtype), padded_length, views, real_tokens, padded_tokens,
                         time.perf_counter(), padded, typed)


def add_times(times: StageTimes, more: StageTimes) -> None:
    for name, seconds in dataclasses.asdict(more).items():
        setattr(times, name, getattr(times, name) + seconds)


def lean_window(window: Window) -> Window:
    """A copy of `window` without what the run's process never reads: token ids, the workers' hashes, and texts (and
    a pair's texts), kept only for a block whose rows were not hashed (its text-hash file hashes them there)."""
    lean = copy.copy(window)
    no_tokens = np.zeros(0, np.int32)
    lean.encoded = dataclasses.replace(window.encoded, token_ids=no_tokens, type_ids=None, hashes=None)  # the
    # hashes are the blocks' (`reuse.hashes`) by now
    lean.scored = lean.encoded if window.scored is window.encoded else dataclasses.replace(
        window.scored, token_ids=no_tokens, type_ids=None)
    if window.encoded.segments is not None:
        lean.encoded.segments = dataclasses.replace(window.encoded.segments, token_ids=no_tokens)
    nothing = pa.nulls(0, pa.string())
    lean.blocks = [block if block.reuse is None else
                   dataclasses.replace(block, texts=nothing, pairs=None if block.pairs is None else nothing)
                   for block in window.blocks]
    return lean


class Ring:
    """The feeder's side of the ring: each batch's arrays copied into the next slot once the run's process has
    freed it (`freed`, told by `wait`), a larger ring made when a batch does not fit."""

    def __init__(self, slots: int, send_ring):
        self.slots, self.send_ring = slots, send_ring
        self.memory: mmap.mmap | None = None
        self.slot_bytes, self.placed, self.freed, self.first_of_run = 0, 0, 0, 0

    def begin_run(self) -> None:
        """A run begins once the run before it is done with all of its batches: every slot is free."""
        self.freed = self.first_of_run = self.placed

    def free(self, batches: int) -> None:
        """The run's first `batches` batches are done with their slots."""
        self.freed = max(self.freed, self.first_of_run + batches)

    def place(self, batch: CollatedBatch, wait) -> tuple:
        """`batch` copied into the next free slot, described for the run's process (`batch_out`); `wait()` handles
        the run's messages until a slot frees."""
        sizes = [-(-values.nbytes // ALIGN) * ALIGN for values in batch.arrays]
        if sum(sizes) > self.slot_bytes:
            self._grow(sum(sizes))
        while self.placed - self.freed >= self.slots:
            wait()
        offset, described = (self.placed % self.slots) * self.slot_bytes, []
        for values, size in zip(batch.arrays, sizes):
            target = np.frombuffer(self.memory, values.dtype, values.size, offset).reshape(values.shape)
            np.copyto(target, values)
            described.append((offset, values.dtype.str, values.size, values.shape))
            offset += size
        self.placed += 1
        return batch_out(batch, tuple(described))

    def _grow(self, needed: int) -> None:
        """A new ring whose slots hold `needed` bytes (at least twice the last); its slots start empty."""
        self.slot_bytes = max(needed, 2 * self.slot_bytes, FIRST_SLOT_BYTES)
        memory = os.memfd_create("lengthwise-feeder-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(memory, self.slot_bytes * self.slots)
            self.memory = mmap.mmap(memory, self.slot_bytes * self.slots, flags=mmap.MAP_SHARED)
            self.send_ring(self.slot_bytes, self.slots, memory)
        finally:
            os.close(memory)
        self.freed = self.placed  # the old ring's slots are not written again


class Feeding:
    """The feeder process's loop: the run's messages in, the producer's batches out."""

    def __init__(self, connection: Connection, channel: socket.socket):
        self.connection, self.channel = connection, channel
        self.lock = threading.Lock()  # log lines may come from the producer's threads
        self.producer: BatchProducer | None = None
        self.started: dict[int, concurrent.futures.Future] = {}  # `start`'s, by number: read on a thread of its own
        self.starting = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lengthwise-start")
        self.ring: Ring | None = None

    def send(self, message: tuple) -> None:
        with self.lock:
            self.connection.send(message)

    def _send_ring(self, slot_bytes: int, slots: int, memory: int) -> None:
        with self.lock:
            self.connection.send(("ring", slot_bytes, slots))
            socket.send_fds(self.channel, [b"r"], [memory])

    def serve(self) -> None:
        while True:
            try:
                message = self.connection.recv()
            except (EOFError, OSError):
                return
            self.handle(message)

    def handle(self, message: tuple) -> None:
        kind, *arguments = message
        if kind == "open":
            *producer_arguments, level = arguments
            logging.getLogger("pipeline").setLevel(level)  # the run's: --verbose reaches the feeder's lines too
            self.producer = BatchProducer(*producer_arguments)
        elif kind == "configure":
            self.producer.configure(arguments[0])
            self.ring = Ring(max(1, arguments[0].config.prefetch_batches) + 1 + SPARE_SLOTS, self._send_ring)
        elif kind == "ready":
            try:
                self.producer.ready()
                self.send(("ready",))
            except Exception as error:
                self.send(("error", portable(error)))
        elif kind == "start":  # the first window read beside the stream going on; an error is told at the run
            self.started[arguments[0]] = self.starting.submit(self.producer.start, arguments[1])
        elif kind == "run":
            self.stream(*arguments)
        elif kind == "forget":
            self.forget(arguments[0])
        elif kind == "freed":
            self.ring.free(arguments[0])
        elif kind == "lowered":
            for length, rows in arguments[0].items():
                self.producer.spec.limits.lower(length, rows)

    def _handle_waiting(self) -> None:
        """The run's messages that came meanwhile (freed slots, lowered limits, shards to start)."""
        while self.connection.poll(0):
            self.handle(self.connection.recv())

    def _wait(self) -> None:
        self.handle(self.connection.recv())

    def forget(self, number: int) -> None:
        """Shards started whose run will never come (a Ray actor's call failed before it): their reading stops
        once their first window is read."""
        started = self.started.pop(number, None)
        if started is not None:
            started.add_done_callback(lambda done: done.exception() is None and done.result().windows.close())

    def stream(self, number: int | None, shards: list[Shard]) -> None:
        """One run's batches and parts, then its end (or its error), with its stage times."""
        producer, times = self.producer, StageTimes()
        self.ring.begin_run()
        try:
            begun = self.started.pop(number).result() if number in self.started else None
            times = begun.times if begun is not None else times
            last = None
            for item in producer.items(shards, times, begun):
                if item.window is not last:
                    self.send(("window", lean_window(item.window)))
                    last = item.window
                if isinstance(item, WindowBatch):
                    times.collate += time.perf_counter() - item.batch.entered
                    self.send(("batch", self.ring.place(item.batch, self._wait), item.models))
                else:
                    self.send(("part", item.first_block, item.end_block, item.start_row, item.end_row, times,
                               producer.previous_rows))
                self._handle_waiting()
            producer.end_run(failed=False)
            self.send(("end", times, producer.previous_rows))
        except Exception as error:
            producer.end_run(failed=True)
            self.send(("error", portable(error), times, producer.previous_rows))


def main() -> None:
    connection, channel = child_channel()
    feeding = Feeding(connection, channel)
    forward = ForwardLogs(feeding.send)  # the producer's (--reuse's index, a reader's retries)
    logging.getLogger("pipeline").addHandler(forward)
    try:
        feeding.serve()
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the run's process left in the middle of a stream
        pass
    finally:
        logging.getLogger("pipeline").removeHandler(forward)
        if feeding.producer is not None:
            feeding.producer.close()


if __name__ == "__main__":
    main()
