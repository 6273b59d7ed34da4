"""The output's manifest (`OUTPUT/.lengthwise/`): the recorded run, per-shard markers, the
workers' locks and summaries, and `lengthwise status`."""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import re
import socket
import time
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem

from pipeline.core.errors import RERUN, StorageError, UsageError, as_credentials_error, as_storage_error
from pipeline.core.redact import recordable_options, redact_url, usable_recorded_options
from pipeline.core.retry import retry_transient
from pipeline.offline.config import RunConfig
from pipeline.offline.done_markers import listed_outputs, untrusted_done_markers
from pipeline.offline.locations import LEGACY_MANIFEST_DIR, MANIFEST_DIR, shown_path
from pipeline.offline.lock import (DEFAULT_LEASE_S, LOCK_NAME, LeaseKeeper, LockStore, encode, lease_of,
                                   lost_as_read, new_record, process_alive, refusal, takeover_reason)
from pipeline.offline.source import Shard, WorkerSlot, list_shards, slot_of
from pipeline.offline.summary import output_totals

log = logging.getLogger(__name__)


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


def fingerprint_digest(fingerprint: dict) -> str:
    """A short stable digest of an output fingerprint, stamped on each done marker so that
    `verify` finds shards committed under other settings than run.json records."""
    return hashlib.blake2b(json.dumps(fingerprint, sort_keys=True, default=str).encode(), digest_size=8).hexdigest()


class DamagedManifestFile(UsageError):
    """A manifest file that is empty, truncated, not JSON or of another shape than lengthwise
    writes (a disk that filled, a hand edit, a copy cut short); the message names the file, what
    is wrong with it and what to do."""


RUN_FIELDS = {"fingerprint": dict, "config": dict}
MARKER_FIELDS = {"shard": str, "status": str}
WORKER_SUMMARY_FIELDS = {"index": int, "count": int, "at": str, "summary": dict}
RUN_ADVICE = ("it records the settings the output's results were made with: delete it and rerun the job with those "
              "settings (shards marked done are kept) or with --overwrite (every shard is redone)")


def parse_record(data: bytes, fields: dict[str, type]) -> dict:
    """The JSON object in `data`, with each of `fields` of its type; a ValueError saying what is
    wrong otherwise."""
    if not data.strip():
        raise ValueError("it is empty")
    try:
        record = json.loads(data)
    except ValueError as error:
        raise ValueError(f"it is truncated or not JSON: {error}") from None
    if not isinstance(record, dict):
        raise ValueError(f"it holds a JSON {type(record).__name__}, not an object")
    for name, kind in fields.items():
        if name not in record:
            raise ValueError(f"it has no {name!r}")
        if not isinstance(record[name], kind):
            raise ValueError(f"its {name!r} is a JSON {type(record[name]).__name__}")
    return record


MARKER_TEMPORARY = re.compile(r"(?P<stem>.+)\.json\.[0-9a-f]{8}\.tmp")  # shards/STEM.json.XXXXXXXX.tmp


def remove_temporaries(fs: fsspec.AbstractFileSystem, folder: str, pattern: re.Pattern, stems: list[str]) -> int:
    """Delete the files below `folder` whose path below it matches `pattern` with a `stem` group
    among `stems` (a killed attempt's temporaries of this worker's shards); how many went."""
    if not fs.exists(folder):
        return 0
    mine = set(stems)
    stale = [path for path in fs.find(folder)
             if (name := pattern.fullmatch(path[len(folder) + 1:])) and name["stem"] in mine]
    for path in stale:
        fs.rm(path)
    return len(stale)


