"""`--reuse PREV_OUTPUT`: copy yesterday's result of every row whose id and text are unchanged,
wherever it is now, and send only new and edited rows (and rows whose error a retry may fix) to the device.

How a row is recognised: every commit also writes `OUTPUT/.lengthwise/text-hashes/<stem>.hashes`
(Parquet), one row per output row, in output order: `id_hash` (64-bit blake2b of the id),
`text_hash` (64-bit blake2b of the text) and `status` (OK, an error a retry may fix, one it
cannot). Not a user-facing column: readers of the output never see it. A file of an older
version has no `status` and a null text hash for every error: those rows are retried.

How it finds rows whatever the shard names: at the start of a run the hash files of every done
previous shard go into a `ReuseIndex` (offline/reuse_index.py: sorted runs on local disk, 41 bytes
a row, memory bounded by its bucket size), keyed by (id hash, text hash) and by text hash. A row
moved to another shard or a renamed partition is found all the same, and a text seen yesterday
under another id too. The results are then read from the previous outputs shard by shard, a
Parquet row group at a time (the last few kept).
"""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.core.errors import UsageError
from pipeline.core.retry import retry_transient
from pipeline.offline.locations import same_location
from pipeline.offline.manifest import MANIFEST_DIR, RunManifest, fingerprint_differences, remove_temporaries
from pipeline.offline.reuse_index import (
    BUCKET_ROWS,
    EDITED,
    HASH_BATCH_ROWS,
    NEW,
    OK,
    PERMANENT_ERROR,
    RETRY,
    RETRYABLE_ERROR,
    ReuseIndex,
    RowMatches,
)
from pipeline.offline.source import RowBlock, Shard
from pipeline.offline.summary import id_hash

log = logging.getLogger(__name__)

HASHES_DIR = "text-hashes"
HASH_SCHEMA = pa.schema([("id_hash", pa.int64()), ("text_hash", pa.int64()), ("status", pa.int8())])
# row errors that may not come back on a retry (memory, the device, a numeric blow-up); the others (a null, empty,
# tokenless or undecodable text, a null id) come back every time, so those rows are reused with their error
RETRYABLE_ERRORS = ("out of memory", "the model gave a non-finite output")
HASH_TEMPORARY = re.compile(r"(?P<stem>.+)\.hashes\.[0-9a-f]{12}\.tmp")  # [DIR/]STEM.hashes.ATTEMPT.tmp


def text_hash(value) -> int | None:
    """A stable 64-bit hash of a row's text (str or bytes); None for a null text."""
    if value is None:
        return None
    data = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else bytes(value)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


@dataclass
class RowHashes:
    """One block's id and text hashes (`text_hashes` null where the text is, or the id is, null)."""

    id_hashes: np.ndarray  # int64
    text_hashes: pa.Array  # int64 with nulls


def hash_rows(ids: pa.Array, texts: pa.Array) -> RowHashes:
    id_values = ids.to_pylist()
    id_hashes = np.fromiter((id_hash(v) if v is not None else 0 for v in id_values), np.int64, len(id_values))
    text_hashes = pa.array([text_hash(t) if i is not None else None for i, t in zip(id_values, texts.to_pylist())],
                           pa.int64())
    return RowHashes(id_hashes, text_hashes)


@dataclass
class ReusedRows:
    """Which rows of a block take yesterday's result, and those results (in block order)."""

    hashes: RowHashes  # of every row of the block, texts as they were read (for today's text-hash file)
    mask: np.ndarray  # bool per block row
    results: pa.Table | None  # the previous output's columns but id and kept ones, one row per reused row
    matches: RowMatches | None = None  # how each row was found in the previous output


def hashes_path(root: str, stem: str) -> str:
    """A Parquet file, named without `.parquet` so that a `**/*.parquet` glob of the output never takes it."""
    return f"{root}/{HASHES_DIR}/{stem}.hashes"


def remove_stale_hash_temporaries(manifest: RunManifest, stems: list[str]) -> int:
    """Delete text-hash files a killed attempt left half-written for these shards; call, like
    ShardSink.remove_stale_temporaries, under the lock of the worker that owns the shards."""
    return remove_temporaries(manifest.fs, f"{manifest.root}/{HASHES_DIR}", HASH_TEMPORARY, stems)


