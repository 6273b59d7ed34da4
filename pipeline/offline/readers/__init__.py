"""Input formats: a format is one module, answering the same three questions of a shard.

A format module has
- `NAME` (for messages: "cannot read X as Parquet"), `SUFFIXES` (the file names it reads, the
  longest first), `IN_FOLDERS` (whether a plain folder's files of this format are shards; an Arrow
  file is one only as part of a `datasets` folder, which `arrow_stream.saved_dataset_files` lists)
  and `COUNTED_BY` (where its row count comes from, for the message when the rows read differ);
- `count_rows(file, url, columns) -> ShardFacts`: the row count, the columns and whatever problem
  the format finds before a row is read;
- `open_batches(file, url, columns, block_rows) -> (schema, batches)`: the named columns in record
  batches of at most `block_rows` rows, memory bounded by a batch, never by the shard.

`columns` is a `Columns` (the id, the texts, the kept ones): reading one more text is one more
name, no change here. What is the same for every format (listing, the worker's share, retries and
resuming after the rows handed on, the column checks, blocks, output names) is offline/source.py's.
"""

from __future__ import annotations

from pipeline.offline.readers import arrow_stream, jsonl, parquet
from pipeline.offline.readers.base import ROW_ERROR_COLUMN, Columns, ShardError, ShardFacts

FORMATS = (parquet, arrow_stream, jsonl)
DEFAULT_FORMAT = parquet  # a file named without a known suffix (`--input data.bin`) is read as Parquet

__all__ = ["FORMATS", "ROW_ERROR_COLUMN", "Columns", "ShardError", "ShardFacts", "format_of", "in_folders",
           "without_suffix"]


def format_of(path: str):
    """The format module that reads `path`, by its name."""
    return next((reader for reader in FORMATS if path.endswith(reader.SUFFIXES)), DEFAULT_FORMAT)


def in_folders(path: str) -> bool:
    """Whether a file found in an input folder is a shard."""
    return any(reader.IN_FOLDERS and path.endswith(reader.SUFFIXES) for reader in FORMATS)


def without_suffix(relative: str) -> str:
    """A shard's path without its format's suffix: what its output is named after
    (`part-1.parquet`, `part-1.jsonl.gz` → `part-1`)."""
    for reader in FORMATS:
        for suffix in reader.SUFFIXES:
            if relative.endswith(suffix):
                return relative[: -len(suffix)]
    return relative
