"""Writing one output Parquet file per input shard, atomically.

Rows stream into a hidden temporary file beside the final one (a name that Parquet
readers and `*.parquet` globs skip) and the file is renamed into place only when every
row of its shard has been written, so a partial output is never visible.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import UsageError, retry_transient
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
        retry_transient(lambda: self.fs.mv(self.temp_path, self.final_path), f"committing {self.final_path}",
                        log=_log)
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
        try:
            self.fs, self.output_dir = fsspec.core.url_to_fs(output, **(storage_options or {}))
            self.output_dir = self.output_dir.rstrip("/")
            self.fs.makedirs(self.output_dir, exist_ok=True)
        except (ImportError, ValueError, OSError) as error:
            raise UsageError(f"cannot create output directory {output!r}: {error}; check --output") from error
        self._writers: dict[int, ShardWriter] = {}
        self.committed: dict[int, str] = {}  # shard index → final path, for outputs committed so far

    def write(self, shard_index: int, shard: Shard, table: pa.Table) -> None:
        if shard_index not in self._writers:
            self._writers[shard_index] = ShardWriter(self.fs, self.output_dir, shard)
        self._writers[shard_index].write(table)

    def commit(self, shard_index: int) -> str:
        path = self._writers[shard_index].commit()  # on failure the writer stays, so abort() finds it
        del self._writers[shard_index]
        self.committed[shard_index] = path
        return path

    def abort(self, shard_index: int) -> None:
        writer = self._writers.pop(shard_index, None)
        if writer is not None:
            writer.abort()

    def remove_stale_temporaries(self) -> int:
        """Delete temporary outputs a killed run left behind (call under the run lock)."""
        stale = self.fs.glob(f"{self.output_dir}/.*.parquet.*.tmp")
        for path in stale:
            self.fs.rm(path)
        return len(stale)

    def remove_outputs(self, stems: list[str]) -> None:
        """Delete these shards' committed outputs (for --overwrite: nothing old stays visible)."""
        for stem in stems:
            path = f"{self.output_dir}/{stem}.parquet"
            if self.fs.exists(path):
                self.fs.rm(path)

    def abort_all(self) -> None:
        for writer in self._writers.values():
            writer.abort()
        self._writers.clear()


# ── the run manifest: what is done, what failed, under which settings ─────────────────────

MANIFEST_DIR = "_lengthwise"


def pending(shard_stems: list[str], done_stems: set[str]) -> list[str]:
    """The shards a run still has to do, in input order (failed ones are retried)."""
    return [stem for stem in shard_stems if stem not in done_stems]


def fingerprint_differences(recorded: dict, current: dict) -> list[str]:
    """Human-readable differences between two output fingerprints."""
    return [f"{key}: {recorded.get(key)!r} → {current.get(key)!r}"
            for key in sorted(set(recorded) | set(current)) if recorded.get(key) != current.get(key)]


class RunManifest:
    """`OUTPUT/_lengthwise/`: run.json (resolved config and the fingerprint of everything that
    changes outputs), shards/<stem>.json (one marker per finished or failed shard, written
    after the shard's output is committed) and lock (host and pid of the run in progress)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, output_dir: str):
        self.fs = fs
        self.root = f"{output_dir}/{MANIFEST_DIR}"
        self.fs.makedirs(f"{self.root}/shards", exist_ok=True)

    def _write_json(self, path: str, data: dict) -> None:
        def write() -> None:
            temp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
            with self.fs.open(temp, "w") as f:
                f.write(json.dumps(data, indent=2, default=str) + "\n")
            self.fs.mv(temp, path)

        retry_transient(write, f"writing {path}", log=_log)

    def _read_json(self, path: str) -> dict | None:
        try:
            with self.fs.open(path, "r") as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def read_run(self) -> dict | None:
        return self._read_json(f"{self.root}/run.json")

    def write_run(self, fingerprint: dict, config: dict) -> None:
        self._write_json(f"{self.root}/run.json", {"fingerprint": fingerprint, "config": config,
                                                   "updated_at": _now()})

    def shard_markers(self) -> dict[str, dict]:
        markers = {}
        for path in self.fs.glob(f"{self.root}/shards/*.json"):
            marker = self._read_json(path)
            if marker is not None:
                markers[marker["shard"]] = marker
        return markers

    def mark(self, stem: str, status: str, **details) -> None:
        self._write_json(f"{self.root}/shards/{stem}.json",
                         {"shard": stem, "status": status, "at": _now(), **details})

    def clear_markers(self) -> None:
        for path in self.fs.glob(f"{self.root}/shards/*.json"):
            self.fs.rm(path)

    # The lock: one run per output directory.

    def acquire_lock(self) -> str | None:
        """Take the lock; returns a note when a stale lock of a dead process was taken over.
        Raises UsageError when another live run holds it."""
        path = f"{self.root}/lock"
        mine = {"host": socket.gethostname(), "pid": os.getpid(), "since": _now()}
        note = None
        for _ in range(3):
            if self._create_exclusive(path, mine):
                return note
            holder = self._read_json(path)
            if holder is None:  # released between our two looks
                continue
            if holder.get("host") == mine["host"] and not _process_alive(holder.get("pid")):
                note = (f"took over a stale lock of process {holder.get('pid')} on {holder.get('host')} "
                        f"(since {holder.get('since')}), which is no longer running")
                self.fs.rm(path)
                continue
            raise UsageError(f"another run (pid {holder.get('pid')} on {holder.get('host')}, since "
                             f"{holder.get('since')}) is writing to this output; wait for it, or delete "
                             f"{path} if that run is gone")
        raise UsageError(f"could not take the lock {path}: other runs keep taking it; try again")

    def _create_exclusive(self, path: str, data: dict) -> bool:
        """Create `path` only if it does not exist: atomic (O_EXCL) on a local disk; on an object
        store, write then read back (the last writer wins, and only it proceeds)."""
        text = json.dumps(data) + "\n"
        if isinstance(self.fs, LocalFileSystem):
            try:
                descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(descriptor, "w") as f:
                f.write(text)
            return True
        if self.fs.exists(path):
            return False
        self.fs.pipe(path, text.encode())
        return self._read_json(path) == json.loads(text)

    def read_lock(self) -> dict | None:
        """The lock's holder, with `alive` (False: a dead process on this host left it)."""
        holder = self._read_json(f"{self.root}/lock")
        if holder is not None and holder.get("host") == socket.gethostname():
            holder["alive"] = _process_alive(holder.get("pid"))
        return holder

    def release_lock(self) -> None:
        path = f"{self.root}/lock"
        holder = self._read_json(path)
        if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            self.fs.rm(path)


def _process_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