def error_status(error: str | None) -> int:
    if error is None:
        return OK
    return RETRYABLE_ERROR if error.startswith(RETRYABLE_ERRORS) else PERMANENT_ERROR


class TextHashSink:
    """Writes each shard's text-hash file beside the output, streamed, committed by rename."""

    def __init__(self, manifest: RunManifest):
        self.fs, self.root = manifest.fs, manifest.root
        self._writers: dict[int, tuple[pq.ParquetWriter, object, str, str]] = {}

    def write(self, shard_index: int, shard: Shard, block: RowBlock, errors: pa.Array) -> None:
        """Hash one block's rows, with each row's status: OK, an error a retry may fix, or one it cannot."""
        hashes = block.reuse.hashes if block.reuse is not None else hash_rows(block.ids, block.texts)
        status = pa.array([error_status(error) for error in errors.to_pylist()], pa.int8())
        if shard_index not in self._writers:
            final = hashes_path(self.root, shard.stem)
            temp = f"{final}.{uuid.uuid4().hex[:12]}.tmp"
            self.fs.makedirs(final.rpartition("/")[0], exist_ok=True)
            file = self.fs.open(temp, "wb")
            self._writers[shard_index] = (pq.ParquetWriter(file, HASH_SCHEMA), file, temp, final)
        self._writers[shard_index][0].write_table(pa.table([pa.array(hashes.id_hashes), hashes.text_hashes, status],
                                                           schema=HASH_SCHEMA))

    def commit(self, shard_index: int) -> None:
        """Called right after the shard's output is committed (its last block was written here too)."""
        writer, file, temp, final = self._writers.pop(shard_index)
        writer.close()
        file.close()
        retry_transient(lambda: self.fs.mv(temp, final), f"committing {final}", log=log.warning)

    def abort_all(self) -> None:
        for shard_index in list(self._writers):
            self.abort(shard_index)

    def abort(self, shard_index: int) -> None:
        entry = self._writers.pop(shard_index, None)
        if entry is not None:
            writer, file, temp, _ = entry
            try:
                writer.close()
                file.close()
            finally:
                if self.fs.exists(temp):
                    self.fs.rm(temp)


REUSE_ADVICE = "it says which settings the --reuse output was made with: name another --reuse, or drop --reuse"


def check_reusable(previous: str, output: str, storage_options: dict, fingerprint: dict) -> None:
    """--reuse names another lengthwise output made with the same fingerprint; else a usage error
    (exit 2) saying what differs."""
    fs, previous_dir = fsspec.core.url_to_fs(previous, **storage_options)
    if same_location(previous, output, storage_options):  # also through a symlink or `d/../d`
        raise UsageError(f"--reuse {previous} is --output itself; name yesterday's output (a rerun into the same "
                         "output resumes without --reuse)")
    recorded = RunManifest(fs, previous_dir.rstrip("/")).read_run(REUSE_ADVICE)
    if recorded is None:
        raise UsageError(f"--reuse {previous} is no lengthwise output (no {MANIFEST_DIR}/run.json); check --reuse")
    if recorded["fingerprint"] != fingerprint:
        raise UsageError(f"--reuse {previous} was made with other settings "
                         f"({'; '.join(fingerprint_differences(recorded['fingerprint'], fingerprint))}); its results "
                         "would differ from this run's: run with the same settings, or drop --reuse")


def recorded_dtype(previous: str, storage_options: dict) -> str | None:
    """The dtype the previous output was made with (so `--dtype auto` matches it)."""
    fs, previous_dir = fsspec.core.url_to_fs(previous, **storage_options)
    recorded = RunManifest(fs, previous_dir.rstrip("/")).read_run(REUSE_ADVICE)
    return recorded and recorded["fingerprint"].get("dtype")


def recorded_long_text(previous: str, storage_options: dict) -> str | None:
    """How the previous output treated long rows (so `--long-text auto` matches it): truncate
    where its fingerprint says nothing (made before --long-text split existed)."""
    fs, previous_dir = fsspec.core.url_to_fs(previous, **storage_options)
    recorded = RunManifest(fs, previous_dir.rstrip("/")).read_run(REUSE_ADVICE)
    return recorded and recorded["fingerprint"].get("long_text", "truncate")


