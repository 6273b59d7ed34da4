"""`--reuse PREV_OUTPUT`: copy yesterday's result of every row whose id and text are unchanged,
wherever it is now, and send only new and edited rows (and rows whose error a retry may fix) to the device.

How a row is recognised: every commit also writes `OUTPUT/.lengthwise/text-hashes/<stem>.hashes`
(Parquet), one row per output row, in output order: `id_hash` (64-bit blake2b of the id),
`text_hash` (64-bit blake2b of the text; a pair job's, of the text and its pair) and `status` (OK, an error a retry may fix, one it
cannot). Not a user-facing column: readers of the output never see it. A file of an older
version has no `status` and a null text hash for every error: those rows are retried.

How it finds rows whatever the shard names: at the start of a run the hash files of every done
previous shard go into a `ReuseIndex` (offline/reuse_index.py: sorted runs on local disk, 41 bytes
a row, memory bounded by its bucket size), keyed by (id hash, text hash) and by text hash. A row
moved to another shard or a renamed partition is found all the same, and a text seen yesterday
under another id too. The results are then read from the previous outputs shard by shard, a
Parquet row group at a time (the last few kept), and copied only once proven their rows' (see
PreviousOutput): a downstream sort or compaction of yesterday's output keeps its row count, not its
alignment with the hash files.
"""

from __future__ import annotations

import functools
import logging
import re
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.core.errors import UsageError
from pipeline.core.retry import retry_transient
from pipeline.core.row_hashes import HashColumns, hash_columns, id_hash
from pipeline.offline.encoder import OutputEncoder, ParquetFile
from pipeline.offline.locations import same_location, shown_path
from pipeline.offline.manifest import (
    MANIFEST_DIR,
    RunManifest,
    fingerprint_differences,
    remove_temporaries,
)
from pipeline.offline.reuse_index import (
    BUCKET_ROWS,
    EDITED,
    HASH_BATCH_ROWS,
    NEW,
    OK,
    PERMANENT_ERROR,
    RETRY,
    RETRYABLE_ERROR,
    SKIPPED,
    ReuseIndex,
    RowMatches,
)
from pipeline.offline.source import RowBlock, Shard

log = logging.getLogger(__name__)

HASHES_DIR = "text-hashes"
HASH_SCHEMA = pa.schema([("id_hash", pa.int64()), ("text_hash", pa.int64()), ("status", pa.int8())])
# row errors that may not come back on a retry (memory, the device, a numeric blow-up); the others (a null, empty,
# tokenless or undecodable text, a null id) come back every time, so those rows are reused with their error
RETRYABLE_ERRORS = ("out of memory", "the model gave a non-finite output")
HASH_TEMPORARY = re.compile(r"(?P<stem>.+)\.hashes\.[0-9a-f]{12}\.tmp")  # [DIR/]STEM.hashes.ATTEMPT.tmp


@dataclass
class RowHashes:
    """One block's id and text hashes (`text_hashes` null where the text is, or the id is, null)."""

    id_hashes: np.ndarray  # int64
    text_hashes: pa.Array  # int64 with nulls


def hash_rows(ids: pa.Array, texts: pa.Array, pairs: pa.Array | None = None) -> RowHashes:
    """A block's hashes; a pair job's text hash is of the text and its pair (`pair_hash`)."""
    return row_hashes(hash_columns(ids.to_pylist(), texts.to_pylist(), None if pairs is None else pairs.to_pylist()))


def row_hashes(columns: HashColumns) -> RowHashes:
    """Hash columns (a tokenizer worker's) as a block's RowHashes."""
    return RowHashes(columns.id_hashes, pa.array(columns.text_hashes, pa.int64(), mask=~columns.has_text_hash))


@dataclass
class ReusedRows:
    """Which rows of a block take yesterday's result, and those results (in block order)."""

    hashes: RowHashes  # of every row of the block, texts as they were read (for today's text-hash file)
    mask: np.ndarray  # bool per block row
    results: pa.Table | None  # the previous output's columns but id and kept ones, one row per reused row
    matches: RowMatches | None = None  # how each row was found in the previous output
    carried: bool = False  # a change of models (offline/carry.py): `mask` rows take only the kept models' columns
    # from `results` and still run the models computed


def hashes_path(root: str, stem: str) -> str:
    """A Parquet file, named without `.parquet` so that a `**/*.parquet` glob of the output never takes it."""
    return f"{root}/{HASHES_DIR}/{stem}.hashes"


