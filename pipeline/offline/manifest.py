"""The output's manifest (`OUTPUT/.lengthwise/`): the recorded run, per-shard markers, the
workers' locks and summaries, and `lengthwise status`."""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import socket
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem

from pipeline.core.errors import UsageError, as_storage_error
from pipeline.core.retry import retry_transient
from pipeline.core.settings import RunConfig
from pipeline.offline.source import Shard, WorkerSlot, list_shards, slot_of
from pipeline.offline.summary import output_totals

log = logging.getLogger(__name__)


MANIFEST_DIR = ".lengthwise"  # hidden: readers of the output folder (datasets, pyarrow, Spark) skip it
LEGACY_MANIFEST_DIR = "_lengthwise"  # where outputs made before the rename keep theirs


def manifest_root(fs: fsspec.AbstractFileSystem, output_dir: str) -> str:
    """The output's manifest folder: the legacy one if an earlier run recorded there, so it resumes."""
    legacy = f"{output_dir}/{LEGACY_MANIFEST_DIR}"
    return legacy if fs.exists(f"{legacy}/run.json") else f"{output_dir}/{MANIFEST_DIR}"


def shown_path(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """`path` as the user wrote it: with its protocol (s3://…) unless it is a local file."""
    return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)


def pending(shard_stems: list[str], done_stems: set[str]) -> list[str]:
    """The shards a run still has to do, in input order (failed ones are retried)."""
    return [stem for stem in shard_stems if stem not in done_stems]


def fingerprint_differences(recorded: dict, current: dict) -> list[str]:
    """Human-readable differences between two output fingerprints."""
    return [f"{key}: {recorded.get(key)!r} → {current.get(key)!r}"
            for key in sorted(set(recorded) | set(current)) if recorded.get(key) != current.get(key)]


def fingerprint_digest(fingerprint: dict) -> str:
    """A short stable digest of an output fingerprint, stamped on each done marker so that
    `verify` finds shards committed under other settings than run.json records."""
    return hashlib.blake2b(json.dumps(fingerprint, sort_keys=True, default=str).encode(), digest_size=8).hexdigest()


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
            try:
                with self.fs.open(temp, "w") as f:
                    f.write(json.dumps(data, indent=2, default=str) + "\n")
                self.fs.mv(temp, path)
            except BaseException:
                if self.fs.exists(temp):  # no half-written marker stays behind (a full disk)
                    self.fs.rm(temp)
                raise

        try:
            retry_transient(write, f"writing {path}", log=log.warning)
        except Exception as error:
            raise as_storage_error(error, shown_path(self.fs, path)) or error

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
        if status == "done" and "fingerprint" not in details:
            recorded = self.read_run()  # what claim_output checked and recorded before this shard ran
            details["fingerprint"] = fingerprint_digest(recorded["fingerprint"]) if recorded else None
        self._write_json(f"{self.root}/shards/{stem}.json",
                         {"shard": stem, "status": status, "at": _now(), **details})

    # Fencing: the engine that hands a shard to an attempt grants it first; only the holder commits.

    def grant_attempt(self, stem: str, token: str) -> None:
        """Record `token` as the one attempt that may commit `stem`: an older attempt that comes
        back (a zombie actor, a timed-out task) finds another token at its commit and stands down."""
        self._write_json(f"{self.root}/attempts/{stem}.json", {"shard": stem, "attempt": token, "at": _now()})

    def attempt_holder(self, stem: str) -> str | None:
        """The token of the attempt granted `stem` last; None where no engine grants (one process)."""
        granted = self._read_json(f"{self.root}/attempts/{stem}.json")
        return granted and granted["attempt"]

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
        try:
            self.fs.makedirs(f"{self.root}/shards", exist_ok=True)
        except OSError as error:
            raise as_storage_error(error, shown_path(self.fs, f"{self.root}/shards")) or error
        mine = {"host": socket.gethostname(), "pid": os.getpid(), "since": _now(), "index": slot.index,
                "count": slot.count}
        note = None
        for _ in range(3):
            try:
                created = self._create_exclusive(path, mine)
            except OSError as error:
                raise as_storage_error(error, shown_path(self.fs, path)) or error
            if created:
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
            try:
                self.fs.rm(path)
            except OSError as error:  # storage that failed the run may fail this too; the next run takes it over
                log.warning(f"could not remove the lock {path}: {type(error).__name__}: {error}")