class RunManifest:
    """`OUTPUT/.lengthwise/`: run.json (resolved config and the fingerprint of everything that
    changes outputs), shards/<stem>.json (one marker per finished or failed shard, written
    after the shard's output is committed), the lock of each running worker (`lock` for a
    single worker, `lock-worker-I-of-N` for worker I of N: host, pid and a lease its heartbeat
    renews; see lock.py) and workers/I-of-N.json (the last summary of each worker)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, output_dir: str):
        self.fs = fs
        try:  # the first look at the output's storage: no credentials, or a store down, is one line here
            self.root = manifest_root(fs, output_dir)  # created by the first write (the lock), not on open
        except Exception as error:
            where = shown_path(fs, output_dir)
            raise as_credentials_error(error, where) or as_storage_error(error, where) or error
        self._leases: dict[str, LeaseKeeper] = {}  # the locks this run holds, by path, each with its heartbeat
        self._followed: dict[str, str] = {}  # the locks another process holds for this one (a Ray driver's), by path → token

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

    def _read_record(self, path: str, fields: dict[str, type], advice: str) -> dict | None:
        """The record at `path`, None when there is none; DamagedManifestFile (saying `advice`)
        when it is not a JSON object with `fields`."""
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        try:
            return parse_record(data, fields)
        except ValueError as problem:
            raise DamagedManifestFile(f"{shown_path(self.fs, path)} is damaged ({problem}); {advice}") from None

    def read_run(self, advice: str = RUN_ADVICE) -> dict | None:
        return self._read_record(f"{self.root}/run.json", RUN_FIELDS, advice)

    def write_run(self, fingerprint: dict, config: dict, carried_from: dict | None = None) -> None:
        """`carried_from`: a change of models (offline/model_set.py's ModelChange) records the fingerprint its
        kept models' columns are carried from, so that a rerun after a kill carries them still."""
        self._write_json(f"{self.root}/run.json", {"fingerprint": fingerprint, "config": config,
                                                   **({"carried_from": carried_from} if carried_from else {}),
                                                   "updated_at": _now()})

    def write_worker_summary(self, slot: WorkerSlot, summary: dict) -> None:
        self._write_json(f"{self.root}/workers/{slot.index}-of-{slot.count}.json",
                         {"index": slot.index, "count": slot.count, "at": _now(), "summary": summary})

    def _read_or_warn(self, path: str, fields, consequence: str) -> dict | None:
        """A record whose damage is safe to pass over: None, with a warning saying `consequence`."""
        try:
            return self._read_record(path, fields, consequence)
        except DamagedManifestFile as damaged:
            log.warning(str(damaged))
            return None

    def worker_summaries(self) -> dict[tuple[int, int], dict]:
        """(index, count) → the last summary that worker wrote."""
        found = {}
        for path in self.fs.glob(f"{self.root}/workers/*.json"):
            record = self._read_or_warn(path, WORKER_SUMMARY_FIELDS, "that worker's last speed is not shown; "
                                        "its next run writes the file anew")
            if record is not None:
                found[(record["index"], record["count"])] = record
        return found

    def shard_markers(self) -> dict[str, dict]:
        """Shard stem → its marker. A damaged marker is left out, with a warning: its shard
        counts as not done, so a run redoes it (its output is replaced by the commit) and writes
        the marker anew; nothing else depends on it."""
        markers = {}
        for path in [p for p in self.fs.find(f"{self.root}/shards") if p.endswith(".json")]:
            marker = self._read_or_warn(path, MARKER_FIELDS, "its shard counts as not done: a run redoes it and "
                                        "writes the marker anew")
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

    def remove_stale_temporaries(self, stems: list[str]) -> int:
        """Delete the half-written markers a killed attempt left for these shards (`_write_json`'s
        `NAME.json.XXXXXXXX.tmp`); call under the lock of the worker that owns the shards."""
        return remove_temporaries(self.fs, f"{self.root}/shards", MARKER_TEMPORARY, stems)

    # The locks: one live process per worker slot, and no two slot layouts at once.

    def lock_path(self, slot: WorkerSlot) -> str:
        return f"{self.root}/lock" if slot.count == 1 else f"{self.root}/lock-worker-{slot.index}-of-{slot.count}"

    def acquire_lock(self, slot: WorkerSlot = WorkerSlot(), lease_s: float = DEFAULT_LEASE_S) -> str | None:
        """Take this slot's lock with a lease of `lease_s`, renewed from a heartbeat until
        release_lock; returns a note when a stale lock was taken over (its process dead on this
        host, or its lease expired, on any host). Raises UsageError when a live run holds it, or
        when live workers of another layout (another --num-shards) write to this output."""
        for holder in self.read_locks(lease_s):
            if holder["alive"] and holder.get("count", 1) != slot.count:
                raise UsageError(f"workers of a run split {holder.get('count', 1)} way(s) are writing to this output "
                                 f"(pid {holder.get('pid')} on {holder.get('host')}); wait for them, or use the "
                                 f"same --num-shards")
        path = self.lock_path(slot)
        try:
            self.fs.makedirs(f"{self.root}/shards", exist_ok=True)
        except OSError as error:
            raise as_storage_error(error, shown_path(self.fs, f"{self.root}/shards")) or error
        store, mine = LockStore(self.fs), new_record(slot.index, slot.count, lease_s)
        who = "another run" if slot.count == 1 else f"another worker with index {slot.index} of {slot.count}"
        for attempt in range(5):
            try:
                if store.create(path, encode(mine)):
                    return self._hold(store, path, mine, None)
                current = store.read(path)
                if current is None:  # released between our two looks
                    continue
                lease = lease_of(current.record, time.time(), current.modified, lease_s)
                note = takeover_reason(current.record, lease, mine["host"], process_alive)
                if note is None:
                    raise UsageError(refusal(current.record, lease, shown_path(self.fs, path), who))
                if store.replace(path, current.content, encode(mine)):
                    return self._hold(store, path, mine, note)
                time.sleep(0.1 * 2 ** attempt)  # another taker is at it: its new lock shows once it is done
            except OSError as error:  # a storage fault: a race lost is no error (create and replace say False)
                raise as_storage_error(error, shown_path(self.fs, path)) or error
        raise UsageError(f"could not take the lock {shown_path(self.fs, path)}: other runs keep taking it; try again")

    def _hold(self, store: LockStore, path: str, record: dict, note: str | None) -> str | None:
        self._leases[path] = LeaseKeeper(store, path, record).start()
        return note

    def lock_token(self, slot: WorkerSlot = WorkerSlot()) -> str | None:
        """The token of this slot's lock while this run holds it, for the processes that commit for it."""
        keeper = self._leases.get(self.lock_path(slot))
        return keeper.record["token"] if keeper else None

    def follow_lock(self, token: str, slot: WorkerSlot = WorkerSlot()) -> None:
        """Commit under the lock another process holds with `token` (a Ray actor under its driver's,
        on any node): `check_lock_held` reads the lock file before each commit."""
        self._followed[self.lock_path(slot)] = token

    def check_lock_held(self) -> None:
        """Raises StorageError when this run lost a lock it holds or follows (taken over, or not
        renewed for longer than its lease): it must commit no more shards, another run may be writing them."""
        lost = [keeper.lost for keeper in self._leases.values()]
        for path, token in self._followed.items():
            try:
                lost.append(lost_as_read(LockStore(self.fs).read(path), token, time.time(), shown_path(self.fs, path)))
            except OSError as error:
                raise as_storage_error(error, shown_path(self.fs, path)) or error
        for reason in filter(None, lost):
            raise StorageError(f"{reason}; this run stopped before committing more shards so that two "
                               f"runs never write one output; check the storage, {RERUN}")

    def read_locks(self, lease_s: float = DEFAULT_LEASE_S) -> list[dict]:
        """Every worker's lock holder, with `alive` (False: its process on this host is dead, or
        its lease expired), the lease's age and expiry (`lease_age_s`, `lease_expires_in_s`) and,
        for an empty or truncated lock file, `unreadable`. `lease_s` is the lease of a lock that
        does not record one."""
        holders, store, now = [], LockStore(self.fs), time.time()
        for path in sorted(self.fs.glob(f"{self.root}/lock*")):
            if not LOCK_NAME.fullmatch(path.rpartition("/")[2]):
                continue
            current = store.read(path)
            if current is None:
                continue
            holder = dict(current.record) if current.record else {"unreadable": True, "path": shown_path(self.fs, path)}
            lease = lease_of(current.record, now, current.modified, lease_s)
            holder.setdefault("lease_s", lease.lease_s)
            holder["lease_age_s"] = None if lease.age_s is None else round(lease.age_s, 1)
            holder["lease_expires_in_s"] = None if lease.expires_in_s is None else round(lease.expires_in_s, 1)
            holder["alive"] = takeover_reason(current.record, lease, socket.gethostname(), process_alive) is None
            holders.append(holder)
        return holders

    def remove_dead_locks(self) -> int:
        """Remove, best effort, the locks whose process is dead on this host (a run killed after its
        last commit leaves one that no later run takes over when nothing is left to do), then the
        claim files such processes left on locks that are gone; a store that refuses (read-only)
        keeps them: they hold nothing. How many files went."""
        store, host, removed = LockStore(self.fs), socket.gethostname(), 0
        try:
            for path in sorted(self.fs.glob(f"{self.root}/lock*")):  # each lock before its claims
                if not LOCK_NAME.fullmatch(path.rpartition("/")[2]):
                    if store.obsolete_claim(path):
                        self.fs.rm(path)
                        removed += 1
                    continue
                current = store.read(path)
                record = current.record if current else None
                if record and record.get("host") == host and not process_alive(record.get("pid")):
                    removed += store.replace(path, current.content, None)
        except OSError as error:
            log.debug(f"left the dead locks of {self.root}: {type(error).__name__}: {error}")
        return removed

    def release_lock(self, slot: WorkerSlot = WorkerSlot()) -> None:
        """Stop renewing this slot's lock and remove it, if it is still this run's."""
        path = self.lock_path(slot)
        keeper = self._leases.pop(path, None)
        if keeper is None:
            return
        keeper.stop()
        try:
            keeper.store.replace(path, keeper.content, None)
        except OSError as error:  # storage that failed the run may fail this too; the next run takes it over
            log.warning(f"could not remove the lock {path}: {type(error).__name__}: {error}")


def absolute_url(url: str) -> str:
    """`url` as a process in any working directory reads it: a local path (or file:// URL) made
    absolute against this process's working directory, other URLs (s3://…, memory://…) as given."""
    if "::" in url or fsspec.utils.get_protocol(url) not in ("file", "local"):
        return url
    return LocalFileSystem._strip_protocol(url)


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


def recorded_config(config: RunConfig) -> dict:
    """The resolved config as saved beside the outputs (the same for every worker: its own
    index is left out), with no credential in it: storage options keep only harmless values,
    URLs lose their userinfo and signatures (core/redact.py). Input, output and --reuse are
    absolute URLs, so `status` and `verify` find them from any working directory (an Airflow
    task runs in a temporary one)."""
    data = config.to_dict()
    data.pop("shard_index", None)
    data["storage_options"] = recordable_options(config.source.storage_options)
    data["input"] = [redact_url(absolute_url(url)) for url in config.source.input]
    for key in ("output", "reuse"):
        data[key] = data[key] and redact_url(absolute_url(data[key]))
    return data


def run_status(output: str, storage_options: dict) -> dict:
    """Shards done, failed and pending for the run recorded in `output`, overall and per
    worker, and the output's totals (rows, errors, truncated, flagged by label, as the run's
    summary prints them), without a model: reads the manifest, the input listing (footers) and
    one listing of the output. A done marker its output does not back counts pending, as a run
    redoes it (`untrusted_shards`: why); one whose file was rewritten with the same rows counts
    done (`changed_shards`: `verify` audits it)."""
    sink_fs, output_dir = fsspec.core.url_to_fs(output, **storage_options)
    if not sink_fs.exists(f"{manifest_root(sink_fs, output_dir.rstrip('/'))}/run.json"):
        raise UsageError(f"{output} has no lengthwise run (no {MANIFEST_DIR}/run.json); check --output")
    manifest = RunManifest(sink_fs, output_dir.rstrip("/"))
    recorded = manifest.read_run()
    markers = manifest.shard_markers()
    config = recorded["config"]
    recorded_options = usable_recorded_options(config.get("storage_options", {}))
    shards = list_recorded_shards(config["input"], config, {**recorded_options, **storage_options})
    by_stem = {shard.stem: shard for shard in shards}
    listed = listed_outputs(sink_fs, output_dir.rstrip("/"))
    untrusted = untrusted_done_markers(sink_fs, shards, markers, listed)
    models = recorded["fingerprint"].get("models")  # several models: each one's status is the run's
    made_with = fingerprint_digest(recorded["fingerprint"]) if models else None  # a shard made before a change
    # of models is still to do (offline/carry.py)
    status_of = {stem: "pending" if stem in untrusted or (made_with and markers.get(stem, {}).get("fingerprint")
                                                          not in (None, made_with))
                 else markers.get(stem, {}).get("status", "pending") for stem in by_stem}
    locks = manifest.read_locks()
    complete = all(state == "done" for state in status_of.values())
    counts = _shard_counts(list(by_stem), status_of, by_stem)
    return {
        **({"models": {name: {"job": fingerprint.get("job"), "model": (config.get("models") or {}).get(name, {}).get(
            "model") or "default", "shards_done": counts["done"], "rows_done": counts["rows_done"]}
            for name, fingerprint in models.items()}} if models else {}),
        **counts, "output": output,
        # when the last shard was committed, once every shard is done: the output's last success
        "completed_at": max((markers[stem]["at"] for stem in status_of if "at" in markers[stem]), default=None)
        if complete and status_of else None,
        "job": config.get("job"), "model": config.get("model"),
        "failed_shards": [{"shard": markers[stem].get("input", stem), "error": markers[stem].get("error")}
                          for stem, state in status_of.items() if state == "failed"],
        "untrusted_shards": [{"shard": by_stem[stem].url, "reason": reason} for stem, reason in untrusted.items()],
        "changed_shards": [{"output": shown_path(sink_fs, listed[stem]["name"]), "bytes": listed[stem]["size"],
                            "recorded_bytes": markers[stem]["bytes"], "rows": by_stem[stem].num_rows}
                           for stem, state in status_of.items()
                           if state == "done" and changed_since_commit(markers[stem], listed[stem])],
        "workers": _worker_status(shards, status_of, by_stem, config.get("num_shards", 1), locks,
                                  manifest.worker_summaries()),
        "totals": output_totals(markers[stem] for stem in by_stem if stem in markers and stem not in untrusted),
        "lock": next((lock for lock in locks if lock.get("count", 1) == 1), None),
        "locks": locks,
    }


def changed_since_commit(marker: dict, found: dict) -> bool:
    """Whether a trusted output file's size is not the one its marker recorded at the commit: rewritten
    since with the same rows (recompressed, copied by a tool), which only `verify` audits."""
    return marker.get("bytes") is not None and marker["bytes"] != found["size"]


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


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