def remove_stale_hash_temporaries(manifest: RunManifest, stems: list[str]) -> int:
    """Delete text-hash files a killed attempt left half-written for these shards; call, like
    ShardSink.remove_stale_temporaries, under the lock of the worker that owns the shards."""
    return remove_temporaries(manifest.fs, f"{manifest.root}/{HASHES_DIR}", HASH_TEMPORARY, stems)


def error_statuses(errors: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """Each row's status for the text-hash file, column-wise: OK without an error, RETRYABLE_ERROR for
    one a retry may fix (RETRYABLE_ERRORS), else PERMANENT_ERROR."""
    retryable = pc.fill_null(functools.reduce(pc.or_, [pc.starts_with(errors, prefix) for prefix in RETRYABLE_ERRORS]),
                             False)
    status = pc.if_else(retryable, pa.scalar(RETRYABLE_ERROR, pa.int8()), pa.scalar(PERMANENT_ERROR, pa.int8()))
    return pc.if_else(pc.is_null(errors), pa.scalar(OK, pa.int8()), status)


class TextHashSink:
    """Writes each shard's text-hash file beside the output, streamed, committed by rename; for a local output,
    encoded by the output's encoder process (offline/encoder.py) as its output files are."""

    def __init__(self, manifest: RunManifest, encoder_of: Callable[[], OutputEncoder | None] = lambda: None):
        self.fs, self.root, self.encoder_of = manifest.fs, manifest.root, encoder_of
        self._files: dict[int, tuple[ParquetFile | OutputEncoder, str, str]] = {}  # the writer, temporary, final

    def write(self, shard_index: int, shard: Shard, block: RowBlock, errors: pa.Array) -> None:
        """Hash one block's rows, with each row's status: OK, an error a retry may fix, or one it cannot."""
        hashes = block.reuse.hashes if block.reuse is not None else hash_rows(block.ids, block.texts, block.pairs)
        status = error_statuses(errors)
        if shard_index not in self._files:
            final = hashes_path(self.root, shard.stem)
            temp = f"{final}.{uuid.uuid4().hex[:12]}.tmp"
            self.fs.makedirs(final.rpartition("/")[0], exist_ok=True)
            encoder = self.encoder_of()
            self._files[shard_index] = (encoder or ParquetFile(self.fs.open(temp, "wb"), HASH_SCHEMA), temp, final)
        writer, temp, _ = self._files[shard_index]
        table = pa.table([pa.array(hashes.id_hashes), hashes.text_hashes, status], schema=HASH_SCHEMA)
        if isinstance(writer, OutputEncoder):
            writer.write(temp, table)
        else:
            writer.write(table)

    def commit(self, shard_index: int) -> None:
        """Called right after the shard's output is committed (its last block was written here too)."""
        writer, temp, final = self._files.pop(shard_index)
        if isinstance(writer, OutputEncoder):
            writer.close_file(temp)
        else:
            writer.close()
        retry_transient(lambda: self.fs.mv(temp, final), f"committing {final}", log=log.warning)

    def abort_all(self) -> None:
        for shard_index in list(self._files):
            self.abort(shard_index)

    def abort(self, shard_index: int) -> None:
        entry = self._files.pop(shard_index, None)
        if entry is not None:
            writer, temp, _ = entry
            try:
                if isinstance(writer, OutputEncoder):
                    writer.abort_file(temp)
                else:
                    writer.close()
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


SKIP_ADVICE = "its rows are computed, not reused"


def previous_shard_problem(marker: dict, output_bytes: int, output_rows: Callable[[], int],
                           hashed_rows: int) -> str | None:
    """Why a previous shard's output cannot be trusted to line up with its text hashes, or None: its size
    is the one its done marker recorded at the commit (a marker from before sizes were recorded is not
    checked by size), and it has a row for every hash (`output_rows()` reads its footer, only once the
    size is right). A rewrite of the same size is caught later, by the ids of the rows copied from it."""
    if marker.get("bytes") is not None and marker["bytes"] != output_bytes:
        return (f"it has {output_bytes:,} bytes and its done marker records {marker['bytes']:,} (rewritten since it "
                "was committed?)")
    rows = output_rows()
    if rows != hashed_rows:
        return f"it has {rows:,} rows and its text hashes {hashed_rows:,}"
    return None


def read_problem(what: str, error: Exception) -> str:
    """`its output file is unreadable (ArrowInvalid: …)`, one line."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{what} unreadable ({type(error).__name__}: {first_line})"


READ_ERRORS = (OSError, pa.ArrowException)  # a truncated, garbled or vanished file


class PreviousOutput:
    """Yesterday's output (--reuse): its done shards with a text-hash file, indexed by id and text (`index`),
    and their results read by row group on demand. A result is copied only once it is proven its row's:
    the shard's output has the size its done marker recorded and a row for every hash, and the id at each
    row copied from is the one its hash file has there. A shard that fails either (or cannot be read) is
    skipped with a warning: its rows are computed and counted `skipped`."""

    KEPT_FILES = 8
    KEPT_ROW_GROUPS = 16

    def __init__(self, previous: str, storage_options: dict, keep_columns: Iterable[str],
                 bucket_rows: int = BUCKET_ROWS, made_with: str | None = None):
        """`made_with`: only the done shards whose marker holds this fingerprint digest (a change of models
        carries columns from the shards made with the models it keeps)."""
        self.fs, directory = fsspec.core.url_to_fs(previous, **storage_options)
        self.directory = directory.rstrip("/")
        self.manifest = RunManifest(self.fs, self.directory)
        self.fixed_columns = {"id", *keep_columns}  # taken from today's input, never from yesterday
        self._files: dict[int, tuple[pq.ParquetFile, np.ndarray, list[str]]] = {}
        self._groups: dict[tuple[int, int], pa.Table] = {}
        markers = {stem: m for stem, m in self.manifest.shard_markers().items() if m["status"] == "done"
                   and (made_with is None or m.get("fingerprint") == made_with)}
        self.stems: list[str] = sorted(stem for stem in markers if self.fs.exists(self._hashes_path(stem)))
        self.skipped: dict[int, str] = {}  # a previous shard's number → why its results are not reused
        hashed_rows = [self._check_shard(number, markers[stem]) for number, stem in enumerate(self.stems)]
        self.index = ReuseIndex(total_rows=sum(hashed_rows), bucket_rows=bucket_rows)
        for number, stem in enumerate(self.stems):  # one hash file open at a time
            if hashed_rows[number]:
                try:
                    with self.fs.open(self._hashes_path(stem), "rb") as f:
                        self.index.add_shard(number, pq.ParquetFile(f).iter_batches(HASH_BATCH_ROWS))
                except READ_ERRORS as error:  # its rows indexed so far are found, and computed
                    self.skip(number, read_problem("its text hashes are", error), self._hashes_path(stem))
        self.index.finish()

    def _output_path(self, stem: str) -> str:
        return f"{self.directory}/{stem}.parquet"

    def _hashes_path(self, stem: str) -> str:
        return hashes_path(self.manifest.root, stem)

    def _check_shard(self, number: int, marker: dict) -> int:
        """The rows of a previous shard's hash file (0 if it cannot be read); the shard is skipped where
        its output does not match its marker or its hashes (its rows are still indexed: found, and counted
        as skipped when computed)."""
        stem = self.stems[number]
        path, hashes = self._output_path(stem), self._hashes_path(stem)
        try:
            hashed_rows = self._footer_rows(hashes)
        except READ_ERRORS as error:
            self.skip(number, read_problem("its text hashes are", error), hashes)
            return 0
        try:
            problem = previous_shard_problem(marker, self.fs.size(path), lambda: self._footer_rows(path), hashed_rows)
        except FileNotFoundError:
            problem = "its output file is missing"
        except READ_ERRORS as error:
            problem = read_problem("its output file is", error)
        if problem is not None:
            self.skip(number, problem, path)
        return hashed_rows

    def _footer_rows(self, path: str) -> int:
        with self.fs.open(path, "rb") as f:
            return pq.ParquetFile(f).metadata.num_rows

    def skip(self, number: int, problem: str, path: str | None = None) -> None:
        """Reuse nothing more of previous shard `number`, saying why once."""
        if number in self.skipped:
            return
        self.skipped[number] = problem
        shown = shown_path(self.fs, path or self._output_path(self.stems[number]))
        log.warning(f"--reuse: {shown}: {problem}; {SKIP_ADVICE}")
        entry = self._files.pop(number, None)
        if entry is not None:
            entry[0].close()
        for key in [key for key in self._groups if key[0] == number]:
            del self._groups[key]

    def take_results(self, matches: RowMatches, ids: pa.Array) -> pa.Table | None:
        """The previous id and result columns of a block's reused rows (`matches.reused`, in block order),
        each proven its row's. Updates `matches`: a row found in a skipped shard, or in one found out now
        (unreadable, or an id at a copied row that is not its hash file's), is SKIPPED; a row whose id only
        shares its 64-bit hash with yesterday's row is NEW."""
        if self.skipped:
            matches.skip(np.flatnonzero(matches.reused & np.isin(matches.shard, list(self.skipped))))
        reused = np.flatnonzero(matches.reused)
        parts, order = [], []
        for shard in np.unique(matches.shard[reused]).tolist():
            positions = reused[matches.shard[reused] == shard]
            table = self._proven_rows(shard, matches, positions, ids)
            if table is None:
                matches.skip(positions)
                continue
            parts.append(table)
            order.append(positions[matches.reused[positions]])
        if not parts:
            return None
        table = pa.concat_tables(parts, promote_options="permissive") if len(parts) > 1 else parts[0]
        return table.take(pa.array(np.argsort(np.concatenate(order), kind="stable")))

    def _proven_rows(self, shard: int, matches: RowMatches, positions: np.ndarray, ids: pa.Array) -> pa.Table | None:
        """Previous shard `shard`'s rows at `positions` of the block, or None where the shard is skipped now."""
        rows = matches.row[positions]
        try:
            table = self._shard_rows(shard, rows)
        except READ_ERRORS as error:
            self.skip(shard, read_problem("its output file is", error))
            return None
        previous_ids = table["id"].to_pylist()
        same_id = np.array([a == b for a, b in zip(previous_ids, ids.take(pa.array(positions)).to_pylist())], bool)
        check = np.flatnonzero(matches.by_text[positions] | ~same_id)
        held = self.index.holds(np.fromiter((id_hash(previous_ids[i]) for i in check.tolist()), np.int64, len(check)),
                                np.full(len(check), shard, np.int32), rows[check])
        if not held.all():
            self.skip(shard, "its rows no longer line up with its text hashes (rewritten in another order since it "
                             "was committed?)")
            return None
        collided = ~same_id & ~matches.by_text[positions]  # a 64-bit id hash collision: compute those rows
        matches.kind[positions[collided]] = NEW
        return table.filter(pa.array(~collided))

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
            file = pq.ParquetFile(self.fs.open(self._output_path(self.stems[shard]), "rb"))
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
    hashes = hash_rows(block.ids, block.texts, block.pairs)
    has_text = hashes.text_hashes.is_valid().to_numpy(zero_copy_only=False)
    matches = previous.index.match(hashes.id_hashes, hashes.text_hashes.fill_null(0).to_numpy(), has_text)
    results = previous.take_results(matches, block.ids)
    mask = matches.reused
    if results is not None:
        results = results.drop_columns(["id"])
    texts = pc.if_else(pa.array(mask), pa.scalar(None, block.texts.type), block.texts)
    return replace(block, texts=texts, reuse=ReusedRows(hashes, mask, results, matches))


@dataclass
class ReuseCounts:
    """What --reuse did with one shard's rows: reused (by id and text, or by text under another id), and
    why the others were computed (new: an id yesterday had not; edited: another text; skipped: found in a
    previous shard whose results could not be proven theirs; a row without a text is none of these).
    `sources`: previous shard → rows reused from it by id."""

    reused: int = 0
    by_text: int = 0
    new: int = 0
    edited: int = 0
    retried: int = 0
    fixed: int = 0
    skipped: int = 0
    carried: int | None = None  # a change of models: rows whose kept models' columns were carried (not `reused`)
    sources: dict = field(default_factory=dict)

    def add(self, reused: ReusedRows, errors: pa.Array) -> None:
        matches = reused.matches
        if reused.carried:
            self.carried = (self.carried or 0) + int(reused.mask.sum())
        else:
            self.reused += int(reused.mask.sum())
        self.by_text += int(matches.by_text.sum())
        computed = ~reused.mask & reused.hashes.text_hashes.is_valid().to_numpy(zero_copy_only=False)
        self.new += int((computed & (matches.kind == NEW)).sum())
        self.edited += int((computed & (matches.kind == EDITED)).sum())
        retried = matches.kind == RETRY
        self.retried += int(retried.sum())
        self.fixed += int((retried & errors.is_null().to_numpy(zero_copy_only=False)).sum())
        self.skipped += int((matches.kind == SKIPPED).sum())
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
