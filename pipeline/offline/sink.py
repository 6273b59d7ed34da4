"""Writing one output Parquet file per input shard, atomically.

Rows stream into a hidden temporary file beside the final one (a name that Parquet
readers and `*.parquet` globs skip) and the file is renamed into place only when every
row of its shard has been written, so a partial output is never visible.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import fsspec
from fsspec.implementations.local import LocalFileSystem
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.core.errors import StorageError, UsageError, as_storage_error
from pipeline.core.clock import StageTimes
from pipeline.core.retry import retry_transient
from pipeline.offline.encoder import OutputEncoder, ParquetFile
from pipeline.offline.locations import shown_path
from pipeline.offline.manifest import RunManifest
from pipeline.offline.carry import carried_table
from pipeline.offline.reuse import ReuseCounts, TextHashSink, merge_reused
from pipeline.offline.source import RowBlock, Shard
from pipeline.offline.summary import IdTracker, RowStats, RunSummary, add_counts, top_counts
from pipeline.offline.windows import Window, WindowPart

log = logging.getLogger(__name__)


def temporary_stem(relative: str) -> str:
    """The shard stem of a temporary output `[DIR/].NAME.parquet.ATTEMPT.tmp` (path below the output)."""
    folder, _, name = relative.rpartition("/")
    return f"{folder}/" * bool(folder) + name[1:name.rindex(".parquet.")]


def output_paths(output_dir: str, stem: str) -> tuple[str, str]:
    """The final and a new temporary path of a shard's output; a stem `dt=X/part-0` (an input's
    path below its root) mirrors its folders under the output."""
    folder, _, name = f"{output_dir}/{stem}".rpartition("/")
    return f"{folder}/{name}.parquet", f"{folder}/.{name}.parquet.{uuid.uuid4().hex[:12]}.tmp"


class StaleAttempt(Exception):
    """This attempt's shard was granted to a newer attempt: it stands down without committing."""


class ShardWriter:
    """Streams one shard's output rows to a temporary file, then commits it by rename. An
    attempt token, where the engine grants one, fences the commit: only the holder renames.
    With an `encoder` (a local output) the file is encoded and written by the encoder process;
    folders, counts, fencing and the rename stay here."""

    def __init__(self, fs: fsspec.AbstractFileSystem, output_dir: str, shard: Shard, attempt: str | None = None,
                 encoder: OutputEncoder | None = None):
        self.fs = fs
        self.shard = shard
        self.attempt = attempt
        self.encoder = encoder
        self.final_path, self.temp_path = output_paths(output_dir, shard.stem)
        self.rows_written = 0
        self.bytes_written: int | None = None
        self._opened = False
        self._file: ParquetFile | None = None  # encoded here: an object store's output, or memory

    def write(self, table: pa.Table) -> None:
        try:
            if not self._opened:
                self.fs.makedirs(self.temp_path.rpartition("/")[0], exist_ok=True)  # a partition's folder
                if self.encoder is None:
                    self._file = ParquetFile(self.fs.open(self.temp_path, "wb"), table.schema)
                self._opened = True
            if self.encoder is None:
                self._file.write(table)
            else:
                self.encoder.write(self.temp_path, table)
        except Exception as error:
            raise as_storage_error(error, shown_path(self.fs, self.temp_path)) or error
        self.rows_written += table.num_rows

    def commit(self, manifest: RunManifest | None = None) -> str:
        """Close and rename into place; refuses if rows written ≠ rows in the input shard, and
        stands down (StaleAttempt, temporary file removed) if `manifest` has granted the shard
        to another attempt."""
        if self.rows_written != self.shard.num_rows:
            self.abort()
            raise RuntimeError(f"{self.shard.url}: wrote {self.rows_written} rows, input has "
                               f"{self.shard.num_rows}; output not committed")
        if manifest is not None:
            try:
                manifest.check_lock_held()  # a run whose lock was taken over or lapsed commits nothing more
            except StorageError:
                self.abort()
                raise
        holder = manifest.attempt_holder(self.shard.stem) if manifest is not None and self.attempt else None
        if holder not in (None, self.attempt):
            self.abort()
            raise StaleAttempt(f"{self.shard.url}: attempt {self.attempt} stood down, the shard was handed to "
                               f"attempt {holder}")
        try:
            self.bytes_written = self._close()  # recorded in the done marker: a rerun checks the file by it
        except Exception as error:
            raise as_storage_error(error, shown_path(self.fs, self.temp_path)) or error
        try:
            retry_transient(lambda: self.fs.mv(self.temp_path, self.final_path), f"committing {self.final_path}",
                            log=log.warning)
        except Exception as error:
            raise as_storage_error(error, shown_path(self.fs, self.final_path)) or error
        return self.final_path

    def _close(self) -> int:
        """Finish the temporary file: its bytes."""
        if self.encoder is not None:
            return self.encoder.close_file(self.temp_path)
        file, self._file = self._file, None
        return file.close()

    def abort(self) -> None:
        """Drop the temporary file; the final name is never touched. Closing may fail on the
        storage that failed the write (a full disk): the file goes all the same."""
        if not self._opened:
            return
        self._opened = False
        try:
            if self.encoder is not None:
                self.encoder.abort_file(self.temp_path)
            elif self._file is not None:
                self._file.close()
        except Exception as error:
            log.debug(f"closing {self.temp_path} before removing it: {type(error).__name__}: {error}")
        finally:
            self._file = None
            if self.fs.exists(self.temp_path):
                self.fs.rm(self.temp_path)