class PreviousOutput:
    """Yesterday's output (--reuse): its done shards with an output and a text-hash file of as many
    rows, indexed by id and text (`index`), and their results read by row group on demand."""

    KEPT_FILES = 8
    KEPT_ROW_GROUPS = 16

    def __init__(self, previous: str, storage_options: dict, keep_columns: Iterable[str],
                 bucket_rows: int = BUCKET_ROWS):
        self.fs, directory = fsspec.core.url_to_fs(previous, **storage_options)
        self.directory = directory.rstrip("/")
        self.manifest = RunManifest(self.fs, self.directory)
        self.fixed_columns = {"id", *keep_columns}  # taken from today's input, never from yesterday
        done = sorted(stem for stem, m in self.manifest.shard_markers().items() if m["status"] == "done")
        counted = {stem: rows for stem in done if (rows := self._hash_rows(stem)) is not None}
        self.stems: list[str] = list(counted)  # a previous shard's number in the index → its stem
        self.index = ReuseIndex(total_rows=sum(counted.values()), bucket_rows=bucket_rows)
        for number, stem in enumerate(self.stems):  # one hash file open at a time
            with self.fs.open(hashes_path(self.manifest.root, stem), "rb") as f:
                self.index.add_shard(number, pq.ParquetFile(f).iter_batches(HASH_BATCH_ROWS))
        self.index.finish()
        self._files: dict[int, tuple[pq.ParquetFile, np.ndarray, list[str]]] = {}
        self._groups: dict[tuple[int, int], pa.Table] = {}

    def _hash_rows(self, stem: str) -> int | None:
        """The rows of a previous shard's hash file, if its output is there with as many rows (from the footers)."""
        path, hashes = f"{self.directory}/{stem}.parquet", hashes_path(self.manifest.root, stem)
        if not self.fs.exists(path) or not self.fs.exists(hashes):
            return None
        with self.fs.open(hashes, "rb") as f:
            hash_rows = pq.ParquetFile(f).metadata.num_rows
        with self.fs.open(path, "rb") as f:
            output_rows = pq.ParquetFile(f).metadata.num_rows
        if output_rows != hash_rows:
            log.warning(f"--reuse: {path} and its text hashes disagree on the row count; its rows are not reused")
            return None
        return hash_rows

    def rows(self, shards: np.ndarray, rows: np.ndarray) -> pa.Table:
        """The previous outputs' id and result columns at (shard, row), in that order: fetched shard by shard,
        a Parquet row group at a time."""
        parts, order = [], []
        for shard in np.unique(shards).tolist():
            positions = np.flatnonzero(shards == shard)
            parts.append(self._shard_rows(shard, rows[positions]))
            order.append(positions)
        table = pa.concat_tables(parts, promote_options="permissive") if len(parts) > 1 else parts[0]
        inverse = np.empty(len(shards), np.int64)
        inverse[np.concatenate(order)] = np.arange(len(shards))
        return table.take(pa.array(inverse))

    def _shard_rows(self, shard: int, rows: np.ndarray) -> pa.Table:
        file, group_starts, columns = self._file(shard)
        groups = np.searchsorted(group_starts, rows, side="right") - 1
        parts, offsets, start = [], {}, 0
        for group in dict.fromkeys(groups.tolist()):
            key = (shard, group)
            if key not in self._groups:
                if len(self._groups) >= self.KEPT_ROW_GROUPS:
                    self._groups.pop(next(iter(self._groups)))
                self._groups[key] = file.read_row_group(group, columns=columns)
            table = self._groups[key]
            offsets[group] = start - int(group_starts[group])
            parts.append(table)
            start += table.num_rows
        local = rows + np.array([offsets[g] for g in groups.tolist()], np.int64)
        return pa.concat_tables(parts).take(pa.array(local))

    def _file(self, shard: int) -> tuple[pq.ParquetFile, np.ndarray, list[str]]:
        if shard not in self._files:
            if len(self._files) >= self.KEPT_FILES:
                self._files.pop(next(iter(self._files)))[0].close()
            file = pq.ParquetFile(self.fs.open(f"{self.directory}/{self.stems[shard]}.parquet", "rb"))
            sizes = [file.metadata.row_group(i).num_rows for i in range(file.metadata.num_row_groups)]
            columns = ["id", *(name for name in file.schema_arrow.names if name not in self.fixed_columns)]
            self._files[shard] = (file, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), columns)
        return self._files[shard]

    def close(self) -> None:
        for file, _, _ in self._files.values():
            file.close()
        self._files.clear()
        self._groups.clear()
        self.index.close()


