"""Finding Parquet shards (local paths or any fsspec URL) and streaming their rows.

A shard is read in record batches with only the id and text columns projected, so
memory follows the batch size, never the shard or dataset size.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import UsageError, backoff_delay_s, is_transient, retry_transient

log = logging.getLogger(__name__)

GLOB_CHARACTERS = "*?["


@dataclass(frozen=True)
class Shard:
    """One input Parquet file: where it is, the name its output takes, its row count."""

    url: str
    stem: str
    num_rows: int
    problem: str | None = None  # why it cannot be read: it fails alone, the other shards run


@dataclass(frozen=True)
class RowBlock:
    """A contiguous run of one shard's rows: ids and texts from `first_row` on."""

    shard_index: int
    first_row: int
    ids: pa.Array
    texts: pa.Array
    is_last_of_shard: bool
    failure: str | None = None  # set on a row-less block: this shard broke here, drop all of it

    @property
    def num_rows(self) -> int:
        return len(self.ids)


def _expand(pattern: str, storage_options: dict) -> list[str]:
    """URLs of the Parquet files a directory, glob or file names, with their protocol kept."""
    return retry_transient(lambda: _expand_once(pattern, storage_options), f"listing {pattern}", log=log.warning)


def _expand_once(pattern: str, storage_options: dict) -> list[str]:
    try:
        fs, path = fsspec.core.url_to_fs(pattern, **storage_options)
        if any(ch in path for ch in GLOB_CHARACTERS):
            paths = [p for p in fs.glob(path) if not fs.isdir(p)]
        elif fs.isdir(path):
            paths = [p for p in fs.find(path) if p.endswith(".parquet")
                     and not any(part.startswith(("_", ".")) for part in p[len(path.rstrip("/")):].split("/"))]
        elif fs.exists(path):
            paths = [path]
        else:
            raise UsageError(f"input {pattern!r} does not exist; check --input")
    except (ImportError, ValueError, OSError) as error:  # unknown protocol, missing backend, no permission
        if is_transient(error):
            raise
        raise UsageError(f"cannot list input {pattern!r}: {error}; check --input and --storage-option") from error
    return sorted(fs.unstrip_protocol(p) for p in paths)


def _stem(url: str) -> str:
    name = url.rstrip("/").rsplit("/", 1)[-1]
    return name[: -len(".parquet")] if name.endswith(".parquet") else name



TEXT_TYPES = (pa.string(), pa.large_string(), pa.binary(), pa.large_binary())


@dataclass(frozen=True)
class WorkerSlot:
    """Which share of the shards this process takes: worker `index` of `count`."""

    index: int = 0
    count: int = 1
    source: str = "single worker"  # where the index came from, for the log

    def describe(self) -> str:
        return f"worker {self.index} of {self.count} (index from {self.source})"


WORKER_INDEX_VARIABLES = ("JOB_COMPLETION_INDEX", "SLURM_ARRAY_TASK_ID")  # Kubernetes Indexed Jobs, Slurm arrays


def resolve_worker_slot(num_shards: int, shard_index: int | None, environ: Mapping[str, str]) -> WorkerSlot:
    """The worker slot from --shard-index, else from the scheduler's index variable (a Slurm
    array that starts at SLURM_ARRAY_TASK_MIN counts from there)."""
    if num_shards < 1:
        raise UsageError(f"--num-shards {num_shards} must be at least 1")
    source = "--shard-index"
    if shard_index is None:
        if num_shards == 1:
            return WorkerSlot()
        name = next((n for n in WORKER_INDEX_VARIABLES if environ.get(n, "").strip()), None)
        if name is None:
            raise UsageError(f"--num-shards {num_shards} needs this worker's index: set --shard-index, or run it as a "
                             f"Kubernetes Indexed Job or Slurm array ({' / '.join(WORKER_INDEX_VARIABLES)})")
        try:
            shard_index = int(environ[name])
            if name == "SLURM_ARRAY_TASK_ID" and environ.get("SLURM_ARRAY_TASK_MIN", "").strip():
                shard_index -= int(environ["SLURM_ARRAY_TASK_MIN"])
        except ValueError:
            raise UsageError(f"{name}={environ[name]!r} is not a worker index; set --shard-index") from None
        source = name
    if not 0 <= shard_index < num_shards:
        raise UsageError(f"worker index {shard_index} (from {source}) is outside 0…{num_shards - 1} for "
                         f"--num-shards {num_shards}")
    return WorkerSlot(shard_index, num_shards, source)


def slot_of(urls: Sequence[str], slot: WorkerSlot) -> list[str]:
    """The URLs worker `slot.index` takes: every `count`-th of the sorted list, from `index`.
    One worker keeps the input order."""
    return list(urls) if slot.count == 1 else sorted(urls)[slot.index::slot.count]


