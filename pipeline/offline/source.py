"""Finding input shards (local paths or any fsspec URL) and streaming their rows, whatever the format.

A shard is a file one of the readers reads (offline/readers/: Parquet, the Arrow stream files of a
Hugging Face `Dataset.save_to_disk` folder, JSONL). It is read in record batches with only the id,
text and kept columns, so memory follows the batch size, never the shard or dataset size.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import fsspec
import pyarrow as pa

from pipeline.core.errors import UsageError, as_credentials_error, as_storage_error
from pipeline.core.retry import backoff_delay_s, is_transient, retry_transient
from pipeline.core.settings import InputSettings
from pipeline.offline.locations import GLOB_CHARACTERS, LEGACY_MANIFEST_DIR, MANIFEST_DIR, outside_outputs
from pipeline.offline.readers import (ROW_ERROR_COLUMN, Columns, ShardError, ShardFacts, arrow_stream, format_of,
                                      in_folders, without_suffix)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    """One input file: where it is, the name its output takes, its row count."""

    url: str
    stem: str
    num_rows: int
    problem: str | None = None  # why it cannot be read: it fails alone, the other shards run


@dataclass(frozen=True)
class RowBlock:
    """A contiguous run of one shard's rows: ids and texts (and a pair job's pairs) from `first_row` on."""

    shard_index: int
    first_row: int
    ids: pa.Array
    texts: pa.Array
    is_last_of_shard: bool
    failure: str | None = None  # set on a row-less block: this shard broke here, drop all of it
    kept: dict[str, pa.Array] = field(default_factory=dict)  # --keep-columns, copied to the output as they are
    reuse: object | None = None  # --reuse: offline/reuse.py's ReusedRows (rows that take yesterday's result)
    errors: pa.Array | None = None  # per row, why its reader could not read it whole (a JSONL line's); null: it could
    pairs: pa.Array | None = None  # --job pair: each text's pair (--pair-column); None for a one-text job

    @property
    def num_rows(self) -> int:
        return len(self.ids)


def _expand(pattern: str, storage_options: dict, split: str | None = None) -> dict[str, str]:
    """URL → path relative to the input's root, for the shards a directory (its files of the formats
    read from folders), glob or file names (or the Arrow files of a `datasets` folder), URLs with
    their protocol kept. The root
    is the directory, a glob's folder before its first wildcard, or a file's own folder.
    No credentials is a usage error; a store that cannot be reached, or kept failing through
    the retries, a StorageError (exit 4): one line each, as when writing."""
    try:
        return retry_transient(lambda: _expand_once(pattern, storage_options, split), f"listing {pattern}",
                               log=log.warning)
    except UsageError:
        raise
    except Exception as error:
        what = f"cannot list input {pattern!r}"
        raise as_credentials_error(error, what) or as_storage_error(error, what) or error


def _expand_once(pattern: str, storage_options: dict, split: str | None) -> dict[str, str]:
    try:
        fs, path = fsspec.core.url_to_fs(pattern, **storage_options)
        root = path.rstrip("/")
        if any(ch in path for ch in GLOB_CHARACTERS):
            root = path[:min(path.index(ch) for ch in GLOB_CHARACTERS if ch in path)].rsplit("/", 1)[0]
            paths = outside_outputs(fs, [p for p in fs.glob(path) if not fs.isdir(p) and not any(
                part in (MANIFEST_DIR, LEGACY_MANIFEST_DIR) for part in p.split("/"))], root)
        elif arrow_stream.is_saved_dataset(fs, path):
            paths = arrow_stream.saved_dataset_files(fs, root, pattern, split)
            root = paths[0].rsplit("/", 1)[0] if paths else root
        elif fs.isdir(path):
            found = fs.find(path)
            paths = outside_outputs(fs, [p for p in found if in_folders(p) and not any(
                part.startswith(("_", ".")) for part in p[len(root):].split("/"))], root, listed=found)
        elif fs.exists(path):
            root = root.rsplit("/", 1)[0]
            paths = [path]
        else:
            raise UsageError(f"input {pattern!r} does not exist; check --input")
    except (ImportError, ValueError, OSError) as error:  # unknown protocol, missing backend, no permission
        if is_transient(error):
            raise
        raise UsageError(f"cannot list input {pattern!r}: {error}; check --input and --storage-option") from error
    if split is not None and not any(format_of(p) is arrow_stream for p in paths):
        raise UsageError(f"--split {split} is for a `datasets` DatasetDict folder; {pattern!r} is not one")
    return {fs.unstrip_protocol(p): relative_name(p, root) for p in sorted(paths)}


def relative_name(path: str, root: str) -> str:
    """`path` below `root` (`dt=2026-11-29/part-00000.parquet`), else its file name."""
    return path[len(root) + 1:] if root and path.startswith(root + "/") else path.rsplit("/", 1)[-1]


def output_stem(relative: str) -> str:
    """The output's name under --output: the input's path below its root, without its format's
    suffix (`dt=X/part-1.parquet` and `dt=X/part-1.jsonl.gz` both write `dt=X/part-1.parquet`)."""
    return without_suffix(relative)


def partition_values(stem: str) -> dict[str, str]:
    """Hive partition values of a shard's folders: `dt=2026-11-29/part-0` → {"dt": "2026-11-29"}."""
    return dict(part.split("=", 1) for part in stem.split("/")[:-1] if "=" in part)


