"""Checking a Parquet footer before a shard is read: that it agrees with itself, and that the
columns read do not inflate past what a row group may take.

A footer that lies loses rows silently: pyarrow reads as many rows of a row group as the row
group's `num_rows` says, so a footer claiming 40 rows (and 90 for the file) where the pages hold
50 gave 90 rows and a run that exited 0. For a flat column every row is one value (nulls
included), so each read column's `num_values` must equal its row group's `num_rows`, and the
row groups' rows must add up to the file's. A decompression bomb (a few MB of zstd that
inflate to many GB) is refused from the column chunks' `total_uncompressed_size` before any of
it is decompressed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pipeline.core.errors import UsageError

# The most one row group's read columns (id, text) may hold uncompressed. Reading streams
# batches, but a row group is the unit a writer, a bomb and pyarrow's decoder work in, so this
# bounds the work and memory one row group can cost; 2 GiB passes pyarrow's default groups
# (1M rows) of texts up to 2 KB and Spark's 128 MB groups many times over.
MAX_ROW_GROUP_BYTES = 2 << 30
ROW_GROUP_BYTES_VARIABLE = "LENGTHWISE_MAX_ROW_GROUP_BYTES"  # a machine's limit: it changes no result
# The read buffer of a Parquet file, per column: pages are read through it, where pyarrow's default
# (pre_buffer) reads a row group's whole column chunks at once, so memory grew with the row group (an
# 80 MB one, 39 MB of zstd: 53 MiB more resident; through 1 MiB buffers 17 MiB; 8 MiB ones, 38 MiB).
# An object store's file keeps its own read-ahead (s3fs: 5 MB blocks), so requests stay large
READ_BUFFER_BYTES = 1 << 20


def max_row_group_bytes(environ: Mapping[str, str]) -> int:
    """MAX_ROW_GROUP_BYTES, or the LENGTHWISE_MAX_ROW_GROUP_BYTES of a machine that wants another
    (a usage error names it when it is not a positive count of bytes)."""
    text = environ.get(ROW_GROUP_BYTES_VARIABLE, "").strip()
    if not text:
        return MAX_ROW_GROUP_BYTES
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"{ROW_GROUP_BYTES_VARIABLE}={text!r} is not a positive number of bytes")
    return int(text)


def size_text(n: int) -> str:
    """Bytes as a person reads them: 314.6 MB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def footer_problem(url: str, metadata, columns: Sequence[str], limit: int) -> str | None:
    """Why the footer of `url` cannot be trusted or its row groups are too big to read, or None.
    `columns` are the columns read (id, text); a list column's leaves count toward its size, but
    only a flat column is held to one value a row."""
    groups = [metadata.row_group(i) for i in range(metadata.num_row_groups)]
    in_groups = sum(group.num_rows for group in groups)
    if in_groups != metadata.num_rows:
        return (f"{url}: the footer says {metadata.num_rows:,} rows but its row groups hold {in_groups:,}; "
                "the file is damaged: rewrite it")
    for index, group in enumerate(groups):
        chunks = [group.column(j) for j in range(group.num_columns)]
        read = [chunk for chunk in chunks if chunk.path_in_schema.split(".")[0] in columns]  # a list's leaves too
        for j, chunk in enumerate(chunks):
            flat = metadata.schema.column(j).max_repetition_level == 0  # a list's values are not its rows
            if chunk in read and flat and chunk.num_values != group.num_rows:
                return (f"{url}: row group {index} says {group.num_rows:,} rows but its column "
                        f"{chunk.path_in_schema!r} holds {chunk.num_values:,} values; the footer is damaged "
                        "(rows would be lost): rewrite the file")
        inflated = sum(chunk.total_uncompressed_size for chunk in read)
        if inflated > limit:
            on_disk = sum(chunk.total_compressed_size for chunk in read)
            names = ", ".join(dict.fromkeys(chunk.path_in_schema.split(".")[0] for chunk in read))
            return (f"{url}: row group {index} inflates to {size_text(inflated)} uncompressed (columns "
                    f"{names}, {size_text(on_disk)} on disk), over the "
                    f"{size_text(limit)} a row group may take ({ROW_GROUP_BYTES_VARIABLE}); rewrite it with "
                    "smaller row groups")
    return None
