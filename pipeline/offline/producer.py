"""The producer: everything on the host that turns shards into a run's batches — the reader processes, the
tokenizer pool, --reuse's index, windows, dedupe, planning and collate — and nothing of the device's.

A run's process holds one (`BatchProducer`) or hands the same work to a feeder process that runs one
(offline/feeder.py, on a CUDA device: there the run's process must keep its cores for the device). Either way
the shard runner sees the same five calls: `ready`, `start`, `items`, `end_run`, `close`. No torch here
(tests/test_layers.py): the feeder process never loads it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Iterator

from pipeline.core.buckets import BatchLimits
from pipeline.core.clock import StageTimes, timed
from pipeline.core.tokenize import TokenizerPool, TokenizerSpec
from pipeline.offline.carry import Carry, mark_carried
from pipeline.offline.config import RunConfig
from pipeline.offline.reader import ShardReaders
from pipeline.offline.reuse import PreviousOutput, mark_reused
from pipeline.offline.source import RowBlock, Shard
from pipeline.offline.windows import (
    BatchPacking,
    Window,
    WindowBatch,
    WindowPart,
    collated_parts,
    dedupe_windows,
    group_into_windows,
    submit_window,
    tokenize_windows,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ProducerSpec:
    """What making a run's batches takes of its settings and runtime, settled by the shard runner (picklable:
    a feeder process gets it). `carried_columns`: a change of models, the kept models' columns."""

    config: RunConfig
    packing: BatchPacking
    limits: BatchLimits  # the run's: the device loop lowers it, planning reads it (a feeder's copy is told)
    carry: Carry | None = None
    carried_columns: tuple[str, ...] = ()


@dataclasses.dataclass
class StartedShards:
    """Shards whose first window is read and with the tokenizer pool before their `run` begins
    (`ShardRunner.start`): a Ray actor starts its next shard so while the current one runs."""
    times: StageTimes  # the run's stage times, the first window's read included
    windows: Iterator[list[RowBlock]] | None  # the windows after the first (None: started by a feeder process)
    first: tuple[list[RowBlock], list] | None  # the first window and its pool handles; None: no rows
    pool: object  # what holds `first`: the tokenizer pool, or the feeder process and its number for the shards
    started_at: float  # time.time() when `start` began


class BatchProducer:
    """The producer in this process: the reader processes and the tokenizer pool (kept for every run with
    `keep_pool`, else one pool a run), --reuse's index (built once), and the run's batches (`items`)."""

    def __init__(self, tokenizer: TokenizerSpec, workers: int, keep_pool: bool = False):
        """The pool starts now (the engine makes the producer before the model loads), for the first run."""
        self.tokenizer, self.workers, self.keep_pool = tokenizer, workers, keep_pool
        self.spec: ProducerSpec | None = None
        self._pool: TokenizerPool | None = self._new_pool()
        self._run_pool: TokenizerPool | None = None
        self._readers = ShardReaders()
        self._previous: PreviousOutput | None = None
        self._previous_lock = threading.Lock()  # a Ray actor's next shard starts while the current one runs

    def configure(self, spec: ProducerSpec) -> None:
        self.spec = spec

    def _new_pool(self) -> TokenizerPool:
        return TokenizerPool(self.tokenizer, self.workers, wait=False)

    def ready(self) -> None:
        """Take the run's tokenizer pool (the one started before, else a new one) and wait for its processes."""
        pool = self._pool or self._new_pool()
        self._pool = pool if self.keep_pool else None
        self._run_pool = pool
        pool.ready()

    def start(self, shards: list[Shard]) -> StartedShards:
        """Read the first window of `shards` and hand it to the kept pool now, for a later `items(…, begun)`;
        safe while another run's `items` go on."""
        started_at, times = time.time(), StageTimes()
        pool = self._pool or self._new_pool()
        self._pool = pool
        windows = self._windows(shards, times)
        first = next(windows, None)
        return StartedShards(times, windows, first and submit_window(pool, first), pool, started_at)

    def items(self, shards: list[Shard], times: StageTimes,
              begun: StartedShards | None = None) -> Iterator[WindowBatch | WindowPart]:
        """The run's collated batches and window parts (`collated_parts`), after `ready`."""
        spec = self.spec
        return collated_parts(self._encoded_windows(shards, times, begun), spec.packing, spec.limits,
                              spec.carry and spec.carry.computed)

    def _encoded_windows(self, shards: list[Shard], times: StageTimes,
                         begun: StartedShards | None) -> Iterator[Window]:
        """The shards' windows as the pool tokenizes them (`begun`: the first already submitted), deduplicated."""
        pool = self._run_pool
        if begun is None:
            windows = tokenize_windows(pool, self._windows(shards, times), times)
        else:  # a pool replaced since (a failed run stops its own) gets the first window again
            first = begun.first if begun.pool is pool or not begun.first else submit_window(pool, begun.first[0])
            windows = tokenize_windows(pool, begun.windows, times, first)
        return dedupe_windows(windows) if self.spec.config.dedupe else windows

    def _windows(self, shards: list[Shard], times: StageTimes) -> Iterator[list[RowBlock]]:
        """The shards' rows in windows of row blocks, with --reuse's rows marked."""
        config = self.spec.config
        source, window_rows = config.source, self.spec.packing.window_rows
        blocks = timed(self._readers.blocks(shards, source.id_column, source.text_column, window_rows,
                                            source.storage_options, config.keep_columns, source.pair_column),
                       times, "read")
        grouped = group_into_windows(blocks, window_rows)
        if self.spec.carry is not None:
            return mark_carried(grouped, self._previous_output(), self.spec.carry, list(self.spec.carried_columns))
        return mark_reused(grouped, self._previous_output()) if config.reuse else grouped

    def end_run(self, failed: bool) -> bool:
        """After a run, ended or failed: its pool closed unless kept (a failed run's is closed too: it may be
        broken, the next run starts its own), the readers with it. Whether processes are kept for the next run."""
        pool, self._run_pool = self._run_pool, None
        if pool is not None and (failed or not self.keep_pool):
            pool.close()
            if pool is self._pool:
                self._pool = None
        if self._pool is None:
            self._readers.close()
        return self._pool is not None

    @property
    def previous_rows(self) -> int | None:
        """The rows --reuse's index holds (None: none built)."""
        return None if self._previous is None else self._previous.index.rows

    def _previous_output(self) -> PreviousOutput:
        """--reuse: yesterday's output and its index, built once for every run (a Ray actor's shards share it);
        removed when the producer goes."""
        with self._previous_lock:
            return self._index_previous_output() if self._previous is None else self._previous

    def _index_previous_output(self) -> PreviousOutput:
        started = time.perf_counter()
        config, carry = self.spec.config, self.spec.carry
        source = config.output if carry is not None else config.reuse  # a change of models: the output's own
        self._previous = PreviousOutput(source, config.source.storage_options, config.keep_columns,
                                        made_with=carry and carry.made_with)
        weakref.finalize(self, self._previous.close)
        log.info(f"{'carrying kept models from' if carry else '--reuse:'} indexed {self._previous.index.rows:,} rows "
                 f"of {len(self._previous.stems)} shard(s) of {source} in {time.perf_counter() - started:.2f}s")
        return self._previous

    def close(self) -> None:
        """Stop the kept pool (or one started for a run that never came: the claim failed) and the readers."""
        for pool in (self._pool, self._run_pool):  # the same one when kept: closing is idempotent
            if pool is not None:
                pool.close()
        self._pool = self._run_pool = None
        self._readers.close()