TEXT_TYPES = (pa.string(), pa.large_string(), pa.binary(), pa.large_binary())


def is_text_type(type_: pa.DataType) -> bool:
    """A string or binary type, or a dictionary of one (pandas categoricals, Spark's dictionary
    pages read back by pyarrow), which the reader decodes; or `null`, the type pandas writes for
    an all-None column, read as null strings (each row an error, as a null text is)."""
    return pa.types.is_null(type_) or (type_.value_type if pa.types.is_dictionary(type_) else type_) in TEXT_TYPES


def plain_column(column: pa.Array) -> pa.Array:
    """A dictionary-encoded column as the plain array of its values; any other column as it is."""
    return column.dictionary_decode() if pa.types.is_dictionary(column.type) else column


def text_values(column: pa.Array) -> pa.Array:
    """A text column as plain strings or binaries: a `null`-typed one as that many null strings."""
    return pa.nulls(len(column), pa.string()) if pa.types.is_null(column.type) else plain_column(column)


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
                storage_options: dict | None = None, slot: WorkerSlot = WorkerSlot(),
                keep_columns: Sequence[str] = (), split: str | None = None,
                pair_column: str | None = None) -> list[Shard]:
    """Every shard named by `inputs` that `slot` takes, in order, with its row count from its
    reader (a Parquet footer; an Arrow file's batches, a JSONL file's lines, counted).

    Reads only what counts the slot's shards. A shard its format cannot read, that lacks a column or has a text
    column of the wrong type gets a `problem` and fails alone. When every shard has one, or nothing
    matches, or two shards would write the same output file, or a shard lacks a column of
    `keep_columns`, it is a usage error naming the flag to change.
    """
    storage_options = storage_options or {}
    relative: dict[str, str] = {}  # url → its path below its input's root
    for pattern in inputs:
        found = _expand(pattern, storage_options, split)
        if not found:
            raise UsageError(f"input {pattern!r} matches no Parquet files or JSONL files; check --input")
        relative.update((url, name) for url, name in found.items() if url not in relative)
    urls = list(relative)
    stem_of: dict[str, str] = {}
    url_of: dict[str, str] = {}
    for url in urls:
        stem = output_stem(relative[url])
        if any(part in ("", ".", "..") for part in stem.split("/")):
            raise UsageError(f"input {url} has no usable file name for its output; rename it")
        if stem in url_of:
            raise UsageError(f"shards {url_of[stem]} and {url} would both write {stem}.parquet; "
                             "give --input files with distinct names")
        stem_of[url], url_of[stem] = stem, url
    mine = slot_of(urls, slot)
    if not mine:
        return []
    shards = [_inspect_shard(url, stem_of[url], id_column, text_column, storage_options, keep_columns, pair_column)
              for url in mine]
    problems = [shard.problem for shard in shards if shard.problem]
    if len(problems) == len(shards):
        more = f" (and {len(problems) - 1} more shards fail)" if len(problems) > 1 else ""
        raise UsageError(problems[0] + more)
    return shards


def list_source_shards(source: InputSettings, slot: WorkerSlot = WorkerSlot(),
                       keep_columns: Sequence[str] = ()) -> list[Shard]:
    """`list_shards` of a product's input settings (a run's, a sweep's, a load test's, an estimate's)."""
    return list_shards(source.input, source.id_column, source.text_column, source.storage_options, slot, keep_columns,
                       source.split, source.pair_column)


