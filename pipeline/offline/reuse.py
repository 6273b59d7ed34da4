"""`--reuse PREV_OUTPUT`: copy yesterday's result of every row whose id and text are unchanged,
and send only new and edited rows to the device.

How a row is recognised: every commit also writes `OUTPUT/.lengthwise/text-hashes/<stem>.hashes`
(Parquet), one row per output row, in output order: `id_hash` (64-bit blake2b of the id) and `text_hash`
(64-bit blake2b of the text; null for a row that had an error, so it is computed again). Not a
user-facing column: readers of the output never see it.

How it stays cheap for 100M-row tables: rows are matched shard by shard — today's input shard
with the previous output's shard of the same name (its path below the input root, so hive
partitions match partition by partition). While a shard is read, only the previous shard's
hashes are held (24 bytes a row: the two hashes and a sort order) and the previous results are
read by Parquet row group (one window's worth), so memory follows the largest shard's row
count, never the table's. A row that moved to another shard is computed again.
"""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.core.errors import UsageError
from pipeline.core.retry import retry_transient
from pipeline.offline.manifest import MANIFEST_DIR, RunManifest, fingerprint_differences, remove_temporaries
from pipeline.offline.source import RowBlock, Shard
from pipeline.offline.summary import id_hash

log = logging.getLogger(__name__)

HASHES_DIR = "text-hashes"
HASH_SCHEMA = pa.schema([("id_hash", pa.int64()), ("text_hash", pa.int64())])
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


def hashes_path(root: str, stem: str) -> str:
    """A Parquet file, named without `.parquet` so that a `**/*.parquet` glob of the output never takes it."""
    return f"{root}/{HASHES_DIR}/{stem}.hashes"


def remove_stale_hash_temporaries(manifest: RunManifest, stems: list[str]) -> int:
    """Delete text-hash files a killed attempt left half-written for these shards; call, like
    ShardSink.remove_stale_temporaries, under the lock of the worker that owns the shards."""
    return remove_temporaries(manifest.fs, f"{manifest.root}/{HASHES_DIR}", HASH_TEMPORARY, stems)