TEMPORARY_NAME = re.compile(r"\..+\.parquet\..+\.tmp")  # .NAME.parquet.ATTEMPT.tmp


class ShardSink:
    """One ShardWriter per shard in flight. Opening resolves the filesystem only; `create`
    makes the output directory, once the run's settings and model have been checked, so a
    usage error leaves the output untouched."""

    def __init__(self, output: str, storage_options: dict | None = None, attempt: str | None = None):
        self.output = output
        self.attempt = attempt  # the token of this attempt, where the engine grants shards (Ray)
        try:
            self.fs, self.output_dir = fsspec.core.url_to_fs(output, **(storage_options or {}))
        except (ImportError, ValueError, OSError) as error:
            raise UsageError(f"cannot open output directory {output!r}: {error}; check --output") from error
        self.output_dir = self.output_dir.rstrip("/")
        self.encoder: OutputEncoder | None = None  # set by the runner for a local output (`uses_encoder`)
        self._writers: dict[int, ShardWriter] = {}
        self.committed: dict[int, str] = {}  # shard index → final path, for outputs committed so far
        self.committed_bytes: dict[int, int | None] = {}  # shard index → size of its committed output

    def create(self) -> None:
        """Make the output directory. Storage that refuses it is a StorageError (exit 4), as any
        later write it refuses; another OSError (a path through a file) is a usage error."""
        try:
            self.fs.makedirs(self.output_dir, exist_ok=True)
        except OSError as error:
            refused = as_storage_error(error, shown_path(self.fs, self.output_dir))
            if refused is not None:
                raise refused from error
            raise UsageError(f"cannot create output directory {self.output!r}: {error}; check --output") from error

    @property
    def uses_encoder(self) -> bool:
        """Whether an encoder process can write this output: a local one (it opens the same paths)."""
        return isinstance(self.fs, LocalFileSystem)

    def write(self, shard_index: int, shard: Shard, table: pa.Table) -> None:
        if shard_index not in self._writers:
            self._writers[shard_index] = ShardWriter(self.fs, self.output_dir, shard, self.attempt, self.encoder)
        self._writers[shard_index].write(table)

    def commit(self, shard_index: int, manifest: RunManifest | None = None) -> str:
        writer = self._writers[shard_index]
        path = writer.commit(manifest)  # on failure the writer stays, so abort() finds it
        del self._writers[shard_index]
        self.committed[shard_index] = path
        self.committed_bytes[shard_index] = writer.bytes_written
        return path

    def abort(self, shard_index: int) -> None:
        writer = self._writers.pop(shard_index, None)
        if writer is not None:
            writer.abort()

    def stale_temporaries(self, stems: list[str]) -> list[str]:
        """Temporary outputs of these shards that an attempt left behind (killed, or running now)."""
        mine = set(stems)
        temporaries = [path[len(self.output_dir) + 1:] for path in self.fs.find(self.output_dir)
                       if TEMPORARY_NAME.fullmatch(path.rsplit("/", 1)[-1])]
        return [f"{self.output_dir}/{path}" for path in temporaries if temporary_stem(path) in mine]

    def remove_stale_temporaries(self, stems: list[str]) -> int:
        """Delete temporary outputs a killed attempt left behind for these shards (call under
        the lock of the worker that owns them: another worker's live files are never touched)."""
        stale = self.stale_temporaries(stems)
        for path in stale:
            self.fs.rm(path)
        return len(stale)

    def remove_outputs(self, stems: list[str]) -> None:
        """Delete these shards' committed outputs, or a folder in an output's place (for --overwrite, and
        before a shard whose output does not back its marker is redone: nothing old stays visible)."""
        for stem in stems:
            path = output_paths(self.output_dir, stem)[0]
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)

    def settle(self) -> None:
        """Wait until the encoder process (if any) has read every table written so far: the window
        memory its columns point into may be reused after that."""
        if self.encoder is not None:
            self.encoder.settle()

    def abort_all(self) -> None:
        for writer in self._writers.values():
            writer.abort()
        self._writers.clear()


