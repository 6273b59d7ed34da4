"""Writing one output Parquet file per input shard, atomically.

Rows stream into a hidden temporary file beside the final one (a name that Parquet
readers and `*.parquet` globs skip) and the file is renamed into place only when every
row of its shard has been written, so a partial output is never visible.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import queue
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from pipeline.config import RunConfig
from pipeline.errors import UsageError, retry_transient
from pipeline.source import RowBlock, Shard, WorkerSlot, list_shards, slot_of
from pipeline.summary import IdTracker, RowStats, RunSummary, StageTimes
from pipeline.windows import Window

log = logging.getLogger(__name__)


def temporary_stem(relative: str) -> str:
    """The shard stem of a temporary output `[DIR/].NAME.parquet.ATTEMPT.tmp` (path below the output)."""
    folder, _, name = relative.rpartition("/")
    return f"{folder}/" * bool(folder) + name[1:name.rindex(".parquet.")]


def output_paths(output_dir: str, stem: str) -> tuple[str, str]:
    """The final and a new temporary path of a shard's output; a stem `dt=X/part-0` (an input's
    path below its root) mirrors its folders under the output."""
    folder, _, name = f"{output_dir}/{stem}".rpartition("/")
    return f"{folder}/{name}.parquet", f"{folder}/.{name}.parquet.{uuid.uuid4().hex[:12]}.tmp"


class ShardWriter:
    """Streams one shard's output rows to a temporary file, then commits it by rename."""

    def __init__(self, fs: fsspec.AbstractFileSystem, output_dir: str, shard: Shard):
        self.fs = fs
        self.shard = shard
        self.final_path, self.temp_path = output_paths(output_dir, shard.stem)
        self.rows_written = 0
        self._file = None
        self._writer = None

    def write(self, table: pa.Table) -> None:
        if self._writer is None:
            self.fs.makedirs(self.temp_path.rpartition("/")[0], exist_ok=True)  # a partition's folder
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
                        log=log.warning)
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


TEMPORARY_NAME = re.compile(r"\..+\.parquet\..+\.tmp")  # .NAME.parquet.ATTEMPT.tmp


class ShardSink:
    """One ShardWriter per shard in flight. Opening resolves the filesystem only; `create`
    makes the output directory, once the run's settings and model have been checked, so a
    usage error leaves the output untouched."""

    def __init__(self, output: str, storage_options: dict | None = None):
        self.output = output
        try:
            self.fs, self.output_dir = fsspec.core.url_to_fs(output, **(storage_options or {}))
        except (ImportError, ValueError, OSError) as error:
            raise UsageError(f"cannot open output directory {output!r}: {error}; check --output") from error
        self.output_dir = self.output_dir.rstrip("/")
        self._writers: dict[int, ShardWriter] = {}
        self.committed: dict[int, str] = {}  # shard index → final path, for outputs committed so far

    def create(self) -> None:
        try:
            self.fs.makedirs(self.output_dir, exist_ok=True)
        except OSError as error:
            raise UsageError(f"cannot create output directory {self.output!r}: {error}; check --output") from error

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

    def remove_stale_temporaries(self, stems: list[str]) -> int:
        """Delete temporary outputs a killed attempt left behind for these shards (call under
        the lock of the worker that owns them: another worker's live files are never touched)."""
        mine = set(stems)
        temporaries = [path[len(self.output_dir) + 1:] for path in self.fs.find(self.output_dir)
                       if TEMPORARY_NAME.fullmatch(path.rsplit("/", 1)[-1])]
        stale = [f"{self.output_dir}/{path}" for path in temporaries if temporary_stem(path) in mine]
        for path in stale:
            self.fs.rm(path)
        return len(stale)

    def remove_outputs(self, stems: list[str]) -> None:
        """Delete these shards' committed outputs (for --overwrite: nothing old stays visible)."""
        for stem in stems:
            path = output_paths(self.output_dir, stem)[0]
            if self.fs.exists(path):
                self.fs.rm(path)

    def abort_all(self) -> None:
        for writer in self._writers.values():
            writer.abort()
        self._writers.clear()


