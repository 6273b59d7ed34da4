"""Finding Parquet shards (local paths or any fsspec URL) and streaming their rows.

A shard is read in record batches with only the id and text columns projected, so
memory follows the batch size, never the shard or dataset size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import UsageError

GLOB_CHARACTERS = "*?["


@dataclass(frozen=True)
class Shard:
    """One input Parquet file: where it is, the name its output takes, its row count."""

    url: str
    stem: str
    num_rows: int


@dataclass(frozen=True)
class RowBlock:
    """A contiguous run of one shard's rows: ids and texts from `first_row` on."""

    shard_index: int
    first_row: int
    ids: pa.Array
    texts: pa.Array
    is_last_of_shard: bool

    @property
    def num_rows(self) -> int:
        return len(self.ids)


def _expand(pattern: str, storage_options: dict) -> list[str]:
    """URLs of the Parquet files a directory, glob or file names, with their protocol kept."""
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
    return sorted(fs.unstrip_protocol(p) for p in paths)


def _stem(url: str) -> str:
    name = url.rstrip("/").rsplit("/", 1)[-1]
    return name[: -len(".parquet")] if name.endswith(".parquet") else name


def list_shards(inputs: Sequence[str], id_column: str, text_column: str,
                storage_options: dict | None = None) -> list[Shard]:
    """Every shard named by `inputs`, in order, with its row count from the Parquet footer.

    Reads only footers. Fails with a UsageError naming the flag to change when nothing
    matches, a file is not Parquet, a column is missing, or two shards would write the
    same output file.
    """
    storage_options = storage_options or {}
    urls: list[str] = []
    for pattern in inputs:
        found = _expand(pattern, storage_options)
        if not found:
            raise UsageError(f"input {pattern!r} matches no Parquet files; check --input")
        urls.extend(u for u in found if u not in urls)
    shards = []
    stems: dict[str, str] = {}
    for url in urls:
        schema, num_rows = _read_footer(url, storage_options)
        for column, flag in ((id_column, "--id-column"), (text_column, "--text-column")):
            if column not in schema.names:
                raise UsageError(f"shard {url} has no column {column!r} (columns: "
                                 f"{', '.join(schema.names)}); set {flag}")
        stem = _stem(url)
        if stem in stems:
            raise UsageError(f"shards {stems[stem]} and {url} would both write {stem}.parquet; "
                             "give --input files with distinct names")
        stems[stem] = url
        shards.append(Shard(url=url, stem=stem, num_rows=num_rows))
    return shards


def _read_footer(url: str, storage_options: dict) -> tuple[pa.Schema, int]:
    try:
        with fsspec.open(url, "rb", **storage_options) as f:
            metadata = pq.ParquetFile(f).metadata
            return metadata.schema.to_arrow_schema(), metadata.num_rows
    except (pa.ArrowInvalid, OSError) as error:
        raise UsageError(f"cannot read {url} as Parquet ({error}); check --input") from error


def read_blocks(shards: Sequence[Shard], id_column: str, text_column: str,
                block_rows: int, storage_options: dict | None = None) -> Iterator[RowBlock]:
    """Stream every shard's rows in order as RowBlocks of at most `block_rows` rows."""
    storage_options = storage_options or {}
    for shard_index, shard in enumerate(shards):
        first_row = 0
        with fsspec.open(shard.url, "rb", **storage_options) as f:
            parquet = pq.ParquetFile(f)
            pending = None
            for record_batch in parquet.iter_batches(batch_size=block_rows, columns=[id_column, text_column]):
                if pending is not None:
                    yield pending
                pending = RowBlock(shard_index, first_row, record_batch.column(0), record_batch.column(1), False)
                first_row += record_batch.num_rows
            if pending is None:  # an empty shard still gets its (empty) output file
                schema = parquet.schema_arrow
                pending = RowBlock(shard_index, 0, pa.array([], schema.field(id_column).type),
                                   pa.array([], schema.field(text_column).type), False)
        if first_row != shard.num_rows:
            raise RuntimeError(f"{shard.url}: read {first_row} rows but the footer says {shard.num_rows}")
        yield RowBlock(pending.shard_index, pending.first_row, pending.ids, pending.texts, True)