ColumnsOf = Callable[[dict, np.ndarray, int], dict]  # (outputs, valid, rows) → the job's Arrow columns
CountFlagged = Callable[[pa.Table], tuple[int, dict]]  # output rows → (rows flagged, flag label → rows)
FoldSegments = Callable[[dict, np.ndarray, np.ndarray], dict]  # the job's fold_segments (jobs/base.py)


def output_table(block: RowBlock, window: Window, start: int, columns_of: ColumnsOf,
                 fold_segments: FoldSegments | None = None) -> pa.Table:
    """The output rows of one block: id, the kept input columns, the job's columns (with
    --long-text split: a split row's folded from its segments, and `segments`), truncated,
    error — in input order."""
    positions = slice(start, start + block.num_rows)
    valid = window.valid[positions]
    columns = columns_of(window.row_outputs(positions.start, positions.stop, fold_segments), valid, block.num_rows)
    if window.segment_counts is not None:
        columns["segments"] = pa.array(np.maximum(window.segment_counts[positions], 1), pa.int32(), mask=~valid)
    columns = {"id": block.ids, **block.kept, **columns,
               "truncated": pa.array(window.encoded.truncated[positions] & valid, pa.bool_()),
               "error": pa.array(window.encoded.errors[positions], pa.string())}
    return pa.table(columns)


MARKER_ERROR_REASONS = 10  # reasons a done marker keeps; the output's `error` column has every row's


@dataclass
class ShardCounts:
    """What one shard's output holds, kept in its done marker so that the output's totals are a
    sum over markers, whichever runs wrote them (`summary.output_totals`)."""

    rows: int = 0
    error_rows: int = 0
    truncated_rows: int = 0
    error_reasons: dict = field(default_factory=dict)  # row error → rows
    flagged_rows: int | None = None  # job moderate
    flagged_by_label: dict = field(default_factory=dict)
    split_rows: int = 0  # --long-text split: rows longer than --max-length, scored as segments
    segments: int = 0  # the segments of those rows
    truncated_unflagged_rows: int = 0  # job moderate: truncated rows not flagged (the cut-off rest was not judged)

    def marker_keys(self) -> dict:
        """The counts as a done marker's keys (the most frequent error reasons only)."""
        return {**dataclasses.asdict(self), "error_reasons": top_counts(self.error_reasons, MARKER_ERROR_REASONS)}

    def add(self, table: pa.Table, count_flagged) -> None:
        """Count one written block, read off the table itself (a row reused from a previous
        output never ran here, so the window knows nothing of it)."""
        self.rows += table.num_rows
        self.error_rows += table.num_rows - table["error"].null_count
        self.truncated_rows += int(pc.sum(table["truncated"]).as_py() or 0)
        if "segments" in table.column_names:
            split = pc.greater(table["segments"], 1)
            self.split_rows += int(pc.sum(split).as_py() or 0)
            self.segments += int(pc.sum(pc.if_else(split, table["segments"], 0)).as_py() or 0)
        if "flagged" in table.column_names:
            unflagged = pc.and_(table["truncated"], pc.invert(pc.fill_null(table["flagged"], True)))
            self.truncated_unflagged_rows += int(pc.sum(unflagged).as_py() or 0)
        if self.error_rows:
            for count in pc.value_counts(table["error"].drop_null()).to_pylist():
                self.error_reasons[count["values"]] = self.error_reasons.get(count["values"], 0) + count["counts"]
        if count_flagged is not None:
            rows, by_label = count_flagged(table)
            self.flagged_rows = (self.flagged_rows or 0) + rows
            for label, hits in by_label.items():
                self.flagged_by_label[label] = self.flagged_by_label.get(label, 0) + hits