def absolute_url(url: str) -> str:
    """`url` as a process in any working directory reads it: a local path (or file:// URL) made
    absolute against this process's working directory, other URLs (s3://…, memory://…) as given."""
    if "::" in url or fsspec.utils.get_protocol(url) not in ("file", "local"):
        return url
    return LocalFileSystem._strip_protocol(url)


def recorded_locations(config: RunConfig) -> dict:
    """The run's input, output and --reuse as absolute URLs, for run.json: `status` and `verify`
    then find them from any working directory (an Airflow task runs in a temporary one)."""
    return {"input": [absolute_url(url) for url in config.input], "output": absolute_url(config.output),
            "reuse": config.reuse and absolute_url(config.reuse)}


def list_recorded_shards(inputs: list[str], config: dict, storage_options: dict) -> list[Shard]:
    """The shards of the input run.json records (or `inputs`), for `status` and `verify`. An
    input recorded relative (by a lengthwise from before it recorded absolute URLs) is read
    against this directory; where it is not there, the error says so."""
    try:
        return list_shards(inputs, config["id_column"], config["text_column"], storage_options,
                           split=config.get("split"))
    except UsageError as error:
        relative = [url for url in inputs if not os.path.isabs(os.path.expanduser(url)) and ":" not in url]
        if not relative:
            raise
        raise UsageError(f"{error}; run.json records the input {relative[0]!r} relative to the directory of the "
                         f"run that wrote it: run this from that directory, or give --input (verify)") from error


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
    worker, and the output's totals (rows, errors, truncated, flagged by label, as the run's
    summary prints them), without a model: reads the manifest and the input listing (footers)."""
    sink_fs, output_dir = fsspec.core.url_to_fs(output, **storage_options)
    if not sink_fs.exists(f"{manifest_root(sink_fs, output_dir.rstrip('/'))}/run.json"):
        raise UsageError(f"{output} has no lengthwise run (no {MANIFEST_DIR}/run.json); check --output")
    manifest = RunManifest(sink_fs, output_dir.rstrip("/"))
    recorded = manifest.read_run()
    markers = manifest.shard_markers()
    config = recorded["config"]
    recorded_options = {k: v for k, v in config.get("storage_options", {}).items() if v != "<redacted>"}
    shards = list_recorded_shards(config["input"], config, {**recorded_options, **storage_options})
    by_stem = {shard.stem: shard for shard in shards}
    status_of = {stem: markers.get(stem, {}).get("status", "pending") for stem in by_stem}
    locks = manifest.read_locks()
    return {
        **_shard_counts(list(by_stem), status_of, by_stem), "output": output,
        "failed_shards": [{"shard": markers[stem].get("input", stem), "error": markers[stem].get("error")}
                          for stem, state in status_of.items() if state == "failed"],
        "workers": _worker_status(shards, status_of, by_stem, config.get("num_shards", 1), locks,
                                  manifest.worker_summaries()),
        "totals": output_totals(markers[stem] for stem in by_stem if stem in markers),
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
    """Per worker slot of the recorded layout: its shards' counts, whether it runs, its last rows/s
    and the batch setting its last run used (and where that came from: a flag, a default, a
    saved sweep recommendation)."""
    url_to_stem = {shard.url: shard.stem for shard in shards}
    workers = []
    for index in range(count):
        stems = [url_to_stem[url] for url in slot_of([s.url for s in shards], WorkerSlot(index, count))]
        lock = next((h for h in locks if (h.get("index", 0), h.get("count", 1)) == (index, count)), None)
        last = summaries.get((index, count))
        workers.append({"index": index, **_shard_counts(stems, status_of, by_stem),
                        "running": bool(lock and lock.get("alive", True)),
                        "last_rows_per_s": last["summary"].get("rows_per_s") if last else None,
                        "last_finished": last["at"] if last else None,
                        "last_batch_setting": last["summary"].get("batch_setting") if last else None})
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
