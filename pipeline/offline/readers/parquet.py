"""Parquet shards: the row count and columns from the footer, which is checked before a row is read
(offline/footer.py: a footer that lies, a decompression bomb); pages read through a buffer."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.offline.footer import READ_BUFFER_BYTES, footer_problem, max_row_group_bytes
from pipeline.offline.readers.base import Columns, ShardFacts

NAME = "Parquet"
SUFFIXES = (".parquet",)
IN_FOLDERS = True  # a folder's *.parquet files are its shards
COUNTED_BY = "the footer"


def count_rows(f, url: str, columns: Columns) -> ShardFacts:
    """The footer's row count and schema; its problem for the id and text columns (a list column's
    leaves count toward the size a row group inflates to)."""
    metadata = pq.ParquetFile(f).metadata
    schema = metadata.schema.to_arrow_schema()
    problem = footer_problem(url, metadata, [columns.id, *columns.texts], max_row_group_bytes(os.environ))
    return ShardFacts(metadata.num_rows, {field.name: field.type for field in schema}, problem)


def open_batches(f, url: str, columns: Columns, block_rows: int) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """The file's schema and its record batches of the named columns, at most `block_rows` rows each;
    decoded on the reading thread: Arrow's threads, one a column, cost the run's process more CPU
    (host_rate: 1.7 µs a row in them, against 0.7-1.4 more on the reading thread)."""
    parquet = pq.ParquetFile(f, buffer_size=READ_BUFFER_BYTES, pre_buffer=False)  # pages, not whole row groups
    return parquet.schema_arrow, parquet.iter_batches(batch_size=block_rows, columns=columns.names, use_threads=False)