class WindowWriter:
    """Writes finished window parts block by block and commits each shard whose last row it
    holds, then marks it done with its counts. A shard that failed (while being read, or at its
    commit) is dropped whole: its temporary file is deleted and nothing of it is committed."""

    def __init__(self, sink: ShardSink, manifest: RunManifest, shards: list[Shard], columns_of: ColumnsOf,
                 times: StageTimes, count_flagged: CountFlagged | None = None, ids: IdTracker | None = None,
                 fold_segments: FoldSegments | None = None):
        self.sink, self.manifest, self.shards = sink, manifest, shards
        self.columns_of = columns_of
        self.count_flagged = count_flagged
        self.fold_segments = fold_segments
        self.times = times
        self.failures: dict[int, str] = {}  # shard index → why it failed
        self.counts: dict[int, ShardCounts] = {}  # shard index → what its output holds so far
        self.ids = ids or IdTracker()  # an engine's own tracker counts duplicate ids across its runners
        self.row_stats = RowStats()
        self.text_hashes = TextHashSink(manifest, lambda: sink.encoder)  # what tomorrow's --reuse recognises rows by
        self.reuse_counts: dict[int, ReuseCounts] = {}  # --reuse: shard index → what it did with its rows

    def write(self, part: WindowPart) -> None:
        started = time.perf_counter()
        window, start = part.window, part.start_row
        for block in part.blocks:
            positions = slice(start, start + block.num_rows)
            start += block.num_rows
            if block.failure is not None:
                self.failures[block.shard_index] = block.failure
                self.sink.abort(block.shard_index)
                self.text_hashes.abort(block.shard_index)
            if block.shard_index in self.failures:
                continue
            shard = self.shards[block.shard_index]
            table = merge_reused(output_table(block, window, positions.start, self.columns_of, self.fold_segments),
                                 block.reuse)
            if block.reuse is not None and block.reuse.carried:
                table = carried_table(table)
            self.sink.write(block.shard_index, shard, table)
            self.text_hashes.write(block.shard_index, shard, block, table["error"])
            counts = self.counts.setdefault(block.shard_index, ShardCounts())
            counts.add(table, self.count_flagged)
            if block.reuse is not None and block.reuse.matches is not None:
                self.reuse_counts.setdefault(block.shard_index, ReuseCounts()).add(block.reuse, table["error"])
            if block.is_last_of_shard:
                try:
                    self.sink.commit(block.shard_index, self.manifest)
                    self.text_hashes.commit(block.shard_index)
                except StaleAttempt as stale:  # a newer attempt owns the shard: neither committed nor failed here
                    log.warning(str(stale))
                    self.text_hashes.abort(block.shard_index)
                    continue
                except StorageError:  # the output's storage fails every shard alike: the run stops
                    raise
                except Exception as error:  # e.g. the row count is wrong
                    self.failures[block.shard_index] = f"committing the output failed: {type(error).__name__}: {error}"
                    self.sink.abort(block.shard_index)
                    self.text_hashes.abort(block.shard_index)
                    continue
                self.manifest.mark(shard.stem, "done", input=shard.url, host=socket.gethostname(), pid=os.getpid(),
                                   bytes=self.sink.committed_bytes[block.shard_index], **counts.marker_keys(),
                                   **({"attempt": self.sink.attempt} if self.sink.attempt else {}))
            if block.reuse is not None:  # the hashes the workers (or --reuse) made; a null id is not counted
                self.ids.add_hashes(block.reuse.hashes.id_hashes[block.ids.is_valid().to_numpy(zero_copy_only=False)])
            else:
                self.ids.add(block.ids.to_pylist())
            valid = window.valid[positions]
            self.row_stats.add(window.encoded.full_lengths[positions][valid], window.encoded.errors[positions])
        if part.end_row == window.num_rows:  # once its tables are encoded nothing reads its outputs
            self.sink.settle()
            window.release_outputs()
        self.times.write += time.perf_counter() - started

    def finish(self, summary: RunSummary) -> None:
        """Drop shards left open (a failure, --fail-fast, an interrupt), mark failed shards
        failed, and put this run's rows, errors, truncations and duplicate ids into `summary`."""
        self.sink.abort_all()
        self.text_hashes.abort_all()
        for shard_index, reason in sorted(self.failures.items()):
            shard = self.shards[shard_index]
            self.manifest.mark(shard.stem, "failed", input=shard.url, error=reason)
            summary.failed_shards.append({"shard": shard.url, "error": reason})
        committed = [self.counts[i] for i in self.sink.committed if i in self.counts]
        summary.rows = sum(c.rows for c in committed)
        summary.error_rows = sum(c.error_rows for c in committed)
        summary.truncated_rows = sum(c.truncated_rows for c in committed)
        summary.split_rows = sum(c.split_rows for c in committed)
        summary.segments = sum(c.segments for c in committed)
        reuse = [self.reuse_counts[i] for i in self.sink.committed if i in self.reuse_counts]
        summary.reused_rows = sum(c.reused for c in reuse)
        summary.computed_rows = summary.rows - summary.reused_rows
        summary.reuse = {"reused_by_text": sum(c.by_text for c in reuse), "moved": sum(c.moved for c in reuse),
                         "new": sum(c.new for c in reuse), "edited": sum(c.edited for c in reuse),
                         "retried": sum(c.retried for c in reuse), "fixed": sum(c.fixed for c in reuse),
                         "skipped": sum(c.skipped for c in reuse),
                         **({"carried": sum(c.carried or 0 for c in reuse)}
                            if any(c.carried is not None for c in reuse) else {})} \
            if reuse else {}
        if self.count_flagged is not None:
            summary.flagged_rows = sum(c.flagged_rows or 0 for c in committed)
            summary.truncated_unflagged_rows = sum(c.truncated_unflagged_rows for c in committed)
            summary.flagged_by_label = add_counts(c.flagged_by_label for c in committed)
        summary.duplicate_ids, summary.duplicate_id_examples = self.ids.duplicates(self.sink.fs,
                                                                                   self.sink.committed.values())
        summary.token_lengths, summary.error_reasons = self.row_stats.token_lengths(), self.row_stats.top_reasons()


class BackgroundWriter:
    """A WindowWriter on its own thread, fed in order through a bounded queue, so that Parquet
    encoding, object-store uploads, commits and id hashing never hold up the device loop. At
    most `depth` window parts wait; a write error is raised at the next `write` or at `close`."""

    def __init__(self, writer: WindowWriter, depth: int = 2):
        self.writer = writer
        self.parts: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._write_queued, name="lengthwise-writer", daemon=True)
        self.thread.start()

    def _write_queued(self) -> None:
        while (part := self.parts.get()) is not None:
            if self.error is None:  # after an error, later parts are dropped: their shards stay undone
                try:
                    self.writer.write(part)
                except BaseException as error:  # raised in the device loop's thread
                    self.error = error

    @property
    def failures(self) -> dict[int, str]:
        """Shards whose failure the writer has seen so far (up to `depth` parts late)."""
        return self.writer.failures

    def write(self, part: WindowPart) -> None:
        self._raise_error()
        self.parts.put(part)

    def close(self, raise_error: bool = True) -> None:
        """Wait for the queued parts to be written; idempotent."""
        if self.thread.is_alive():
            self.parts.put(None)
            self.thread.join()
        if raise_error:
            self._raise_error()

    def _raise_error(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error