def _inspect_shard(url: str, stem: str, id_column: str, text_column: str, storage_options: dict,
                   keep_columns: Sequence[str] = (), pair_column: str | None = None) -> Shard:
    """The shard with its row count, or with the problem that stops it being read."""
    reader = format_of(url)
    partition = partition_values(stem)
    texts = (text_column, pair_column) if pair_column else (text_column,)
    columns = Columns(id_column, texts, tuple(c for c in keep_columns if c not in partition))

    def count() -> ShardFacts:
        with fsspec.open(url, "rb", **storage_options) as f:
            return reader.count_rows(f, url, columns)

    try:
        facts = retry_transient(count, f"counting the rows of {url}", log=log.warning)
    except (pa.ArrowInvalid, OSError) as error:
        return Shard(url, stem, 0, f"cannot read {url} as {reader.NAME} ({error}); check --input")
    num_rows, found = facts.num_rows, facts.columns
    if found is None:  # a shard that names no columns (an empty JSONL file): each row says what it lacks
        return Shard(url, stem, num_rows, facts.problem)
    missing = [column for column in keep_columns if column not in found and column not in partition]
    if missing:
        raise UsageError(f"shard {url} has no column {', '.join(map(repr, missing))} to keep (its columns: "
                         f"{', '.join(found)}{''.join(f', {k} (partition)' for k in partition)}"
                         "); check --keep-columns")
    named = ((id_column, "--id-column"), (text_column, "--text-column"), *([(pair_column, "--pair-column")]
                                                                           if pair_column else []))
    for column, flag in named:
        if column not in found:
            return Shard(url, stem, num_rows, f"shard {url} has no column {column!r} (columns: "
                                              f"{', '.join(found)}); set {flag}")
    for column, flag in named[1:]:
        text_type = found[column]
        if text_type is not None and not is_text_type(text_type):
            return Shard(url, stem, num_rows, f"shard {url}: text column {column!r} is {text_type}, not a "
                                              f"string; set {flag} to a string column")
    return Shard(url, stem, num_rows, facts.problem)


def read_blocks(shards: Sequence[Shard], id_column: str, text_column: str, block_rows: int,
                storage_options: dict | None = None, keep_columns: Sequence[str] = (),
                pair_column: str | None = None) -> Iterator[RowBlock]:
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
            yield from _read_shard(shard_index, shard, id_column, text_column, block_rows, storage_options,
                                   keep_columns, pair_column)
        except (ShardError, pa.ArrowException, OSError, EOFError) as error:
            reason = str(error) if isinstance(error, ShardError) else \
                f"reading {shard.url} failed: {type(error).__name__}: {error}"
            nothing = pa.array([], pa.string())
            yield RowBlock(shard_index, 0, nothing, nothing, False, failure=reason)


def _read_shard(shard_index: int, shard: Shard, id_column: str, text_column: str, block_rows: int,
                storage_options: dict, keep_columns: Sequence[str] = (),
                pair_column: str | None = None) -> Iterator[RowBlock]:
    first_row = 0
    pending = None
    partition = partition_values(shard.stem)  # a kept partition key comes from the path, as hive readers do
    texts = (text_column, pair_column) if pair_column else (text_column,)
    columns = Columns(id_column, texts, tuple(c for c in keep_columns if c not in partition))
    for record_batch in record_batches(shard.url, columns, block_rows, storage_options):
        if pending is not None:
            yield pending
        kept = {name: pa.array([partition[name]] * record_batch.num_rows, pa.string()) if name in partition
                else record_batch.column(name) for name in keep_columns}
        errors = record_batch.column(ROW_ERROR_COLUMN) if ROW_ERROR_COLUMN in record_batch.schema.names else None
        pending = RowBlock(shard_index, first_row, plain_column(record_batch.column(id_column)),
                           text_values(record_batch.column(text_column)), False, kept=kept, errors=errors,
                           pairs=text_values(record_batch.column(pair_column)) if pair_column else None)
        first_row += record_batch.num_rows
    if first_row != shard.num_rows:
        raise ShardError(f"{shard.url}: read {first_row} rows but {format_of(shard.url).COUNTED_BY} says "
                         f"{shard.num_rows}")
    yield dataclasses.replace(pending, is_last_of_shard=True)


def record_batches(url: str, columns: Columns, block_rows: int, storage_options: dict,
                   attempts: int = 5, sleep=time.sleep) -> Iterator[pa.RecordBatch]:
    """The file's record batches of `columns`, read by its format's reader (an empty one for an
    empty file). A transient object-store error in the middle of the stream reopens the file and
    carries on after the rows already handed on, up to `attempts` times with backoff; other errors
    are raised."""
    reader = format_of(url)
    handed_on = 0
    for attempt in range(1, attempts + 1):
        skip = handed_on
        try:
            with fsspec.open(url, "rb", **storage_options) as f:
                schema, batches = reader.open_batches(f, url, columns, block_rows)
                for record_batch in batches:
                    if skip >= record_batch.num_rows:
                        skip -= record_batch.num_rows
                        continue
                    record_batch, skip = record_batch.slice(skip), 0
                    handed_on += record_batch.num_rows
                    yield record_batch
                if handed_on == 0:
                    yield pa.RecordBatch.from_pylist([], schema=pa.schema([schema.field(name)
                                                                           for name in columns.names]))
            return
        except Exception as error:
            if attempt == attempts or not is_transient(error):
                raise
            delay = backoff_delay_s(attempt)
            log.warning(f"reading {url}: {type(error).__name__}: {error}; reopening after row {handed_on:,} "
                 f"(retry {attempt}/{attempts - 1} in {delay:.1f}s)")
            sleep(delay)
