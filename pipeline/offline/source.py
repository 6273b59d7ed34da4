"""Finding input shards (local paths or any fsspec URL) and streaming their rows.

A shard is a Parquet file, or an Arrow stream file of a Hugging Face `Dataset.save_to_disk`
folder. It is read in record batches with only the id, text and kept columns projected, so
memory follows the batch size, never the shard or dataset size.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.errors import UsageError, as_credentials_error, as_storage_error
from pipeline.core.retry import backoff_delay_s, is_transient, retry_transient
from pipeline.core.settings import InputSettings
from pipeline.offline.footer import READ_BUFFER_BYTES, footer_problem, max_row_group_bytes
from pipeline.offline.locations import GLOB_CHARACTERS, LEGACY_MANIFEST_DIR, MANIFEST_DIR, outside_outputs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    """One input Parquet file: where it is, the name its output takes, its row count."""

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
    pairs: pa.Array | None = None  # --job pair: each text's pair (--pair-column); None for a one-text job

    @property
    def num_rows(self) -> int:
        return len(self.ids)


def _expand(pattern: str, storage_options: dict, split: str | None = None) -> dict[str, str]:
    """URL → path relative to the input's root, for the Parquet files a directory, glob or file
    names (or the Arrow files of a `datasets` folder), URLs with their protocol kept. The root
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
        elif fs.isdir(path) and (fs.exists(f"{path}/state.json") or fs.exists(f"{path}/dataset_dict.json")):
            paths = _saved_dataset_files(fs, root, pattern, split)
            root = paths[0].rsplit("/", 1)[0] if paths else root
        elif fs.isdir(path):
            found = fs.find(path)
            paths = outside_outputs(fs, [p for p in found if p.endswith(".parquet") and not any(
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
    if split is not None and not any(p.endswith(ARROW_SUFFIX) for p in paths):
        raise UsageError(f"--split {split} is for a `datasets` DatasetDict folder; {pattern!r} is not one")
    return {fs.unstrip_protocol(p): relative_name(p, root) for p in sorted(paths)}


def relative_name(path: str, root: str) -> str:
    """`path` below `root` (`dt=2026-11-29/part-00000.parquet`), else its file name."""
    return path[len(root) + 1:] if root and path.startswith(root + "/") else path.rsplit("/", 1)[-1]


ARROW_SUFFIX = ".arrow"


def _saved_dataset_files(fs, path: str, pattern: str, split: str | None) -> list[str]:
    """The Arrow files of a `Dataset.save_to_disk` folder (state.json lists them), or of one
    split of a `DatasetDict.save_to_disk` folder (dataset_dict.json lists the splits)."""
    if fs.exists(f"{path}/dataset_dict.json"):
        with fs.open(f"{path}/dataset_dict.json", "r") as f:
            splits = json.load(f)["splits"]
        if split not in splits:
            raise UsageError(f"{pattern!r} is a DatasetDict with splits {', '.join(splits)}; "
                             f"{'choose one with --split' if split is None else f'--split {split} is not one of them'}")
        path, split = f"{path}/{split}", None
    if split is not None:
        raise UsageError(f"{pattern!r} is a single Dataset, not a DatasetDict; drop --split {split}")
    with fs.open(f"{path}/state.json", "r") as f:
        return [f"{path}/{item['filename']}" for item in json.load(f)["_data_files"]]


def output_stem(relative: str) -> str:
    """The output's name under --output: the input's path below its root, without the suffix."""
    for suffix in (".parquet", ARROW_SUFFIX):
        if relative.endswith(suffix):
            return relative[: -len(suffix)]
    return relative


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
    """Every shard named by `inputs` that `slot` takes, in order, with its row count from the
    Parquet footer (an Arrow file's batches are counted).

    Reads only the footers of the slot's shards. A shard that is not Parquet, lacks a column or has a text column of
    the wrong type gets a `problem` and fails alone. When every shard has one, or nothing
    matches, or two shards would write the same output file, or a shard lacks a column of
    `keep_columns`, it is a usage error naming the flag to change.
    """
    storage_options = storage_options or {}
    relative: dict[str, str] = {}  # url → its path below its input's root
    for pattern in inputs:
        found = _expand(pattern, storage_options, split)
        if not found:
            raise UsageError(f"input {pattern!r} matches no Parquet files; check --input")
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
    """The shard with its footer's row count, or with the problem that stops it being read."""
    def read_footer() -> tuple[pa.Schema, int, object]:
        with fsspec.open(url, "rb", **storage_options) as f:
            if url.endswith(ARROW_SUFFIX):  # an IPC stream has no footer: count its batches
                stream = pa.ipc.open_stream(f)
                return stream.schema, sum(batch.num_rows for batch in stream), None
            metadata = pq.ParquetFile(f).metadata
            return metadata.schema.to_arrow_schema(), metadata.num_rows, metadata

    try:
        schema, num_rows, metadata = retry_transient(read_footer, f"reading the footer of {url}", log=log.warning)
    except (pa.ArrowInvalid, OSError) as error:
        kind = "an Arrow stream" if url.endswith(ARROW_SUFFIX) else "Parquet"
        return Shard(url, stem, 0, f"cannot read {url} as {kind} ({error}); check --input")
    missing = [column for column in keep_columns if column not in schema.names
               and column not in partition_values(stem)]
    if missing:
        raise UsageError(f"shard {url} has no column {', '.join(map(repr, missing))} to keep (its columns: "
                         f"{', '.join(schema.names)}{''.join(f', {k} (partition)' for k in partition_values(stem))}"
                         "); check --keep-columns")
    named = ((id_column, "--id-column"), (text_column, "--text-column"), *([(pair_column, "--pair-column")]
                                                                           if pair_column else []))
    for column, flag in named:
        if column not in schema.names:
            return Shard(url, stem, num_rows, f"shard {url} has no column {column!r} (columns: "
                                              f"{', '.join(schema.names)}); set {flag}")
    for column, flag in named[1:]:
        text_type = schema.field(column).type
        if not is_text_type(text_type):
            return Shard(url, stem, num_rows, f"shard {url}: text column {column!r} is {text_type}, not a "
                                              f"string; set {flag} to a string column")
    problem = metadata and footer_problem(url, metadata, [column for column, _ in named],
                                          max_row_group_bytes(os.environ))
    return Shard(url, stem, num_rows, problem or None)


class ShardError(Exception):
    """This shard cannot be read; the message says why."""


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
    columns = list(dict.fromkeys([id_column, text_column, *([pair_column] if pair_column else []),
                                  *(c for c in keep_columns if c not in partition)]))
    for record_batch in _record_batches(shard.url, columns, block_rows, storage_options):
        if pending is not None:
            yield pending
        kept = {name: pa.array([partition[name]] * record_batch.num_rows, pa.string()) if name in partition
                else record_batch.column(name) for name in keep_columns}
        pending = RowBlock(shard_index, first_row, plain_column(record_batch.column(id_column)),
                           text_values(record_batch.column(text_column)), False, kept=kept,
                           pairs=text_values(record_batch.column(pair_column)) if pair_column else None)
        first_row += record_batch.num_rows
    if first_row != shard.num_rows:
        raise ShardError(f"{shard.url}: read {first_row} rows but the footer says {shard.num_rows}")
    yield dataclasses.replace(pending, is_last_of_shard=True)


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
                schema, batches = _open_batches(f, url, columns, block_rows)
                for record_batch in batches:
                    if skip >= record_batch.num_rows:
                        skip -= record_batch.num_rows
                        continue
                    record_batch, skip = record_batch.slice(skip), 0
                    handed_on += record_batch.num_rows
                    yield record_batch
                if handed_on == 0:
                    yield pa.RecordBatch.from_pylist([], schema=pa.schema([schema.field(name) for name in columns]))
            return
        except Exception as error:
            if attempt == attempts or not is_transient(error):
                raise
            delay = backoff_delay_s(attempt)
            log.warning(f"reading {url}: {type(error).__name__}: {error}; reopening after row {handed_on:,} "
                 f"(retry {attempt}/{attempts - 1} in {delay:.1f}s)")
            sleep(delay)


def _open_batches(f, url: str, columns: list[str], block_rows: int) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """The file's schema and its record batches of `columns`, at most `block_rows` rows each:
    Parquet, or an Arrow IPC stream (a `datasets` folder's files)."""
    if not url.endswith(ARROW_SUFFIX):
        parquet = pq.ParquetFile(f, buffer_size=READ_BUFFER_BYTES, pre_buffer=False)  # pages, not whole row groups
        return parquet.schema_arrow, parquet.iter_batches(batch_size=block_rows, columns=columns)
    stream = pa.ipc.open_stream(f)

    def batches() -> Iterator[pa.RecordBatch]:
        for batch in stream:
            batch = batch.select(columns)
            for start in range(0, batch.num_rows, block_rows):
                yield batch.slice(start, block_rows)

    return stream.schema, batches()