def mark_reused(windows: Iterable[list[RowBlock]], previous: PreviousOutput) -> Iterator[list[RowBlock]]:
    """Each window's blocks with `reuse` set: the rows whose id and text (or text alone) are in the
    previous output, in any shard, take its results, and their texts are dropped so they are not tokenized."""
    for blocks in windows:
        yield [block if block.failure is not None else reuse_block(block, previous) for block in blocks]


def reuse_block(block: RowBlock, previous: PreviousOutput) -> RowBlock:
    hashes = hash_rows(block.ids, block.texts)
    has_text = hashes.text_hashes.is_valid().to_numpy(zero_copy_only=False)
    matches = previous.index.match(hashes.id_hashes, hashes.text_hashes.fill_null(0).to_numpy(), has_text)
    mask = matches.reused
    results = None
    if mask.any():
        results = previous.rows(matches.shard[mask], matches.row[mask])
        today_ids = block.ids.filter(pa.array(mask))
        same_id = np.array([a == b for a, b in zip(results["id"].to_pylist(), today_ids.to_pylist())], bool)
        collided = ~same_id & ~matches.by_text[mask]  # a 64-bit id hash collision: compute those rows
        if collided.any():
            rows = np.flatnonzero(mask)[collided]
            mask[rows], matches.kind[rows], matches.by_text[rows] = False, NEW, False
            results = results.filter(pa.array(~collided))
        results = results.drop_columns(["id"])
    texts = pc.if_else(pa.array(mask), pa.scalar(None, block.texts.type), block.texts)
    return replace(block, texts=texts, reuse=ReusedRows(hashes, mask, results, matches))


@dataclass
class ReuseCounts:
    """What --reuse did with one shard's rows: reused (by id and text, or by text under another id), and
    why the others were computed (new: an id yesterday had not; edited: another text; a row without a text
    is neither). `sources`: previous shard → rows reused from it by id."""

    reused: int = 0
    by_text: int = 0
    new: int = 0
    edited: int = 0
    retried: int = 0
    fixed: int = 0
    sources: dict = field(default_factory=dict)

    def add(self, reused: ReusedRows, errors: pa.Array) -> None:
        matches = reused.matches
        self.reused += int(reused.mask.sum())
        self.by_text += int(matches.by_text.sum())
        computed = ~reused.mask & reused.hashes.text_hashes.is_valid().to_numpy(zero_copy_only=False)
        self.new += int((computed & (matches.kind == NEW)).sum())
        self.edited += int((computed & (matches.kind == EDITED)).sum())
        retried = matches.kind == RETRY
        self.retried += int(retried.sum())
        self.fixed += int((retried & errors.is_null().to_numpy(zero_copy_only=False)).sum())
        by_id = reused.mask & ~matches.by_text
        for shard, rows in zip(*np.unique(matches.shard[by_id], return_counts=True)):
            self.sources[int(shard)] = self.sources.get(int(shard), 0) + int(rows)

    @property
    def moved(self) -> int:
        """Rows reused by id from another previous shard than the one most of this shard's rows came from
        (a renamed partition moves nothing)."""
        return sum(self.sources.values()) - max(self.sources.values(), default=0)


def merge_reused(computed: pa.Table, reused: ReusedRows | None) -> pa.Table:
    """The block's output rows with the reused rows' result columns taken from yesterday."""
    if reused is None or not reused.mask.any():
        return computed
    rows = computed.num_rows
    order = np.arange(rows)
    order[reused.mask] = rows + np.arange(int(reused.mask.sum()))
    columns = []
    for output_field in computed.schema:
        column = computed[output_field.name]
        if output_field.name in reused.results.column_names:
            previous = reused.results[output_field.name].combine_chunks()
            combined = pa.concat_arrays([column.combine_chunks(), previous.cast(output_field.type)])
            column = combined.take(pa.array(order))
        columns.append(column)
    return pa.table(columns, schema=computed.schema)
