"""Writing one output Parquet file per input shard, atomically.

Rows stream into a hidden temporary file beside the final one (a name that Parquet
readers and `*.parquet` globs skip) and the file is renamed into place only when every
row of its shard has been written, so a partial output is never visible.
"""

from __future__ import annotations

import uuid

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.source import Shard


class ShardWriter:
    """Streams one shard's output rows to a temporary file, then commits it by rename."""

    def __init__(self, fs: fsspec.AbstractFileSystem, output_dir: str, shard: Shard):
        self.fs = fs
        self.shard = shard
        self.final_path = f"{output_dir}/{shard.stem}.parquet"
        self.temp_path = f"{output_dir}/.{shard.stem}.parquet.{uuid.uuid4().hex[:12]}.tmp"
        self.rows_written = 0
        self._file = None
        self._writer = None

    def write(self, table: pa.Table) -> None:
        if self._writer is None:
            self._file = self.fs.open(self.temp_path, "wb")
            self._writer = pq.ParquetWriter(self._file, table.schema, compression="zstd")
        self._writer.write_table(table)
        self.rows_written += table.num_rows

    def commit(self) -> str:
        """Close and rename into place; refuses if rows written ≠ rows in the input shard."""
        if self.rows_written != self.shard.num_rows:
            self.abort()
            raise RuntimeError(f"{self.shard.url}: wrote {self.rows_written} rows, input has "
                               f"{self.shard.num_rows}; output not committed")
        self._writer.close()
        self._file.close()
        self.fs.mv(self.temp_path, self.final_path)
        return self.final_path

    def abort(self) -> None:
        """Drop the temporary file; the final name is never touched."""
        if self._writer is not None:
            try:
                self._writer.close()
                self._file.close()
            finally:
                self._writer = None
                if self.fs.exists(self.temp_path):
                    self.fs.rm(self.temp_path)


class ShardSink:
    """One ShardWriter per shard in flight; the output directory is created on open."""

    def __init__(self, output: str, storage_options: dict | None = None):
        self.fs, self.output_dir = fsspec.core.url_to_fs(output, **(storage_options or {}))
        self.output_dir = self.output_dir.rstrip("/")
        self.fs.makedirs(self.output_dir, exist_ok=True)
        self._writers: dict[int, ShardWriter] = {}

    def write(self, shard_index: int, shard: Shard, table: pa.Table) -> None:
        if shard_index not in self._writers:
            self._writers[shard_index] = ShardWriter(self.fs, self.output_dir, shard)
        self._writers[shard_index].write(table)

    def commit(self, shard_index: int) -> str:
        return self._writers.pop(shard_index).commit()

    def abort_all(self) -> None:
        for writer in self._writers.values():
            writer.abort()
        self._writers.clear()