def list_shards(inputs: Sequence[str], id_column: str, text_column: str,
                storage_options: dict | None = None, slot: WorkerSlot = WorkerSlot()) -> list[Shard]:
    """Every shard named by `inputs` that `slot` takes, in order, with its row count from the
    Parquet footer.

    Reads only the footers of the slot's shards. A shard that is not Parquet, lacks a column or has a text column of
    the wrong type gets a `problem` and fails alone. When every shard has one, or nothing
    matches, or two shards would write the same output file, it is a usage error naming the
    flag to change.
    """
    storage_options = storage_options or {}
    urls: list[str] = []
    for pattern in inputs:
        found = _expand(pattern, storage_options)
        if not found:
            raise UsageError(f"input {pattern!r} matches no Parquet files; check --input")
        urls.extend(u for u in found if u not in urls)
    stems: dict[str, str] = {}
    for url in urls:
        stem = _stem(url)
        if stem in ("", ".", ".."):
            raise UsageError(f"input {url} has no usable file name for its output; rename it")
        if stem in stems:
            raise UsageError(f"shards {stems[stem]} and {url} would both write {stem}.parquet; "
                             "give --input files with distinct names")
        stems[stem] = url
    mine = slot_of(urls, slot)
    if not mine:
        return []
    shards = [_inspect_shard(url, _stem(url), id_column, text_column, storage_options) for url in mine]
    problems = [shard.problem for shard in shards if shard.problem]
    if len(problems) == len(shards):
        more = f" (and {len(problems) - 1} more shards fail)" if len(problems) > 1 else ""
        raise UsageError(problems[0] + more)
    return shards


def _inspect_shard(url: str, stem: str, id_column: str, text_column: str, storage_options: dict) -> Shard:
    """The shard with its footer's row count, or with the problem that stops it being read."""
    def read_footer():
        with fsspec.open(url, "rb", **storage_options) as f:
            return pq.ParquetFile(f).metadata

    try:
        metadata = retry_transient(read_footer, f"reading the footer of {url}", log=log.warning)
        schema, num_rows = metadata.schema.to_arrow_schema(), metadata.num_rows
    except (pa.ArrowInvalid, OSError) as error:
        return Shard(url, stem, 0, f"cannot read {url} as Parquet ({error}); check --input")
    for column, flag in ((id_column, "--id-column"), (text_column, "--text-column")):
        if column not in schema.names:
            return Shard(url, stem, num_rows, f"shard {url} has no column {column!r} (columns: "
                                              f"{', '.join(schema.names)}); set {flag}")
    text_type = schema.field(text_column).type
    if text_type not in TEXT_TYPES:
        return Shard(url, stem, num_rows, f"shard {url}: text column {text_column!r} is {text_type}, not a "
                                          "string; set --text-column to a string column")
    return Shard(url, stem, num_rows)


class ShardError(Exception):
    """This shard cannot be read; the message says why."""


def read_blocks(shards: Sequence[Shard], id_column: str, text_column: str, block_rows: int,
                storage_options: dict | None = None) -> Iterator[RowBlock]:
    """Stream every shard's rows in order as RowBlocks of at most `block_rows` rows.

    A shard with a `problem`, or one that breaks while being read, ends with a row-less
    block whose `failure` says why, in stream order, and never with its last block, so its
    output is never committed; the next shard follows.
    """
    storage_options = storage_options or {}
    for shard_index, shard in enumerate(shards):
        try:
            if shard.problem:
                raise ShardError(shard.problem)
            yield from _read_shard(shard_index, shard, id_column, text_column, block_rows, storage_options)
        except (ShardError, pa.ArrowException, OSError, EOFError) as error:
            reason = str(error) if isinstance(error, ShardError) else \
                f"reading {shard.url} failed: {type(error).__name__}: {error}"
            nothing = pa.array([], pa.string())
            yield RowBlock(shard_index, 0, nothing, nothing, False, failure=reason)


def _read_shard(shard_index: int, shard: Shard, id_column: str, text_column: str, block_rows: int,
                storage_options: dict) -> Iterator[RowBlock]:
    first_row = 0
    pending = None
    for record_batch in _record_batches(shard.url, [id_column, text_column], block_rows, storage_options):
        if pending is not None:
            yield pending
        pending = RowBlock(shard_index, first_row, record_batch.column(id_column), record_batch.column(text_column),
                           False)
        first_row += record_batch.num_rows
    if first_row != shard.num_rows:
        raise ShardError(f"{shard.url}: read {first_row} rows but the footer says {shard.num_rows}")
    yield RowBlock(pending.shard_index, pending.first_row, pending.ids, pending.texts, True)


def _record_batches(url: str, columns: list[str], block_rows: int, storage_options: dict,
                    attempts: int = 5, sleep=time.sleep) -> Iterator[pa.RecordBatch]:
    """The file's record batches (an empty one for an empty file). A transient object-store
    error in the middle of the stream reopens the file and carries on after the rows already
    handed on, up to `attempts` times with backoff; other errors are raised."""
    handed_on = 0
    for attempt in range(1, attempts + 1):
        skip = handed_on
        try:
            with fsspec.open(url, "rb", **storage_options) as f:
                parquet = pq.ParquetFile(f)
                for record_batch in parquet.iter_batches(batch_size=block_rows, columns=columns):
                    if skip >= record_batch.num_rows:
                        skip -= record_batch.num_rows
                        continue
                    record_batch, skip = record_batch.slice(skip), 0
                    handed_on += record_batch.num_rows
                    yield record_batch
                if handed_on == 0:
                    schema = pa.schema([parquet.schema_arrow.field(name) for name in columns])
                    yield pa.RecordBatch.from_pylist([], schema=schema)
            return
        except Exception as error:
            if attempt == attempts or not is_transient(error):
                raise
            delay = backoff_delay_s(attempt)
            log.warning(f"reading {url}: {type(error).__name__}: {error}; reopening after row {handed_on:,} "
                 f"(retry {attempt}/{attempts - 1} in {delay:.1f}s)")
            sleep(delay)