# ── windows to output rows ───────────────────────────────────────────────────────────────

ColumnsOf = Callable[[dict, np.ndarray, int], dict]  # (outputs, valid, rows) → the job's Arrow columns
CountFlagged = Callable[[pa.Table], tuple[int, dict]]  # output rows → (rows flagged, flag label → rows)


def output_table(block: RowBlock, window: Window, start: int, columns_of: ColumnsOf) -> pa.Table:
    """The output rows of one block: id, the kept input columns, the job's columns, truncated,
    error — in input order."""
    positions = slice(start, start + block.num_rows)
    valid = window.valid[positions]
    columns = columns_of({k: v[positions] for k, v in window.outputs.items()}, valid, block.num_rows)
    columns = {"id": block.ids, **block.kept, **columns,
               "truncated": pa.array(window.encoded.truncated[positions] & valid, pa.bool_()),
               "error": pa.array(window.encoded.errors[positions], pa.string())}
    return pa.table(columns)


class WindowWriter:
    """Writes finished windows block by block and commits each shard whose last row it holds,
    then marks it done. A shard that failed (while being read, or at its commit) is dropped
    whole: its temporary file is deleted and nothing of it is committed."""

    def __init__(self, sink: ShardSink, manifest: RunManifest, shards: list[Shard], columns_of: ColumnsOf,
                 times: StageTimes, count_flagged: CountFlagged | None = None):
        self.sink, self.manifest, self.shards = sink, manifest, shards
        self.columns_of = columns_of
        self.count_flagged = count_flagged
        self.flagged: dict[int, list] = {}  # shard index → [rows flagged, {label: rows}]
        self.times = times
        self.failures: dict[int, str] = {}  # shard index → why it failed
        self.counts: dict[int, np.ndarray] = {}  # shard index → rows, error rows, truncated rows written
        self.ids = IdTracker()
        self.row_stats = RowStats()

    def write(self, window: Window) -> None:
        started = time.perf_counter()
        start = 0
        for block in window.blocks:
            positions = slice(start, start + block.num_rows)
            start += block.num_rows
            if block.failure is not None:
                self.failures[block.shard_index] = block.failure
                self.sink.abort(block.shard_index)
            if block.shard_index in self.failures:
                continue
            shard = self.shards[block.shard_index]
            table = output_table(block, window, positions.start, self.columns_of)
            self.sink.write(block.shard_index, shard, table)
            if self.count_flagged is not None:
                self._add_flagged(block.shard_index, *self.count_flagged(table))
            if block.is_last_of_shard:
                try:
                    self.sink.commit(block.shard_index)
                except Exception as error:  # e.g. the rename failed for good, or the row count is wrong
                    self.failures[block.shard_index] = f"committing the output failed: {type(error).__name__}: {error}"
                    self.sink.abort(block.shard_index)
                    continue
                self.manifest.mark(shard.stem, "done", input=shard.url, rows=shard.num_rows,
                                   host=socket.gethostname(), pid=os.getpid())
            self.ids.add(block.ids.to_pylist())
            valid = window.valid[positions]
            counts = self.counts.setdefault(block.shard_index, np.zeros(3, np.int64))
            counts += (block.num_rows, (~valid).sum(), (window.encoded.truncated[positions] & valid).sum())
            self.row_stats.add(window.encoded.full_lengths[positions][valid], window.encoded.errors[positions])
        self.times.write += time.perf_counter() - started

    def _add_flagged(self, shard_index: int, rows: int, by_label: dict) -> None:
        counts = self.flagged.setdefault(shard_index, [0, dict.fromkeys(by_label, 0)])
        counts[0] += rows
        for label, hits in by_label.items():
            counts[1][label] += hits

    def finish(self, summary: RunSummary) -> None:
        """Drop shards left open (a failure, --fail-fast, an interrupt), mark failed shards
        failed, and put rows, errors, truncations and duplicate ids into `summary`."""
        self.sink.abort_all()
        for shard_index, reason in sorted(self.failures.items()):
            shard = self.shards[shard_index]
            self.manifest.mark(shard.stem, "failed", input=shard.url, error=reason)
            summary.failed_shards.append({"shard": shard.url, "error": reason})
        written = sum((c for i, c in self.counts.items() if i in self.sink.committed), np.zeros(3, np.int64))
        summary.rows, summary.error_rows, summary.truncated_rows = (int(n) for n in written)
        if self.count_flagged is not None:
            committed = [self.flagged[i] for i in self.sink.committed if i in self.flagged]
            summary.flagged_rows = sum(rows for rows, _ in committed)
            summary.flagged_by_label = {label: sum(by_label[label] for _, by_label in committed)
                                        for label in (committed[0][1] if committed else {})}
        summary.duplicate_ids, summary.duplicate_id_examples = self.ids.duplicates(self.sink.fs,
                                                                                   self.sink.committed.values())
        summary.token_lengths, summary.error_reasons = self.row_stats.token_lengths(), self.row_stats.top_reasons()