class TextHashSink:
    """Writes each shard's text-hash file beside the output, streamed, committed by rename."""

    def __init__(self, manifest: RunManifest):
        self.fs, self.root = manifest.fs, manifest.root
        self._writers: dict[int, tuple[pq.ParquetWriter, object, str, str]] = {}

    def write(self, shard_index: int, shard: Shard, block: RowBlock, errors: pa.Array) -> None:
        """Hash one block's rows (a row with an error gets a null text hash: never reused)."""
        hashes = block.reuse.hashes if block.reuse is not None else hash_rows(block.ids, block.texts)
        text_hashes = pc.if_else(errors.is_null(), hashes.text_hashes, pa.scalar(None, pa.int64()))
        if shard_index not in self._writers:
            final = hashes_path(self.root, shard.stem)
            temp = f"{final}.{uuid.uuid4().hex[:12]}.tmp"
            self.fs.makedirs(final.rpartition("/")[0], exist_ok=True)
            file = self.fs.open(temp, "wb")
            self._writers[shard_index] = (pq.ParquetWriter(file, HASH_SCHEMA), file, temp, final)
        self._writers[shard_index][0].write_table(pa.table([pa.array(hashes.id_hashes), text_hashes],
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
    output_fs, output_dir = fsspec.core.url_to_fs(output, **storage_options)
    if (fs.unstrip_protocol(previous_dir.rstrip("/")) == output_fs.unstrip_protocol(output_dir.rstrip("/"))):
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


class PreviousShard:
    """The previous output of one shard: its row hashes, sorted by id hash for lookup, and its
    results read by row group on demand (the last few kept)."""

    KEPT_ROW_GROUPS = 4

    def __init__(self, fs, path: str, hashes: pa.Table, fixed_columns: set[str]):
        self.fs, self.path = fs, path
        self.id_hashes = hashes["id_hash"].to_numpy()
        self.text_hashes = hashes["text_hash"].fill_null(0).to_numpy()
        self.reusable = hashes["text_hash"].is_valid().to_numpy(zero_copy_only=False)
        self.order = np.argsort(self.id_hashes, kind="stable")
        self.sorted_ids = self.id_hashes[self.order]
        self.file = pq.ParquetFile(fs.open(path, "rb"))
        self.result_columns = [name for name in self.file.schema_arrow.names if name not in fixed_columns]
        sizes = [self.file.metadata.row_group(i).num_rows for i in range(self.file.metadata.num_row_groups)]
        self.group_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.groups: dict[int, pa.Table] = {}

    def match(self, hashes: RowHashes) -> np.ndarray:
        """The previous row position of each row whose id and text are unchanged, else -1."""
        if not len(self.sorted_ids):
            return np.full(len(hashes.id_hashes), -1, np.int64)
        found = np.minimum(np.searchsorted(self.sorted_ids, hashes.id_hashes), len(self.sorted_ids) - 1)
        positions = self.order[found]
        today = hashes.text_hashes
        same = ((self.sorted_ids[found] == hashes.id_hashes) & today.is_valid().to_numpy(zero_copy_only=False)
                & self.reusable[positions] & (self.text_hashes[positions] == today.fill_null(0).to_numpy()))
        return np.where(same, positions, -1)

    def rows(self, positions: np.ndarray) -> pa.Table:
        """The previous output's id and result columns at `positions`, in that order."""
        groups = np.searchsorted(self.group_starts, positions, side="right") - 1
        parts, offsets, start = [], {}, 0
        for group in dict.fromkeys(groups.tolist()):
            table = self._group(group)
            offsets[group] = start - int(self.group_starts[group])
            parts.append(table)
            start += table.num_rows
        local = positions + np.array([offsets[g] for g in groups.tolist()], np.int64)
        return pa.concat_tables(parts).take(pa.array(local))

    def _group(self, group: int) -> pa.Table:
        if group not in self.groups:
            if len(self.groups) >= self.KEPT_ROW_GROUPS:
                self.groups.pop(next(iter(self.groups)))
            self.groups[group] = self.file.read_row_group(group, columns=["id", *self.result_columns])
        return self.groups[group]

    def close(self) -> None:
        self.file.close()


class PreviousOutput:
    """Yesterday's output (--reuse): its shards by stem, those with a done marker, a text-hash
    file and as many rows in both."""

    def __init__(self, previous: str, storage_options: dict, keep_columns: Iterable[str]):
        self.fs, directory = fsspec.core.url_to_fs(previous, **storage_options)
        self.directory = directory.rstrip("/")
        self.manifest = RunManifest(self.fs, self.directory)
        self.done = {stem for stem, m in self.manifest.shard_markers().items() if m["status"] == "done"}
        self.fixed_columns = {"id", *keep_columns}  # taken from today's input, never from yesterday

    def shard(self, stem: str) -> PreviousShard | None:
        path = f"{self.directory}/{stem}.parquet"  # where the sink commits it
        hashes = hashes_path(self.manifest.root, stem)
        if stem not in self.done or not self.fs.exists(path) or not self.fs.exists(hashes):
            return None
        with self.fs.open(hashes, "rb") as f:
            table = pq.read_table(f)
        previous = PreviousShard(self.fs, path, table, self.fixed_columns)
        if previous.file.metadata.num_rows != table.num_rows:
            log.warning(f"--reuse: {path} and its text hashes disagree on the row count; computing {stem} anew")
            previous.close()
            return None
        return previous


def mark_reused(windows: Iterable[list[RowBlock]], shards: list[Shard],
                previous: PreviousOutput) -> Iterator[list[RowBlock]]:
    """Each window's blocks with `reuse` set: the rows whose id and text are unchanged in the
    previous output take its results, and their texts are dropped so they are not tokenized."""
    current: tuple[int, PreviousShard | None] | None = None
    try:
        for blocks in windows:
            marked = []
            for block in blocks:
                if block.failure is not None:
                    marked.append(block)
                    continue
                if current is None or current[0] != block.shard_index:
                    if current is not None and current[1] is not None:
                        current[1].close()
                    current = (block.shard_index, previous.shard(shards[block.shard_index].stem))
                marked.append(reuse_block(block, current[1]))
            yield marked
    finally:
        if current is not None and current[1] is not None:
            current[1].close()


def reuse_block(block: RowBlock, previous: PreviousShard | None) -> RowBlock:
    hashes = hash_rows(block.ids, block.texts)
    positions = previous.match(hashes) if previous is not None else np.full(block.num_rows, -1, np.int64)
    mask = positions >= 0
    results = None
    if mask.any():
        results = previous.rows(positions[mask])
        today_ids = block.ids.filter(pa.array(mask))
        same_id = np.array([a == b for a, b in zip(results["id"].to_pylist(), today_ids.to_pylist())], bool)
        if not same_id.all():  # a 64-bit id hash collision: compute those rows
            mask[np.flatnonzero(mask)[~same_id]] = False
            results = results.filter(pa.array(same_id))
        results = results.drop_columns(["id"])
    texts = pc.if_else(pa.array(mask), pa.scalar(None, block.texts.type), block.texts)
    return replace(block, texts=texts, reuse=ReusedRows(hashes, mask, results))


def merge_reused(computed: pa.Table, reused: ReusedRows | None) -> pa.Table:
    """The block's output rows with the reused rows' result columns taken from yesterday."""
    if reused is None or not reused.mask.any():
        return computed
    rows = computed.num_rows
    order = np.arange(rows)
    order[reused.mask] = rows + np.arange(int(reused.mask.sum()))
    columns = []
    for field in computed.schema:
        column = computed[field.name]
        if field.name in reused.results.column_names:
            previous = reused.results[field.name].combine_chunks()
            combined = pa.concat_arrays([column.combine_chunks(), previous.cast(field.type)])
            column = combined.take(pa.array(order))
        columns.append(column)
    return pa.table(columns, schema=computed.schema)