class BackgroundWriter:
    """A WindowWriter on its own thread, fed in order through a bounded queue, so that Parquet
    encoding, object-store uploads, commits and id hashing never hold up the device loop. At
    most `depth` windows wait; a write error is raised at the next `write` or at `close`."""

    def __init__(self, writer: WindowWriter, depth: int = 2):
        self.writer = writer
        self.windows: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._write_queued, name="lengthwise-writer", daemon=True)
        self.thread.start()

    def _write_queued(self) -> None:
        while (window := self.windows.get()) is not None:
            if self.error is None:  # after an error, later windows are dropped: their shards stay undone
                try:
                    self.writer.write(window)
                except BaseException as error:  # raised in the device loop's thread
                    self.error = error

    @property
    def failures(self) -> dict[int, str]:
        """Shards whose failure the writer has seen so far (up to `depth` windows late)."""
        return self.writer.failures

    def write(self, window: Window) -> None:
        self._raise_error()
        self.windows.put(window)

    def close(self, raise_error: bool = True) -> None:
        """Wait for the queued windows to be written; idempotent."""
        if self.thread.is_alive():
            self.windows.put(None)
            self.thread.join()
        if raise_error:
            self._raise_error()

    def _raise_error(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error


# ── the run manifest: what is done, what failed, under which settings ─────────────────────

MANIFEST_DIR = ".lengthwise"  # hidden: readers of the output folder (datasets, pyarrow, Spark) skip it
LEGACY_MANIFEST_DIR = "_lengthwise"  # where outputs made before the rename keep theirs


def manifest_root(fs: fsspec.AbstractFileSystem, output_dir: str) -> str:
    """The output's manifest folder: the legacy one if an earlier run recorded there, so it resumes."""
    legacy = f"{output_dir}/{LEGACY_MANIFEST_DIR}"
    return legacy if fs.exists(f"{legacy}/run.json") else f"{output_dir}/{MANIFEST_DIR}"


def pending(shard_stems: list[str], done_stems: set[str]) -> list[str]:
    """The shards a run still has to do, in input order (failed ones are retried)."""
    return [stem for stem in shard_stems if stem not in done_stems]


def fingerprint_differences(recorded: dict, current: dict) -> list[str]:
    """Human-readable differences between two output fingerprints."""
    return [f"{key}: {recorded.get(key)!r} → {current.get(key)!r}"
            for key in sorted(set(recorded) | set(current)) if recorded.get(key) != current.get(key)]


class RunManifest:
    """`OUTPUT/.lengthwise/`: run.json (resolved config and the fingerprint of everything that
    changes outputs), shards/<stem>.json (one marker per finished or failed shard, written
    after the shard's output is committed), the lock of each running worker (`lock` for a
    single worker, `lock-worker-I-of-N` for worker I of N: host and pid) and workers/I-of-N.json
    (the last summary of each worker)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, output_dir: str):
        self.fs = fs
        self.root = manifest_root(fs, output_dir)  # created by the first write (the lock), not on open

    def _write_json(self, path: str, data: dict) -> None:
        def write() -> None:
            temp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
            self.fs.makedirs(path.rpartition("/")[0], exist_ok=True)  # shards/dt=X/ for a partitioned input
            with self.fs.open(temp, "w") as f:
                f.write(json.dumps(data, indent=2, default=str) + "\n")
            self.fs.mv(temp, path)

        retry_transient(write, f"writing {path}", log=log.warning)

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

    def write_worker_summary(self, slot: WorkerSlot, summary: dict) -> None:
        self.fs.makedirs(f"{self.root}/workers", exist_ok=True)
        self._write_json(f"{self.root}/workers/{slot.index}-of-{slot.count}.json",
                         {"index": slot.index, "count": slot.count, "at": _now(), "summary": summary})

    def worker_summaries(self) -> dict[tuple[int, int], dict]:
        """(index, count) → the last summary that worker wrote."""
        found = {}
        for path in self.fs.glob(f"{self.root}/workers/*.json"):
            record = self._read_json(path)
            if record is not None:
                found[(record["index"], record["count"])] = record
        return found

    def shard_markers(self) -> dict[str, dict]:
        markers = {}
        for path in [p for p in self.fs.find(f"{self.root}/shards") if p.endswith(".json")]:
            marker = self._read_json(path)
            if marker is not None:
                markers[marker["shard"]] = marker
        return markers

    def mark(self, stem: str, status: str, **details) -> None:
        self._write_json(f"{self.root}/shards/{stem}.json",
                         {"shard": stem, "status": status, "at": _now(), **details})

    def clear_markers(self, stems: list[str]) -> None:
        for stem in stems:
            path = f"{self.root}/shards/{stem}.json"
            if self.fs.exists(path):
                self.fs.rm(path)

    # The locks: one live process per worker slot, and no two slot layouts at once.

    def lock_path(self, slot: WorkerSlot) -> str:
        return f"{self.root}/lock" if slot.count == 1 else f"{self.root}/lock-worker-{slot.index}-of-{slot.count}"

    def acquire_lock(self, slot: WorkerSlot = WorkerSlot()) -> str | None:
        """Take this slot's lock; returns a note when a stale lock of a dead process was taken
        over. Raises UsageError when a live process holds it, or when live workers of another
        layout (another --num-shards) write to this output."""
        for holder in self.read_locks():
            if holder.get("alive", True) and holder.get("count", 1) != slot.count:
                raise UsageError(f"workers of a run split {holder.get('count', 1)} way(s) are writing to this output "
                                 f"(pid {holder.get('pid')} on {holder.get('host')}); wait for them, or use the "
                                 f"same --num-shards")
        path = self.lock_path(slot)
        self.fs.makedirs(f"{self.root}/shards", exist_ok=True)
        mine = {"host": socket.gethostname(), "pid": os.getpid(), "since": _now(), "index": slot.index,
                "count": slot.count}
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
            who = "another run" if slot.count == 1 else f"another worker with index {slot.index} of {slot.count}"
            raise UsageError(f"{who} (pid {holder.get('pid')} on {holder.get('host')}, since "
                             f"{holder.get('since')}) is writing to this output; wait for it, or delete "
                             f"{path} if that process is gone")
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

    def read_locks(self) -> list[dict]:
        """Every worker's lock holder, with `alive` (False: a dead process on this host left it)."""
        holders = []
        for path in sorted(self.fs.glob(f"{self.root}/lock*")):
            holder = self._read_json(path)
            if holder is None:
                continue
            if holder.get("host") == socket.gethostname():
                holder["alive"] = _process_alive(holder.get("pid"))
            holders.append(holder)
        return holders

    def release_lock(self, slot: WorkerSlot = WorkerSlot()) -> None:
        path = self.lock_path(slot)
        holder = self._read_json(path)
        if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            self.fs.rm(path)


SECRET_WORDS = ("key", "secret", "token", "password", "credential", "session")


def recorded_config(config: RunConfig) -> dict:
    """The resolved config as saved beside the outputs (the same for every worker: its own
    index is left out), with secret storage options blanked."""
    data = config.to_dict()
    data.pop("shard_index", None)
    data["storage_options"] = {k: "<redacted>" if any(w in k.lower() for w in SECRET_WORDS) else v
                               for k, v in config.storage_options.items()}
    return data


def run_status(output: str, storage_options: dict) -> dict:
    """Shards done, failed and pending for the run recorded in `output`, overall and per
    worker, without a model: reads the manifest and the input listing (footers)."""
    sink_fs, output_dir = fsspec.core.url_to_fs(output, **storage_options)
    if not sink_fs.exists(f"{manifest_root(sink_fs, output_dir.rstrip('/'))}/run.json"):
        raise UsageError(f"{output} has no lengthwise run (no {MANIFEST_DIR}/run.json); check --output")
    manifest = RunManifest(sink_fs, output_dir.rstrip("/"))
    recorded = manifest.read_run()
    markers = manifest.shard_markers()
    config = recorded["config"]
    recorded_options = {k: v for k, v in config.get("storage_options", {}).items() if v != "<redacted>"}
    shards = list_shards(config["input"], config["id_column"], config["text_column"],
                         {**recorded_options, **storage_options}, split=config.get("split"))
    by_stem = {shard.stem: shard for shard in shards}
    status_of = {stem: markers.get(stem, {}).get("status", "pending") for stem in by_stem}
    locks = manifest.read_locks()
    return {
        **_shard_counts(list(by_stem), status_of, by_stem), "output": output,
        "failed_shards": [{"shard": markers[stem].get("input", stem), "error": markers[stem].get("error")}
                          for stem, state in status_of.items() if state == "failed"],
        "workers": _worker_status(shards, status_of, by_stem, config.get("num_shards", 1), locks,
                                  manifest.worker_summaries()),
        "lock": next((lock for lock in locks if lock.get("count", 1) == 1), None),
        "locks": locks,
    }


def _shard_counts(stems: list[str], status_of: dict[str, str], by_stem: dict[str, Shard]) -> dict:
    done = [stem for stem in stems if status_of[stem] == "done"]
    return {"shards": len(stems), "done": len(done), "failed": sum(status_of[s] == "failed" for s in stems),
            "pending": sum(status_of[s] == "pending" for s in stems),
            "rows": sum(by_stem[s].num_rows for s in stems), "rows_done": sum(by_stem[s].num_rows for s in done)}


def _worker_status(shards: list[Shard], status_of: dict[str, str], by_stem: dict[str, Shard], count: int,
                   locks: list[dict], summaries: dict) -> list[dict]:
    """Per worker slot of the recorded layout: its shards' counts, whether it runs, its last rows/s."""
    url_to_stem = {shard.url: shard.stem for shard in shards}
    workers = []
    for index in range(count):
        stems = [url_to_stem[url] for url in slot_of([s.url for s in shards], WorkerSlot(index, count))]
        lock = next((h for h in locks if (h.get("index", 0), h.get("count", 1)) == (index, count)), None)
        last = summaries.get((index, count))
        workers.append({"index": index, **_shard_counts(stems, status_of, by_stem),
                        "running": bool(lock and lock.get("alive", True)),
                        "last_rows_per_s": last["summary"].get("rows_per_s") if last else None,
                        "last_finished": last["at"] if last else None})
    return workers


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
