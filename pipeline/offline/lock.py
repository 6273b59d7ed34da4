"""The output's lock files: an exclusive create on every store that has one, a lease the holder
renews from a heartbeat thread, and a takeover that exactly one of two takers wins.

A lock record is `{"host", "pid", "since", "renewed", "lease_s", "index", "count", "token"}`. Its
holder rewrites `renewed` every fifth of the lease; a lock not renewed for longer than its lease
is taken over on any host (its holder was OOM-killed, or lost with its node). Every change to an
existing lock file (a renewal, a takeover, the release) goes through `LockStore.replace`: the
changer first creates a claim file named after the content it read, exclusively, then checks the
lock still holds that content, then writes. Two changers of one content cannot both hold its
claim, so exactly one of them changes it; the other finds it changed and looks again. A claim is
passed over once its changer is dead on this host, or CLAIM_STALE_S after it was made elsewhere."""

from __future__ import annotations

import datetime
import hashlib
import inspect
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import fsspec
from fsspec.implementations.local import LocalFileSystem

from pipeline.core.retry import retry_transient

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 300.0  # a lock not renewed for this long is taken over from any host
RENEWALS_PER_LEASE = 5  # renewed every fifth of the lease: four renewals in a row may fail before it lapses
SETTLE_S = 2.0  # a store without a conditional create: how long a write is given to show before it is read back
CLAIM_STALE_S = 120.0  # a claim file this old was left by a changer that died mid-change: the next claim is taken
CONDITIONAL_PROTOCOLS = {"s3", "s3a", "gs", "gcs"}  # s3fs (If-None-Match: *) and gcsfs (ifGenerationMatch=0)
LOCK_NAME = re.compile(r"lock(-worker-\d+-of-\d+)?")  # `lock`, `lock-worker-I-of-N`; not their claim files
CLAIM_PATH = re.compile(r"(?P<lock>.+)\.claim-(?P<digest>[0-9a-f]{16})-\d+")  # LOCK.claim-DIGEST-GENERATION


# ── lease arithmetic (pure) ─────────────────────────────────────────────────────────────────────

@dataclass(frozen=True)
class Lease:
    """A lock's lease as seen now: seconds since its last renewal (None: unknown) and its length."""

    lease_s: float
    age_s: float | None

    @property
    def expired(self) -> bool:
        return self.age_s is not None and self.age_s > self.lease_s

    @property
    def expires_in_s(self) -> float | None:
        return None if self.age_s is None else self.lease_s - self.age_s


def parse_time(text) -> float | None:
    """Seconds since the epoch of an ISO time; None for a missing or unreadable one."""
    try:
        moment = datetime.datetime.fromisoformat(str(text))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp()


def lease_of(record: dict | None, now: float, modified: float | None, default_lease_s: float) -> Lease:
    """The lease of `record` at `now`: counted from its `renewed` time (else `since`), and where the
    record has no readable time (an empty or truncated file, a lock of an older version) from the
    file's modified time. A record without `lease_s` has the default lease. A renewal stamped in
    the future (a clock ahead of ours) counts as just renewed."""
    record = record or {}
    lease_s = float(record.get("lease_s") or default_lease_s)
    renewed = parse_time(record.get("renewed")) or parse_time(record.get("since")) or modified
    return Lease(lease_s, None if renewed is None else max(0.0, now - renewed))


def takeover_reason(record: dict | None, lease: Lease, this_host: str,
                    process_alive: Callable[[object], bool]) -> str | None:
    """Why the lock holding `record` (None: unreadable) may be taken over, for the warning; None
    when its holder must be taken for alive. On this host the process decides (a dead pid is taken
    over at once, a live one never); elsewhere the lease does."""
    if record is None:
        if lease.expired:
            return (f"took over an unreadable lock file (empty or truncated), last written {lease.age_s:.0f}s ago, "
                    f"longer ago than the lease of {lease.lease_s:.0f}s")
        return None
    who = f"process {record.get('pid')} on {record.get('host')} (since {record.get('since')})"
    if record.get("host") == this_host:
        alive = process_alive(record.get("pid"))
        return None if alive else f"took over a stale lock of {who}, which is no longer running"
    if lease.expired:
        return (f"took over the lock of {who}: its lease of {lease.lease_s:.0f}s expired, it was last renewed "
                f"{lease.age_s:.0f}s ago")
    return None


def lost_as_read(lock: LockFile | None, token: str, now: float, path: str) -> str | None:
    """Why the run whose lock carries `token` no longer holds it, as a process that commits for that
    run without renewing its lock reads the lock file (a Ray actor, on any node, for its driver): the
    lock is gone, another run took it over, or it was not renewed for longer than its lease (its
    driver is dead or cut off, and any run may take it over now). None while the lease runs."""
    if lock is None:
        return f"the lock {path} was removed"
    record = lock.record
    if record is None or record.get("token") != token:
        holder = f"pid {record.get('pid')} on {record.get('host')}" if record else "an unreadable lock"
        return f"the lock {path} was taken over by {holder}"
    lease = lease_of(record, now, lock.modified, DEFAULT_LEASE_S)
    if lease.expired:
        return (f"the lock {path} was last renewed {lease.age_s:.0f}s ago, longer ago than its lease of "
                f"{lease.lease_s:.0f}s, so another run may have taken it over")
    return None


def refusal(record: dict | None, lease: Lease, path: str, who: str) -> str:
    """The one line that refuses a lock held by a live holder (or an unreadable one not yet old)."""
    if record is None:
        return (f"the lock {path} is unreadable (empty or truncated) and was written {lease.age_s or 0:.0f}s ago; "
                f"it is taken over once it is older than the lease ({lease.lease_s:.0f}s), or delete it if no "
                f"run is writing to this output")
    holder = (f"{who} (pid {record.get('pid')} on {record.get('host')}, since {record.get('since')}) is writing "
              f"to this output")
    if record.get("host") == socket.gethostname() or lease.expires_in_s is None:
        return f"{holder}; wait for it, or delete {path} if that process is gone"
    return (f"{holder}; its lease was renewed {lease.age_s:.0f}s ago and expires in {lease.expires_in_s:.0f}s "
            f"unless renewed (then a rerun takes the lock over); wait for it, or delete {path} if that run is gone")


def process_alive(pid) -> bool:
    """Whether process `pid` runs on this host (one of another user counts as running)."""
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


def dead_here(content: bytes) -> bool:
    """Whether a claim file's changer (`HOST PID TIME`) was a process on this host that is gone."""
    host, _, rest = content.decode(errors="replace").partition(" ")
    return host == socket.gethostname() and not process_alive(rest.partition(" ")[0])


def new_record(index: int, count: int, lease_s: float) -> dict:
    now = _now()
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": now, "renewed": now, "lease_s": lease_s,
            "index": index, "count": count, "token": uuid.uuid4().hex}


def encode(record: dict) -> bytes:
    return (json.dumps(record) + "\n").encode()


def decode(content: bytes) -> dict | None:
    """The record of a lock file's bytes; None for an empty, truncated or otherwise unreadable one."""
    try:
        record = json.loads(content)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


# ── the store ───────────────────────────────────────────────────────────────────────────────────

@dataclass(frozen=True)
class LockFile:
    content: bytes
    record: dict | None  # None: empty or truncated
    modified: float | None  # the file's modified time, read only when the record has no time of its own


def create_kind(fs: fsspec.AbstractFileSystem) -> str:
    """How `fs` creates a file only if it is absent: `local` (a hard link, atomic), `conditional`
    (the store's own precondition: S3 If-None-Match, GCS ifGenerationMatch=0) or `settle` (no
    such operation: look, write, wait, read back; exclusive only if writes show within SETTLE_S)."""
    if isinstance(fs, LocalFileSystem):
        return "local"
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    pipe = getattr(type(fs), "_pipe_file", None)
    if protocols & CONDITIONAL_PROTOCOLS and pipe is not None and "mode" in inspect.signature(pipe).parameters:
        return "conditional"
    return "settle"


class LockStore:
    """Lock files on one filesystem: read, create exclusively, change race-safely, remove."""

    def __init__(self, fs: fsspec.AbstractFileSystem, settle_s: float = SETTLE_S):
        self.fs, self.kind, self.settle_s = fs, create_kind(fs), settle_s

    def read(self, path: str) -> LockFile | None:
        try:
            content = retry_transient(lambda: self.fs.cat_file(path), f"reading {path}", log=log.warning)
        except FileNotFoundError:
            return None
        record = decode(content)
        has_time = record is not None and (parse_time(record.get("renewed")) or parse_time(record.get("since")))
        return LockFile(content, record, None if has_time else self.modified(path))

    def modified(self, path: str) -> float | None:
        try:
            self.fs.invalidate_cache(path)
            return self.fs.modified(path).timestamp()
        except (OSError, NotImplementedError):  # gone meanwhile, or a store that keeps no times
            return None

    def create(self, path: str, content: bytes) -> bool:
        """Write `path` only if it does not exist; False when it does. A retried create that finds
        the file holding its own content (the first try landed) counts as created."""
        try:
            if self.kind == "local":
                return self._link_new(path, content)
            if self.kind == "conditional":
                retry_transient(lambda: self.fs.pipe_file(path, content, mode="create"), f"creating {path}",
                                log=log.warning)
                return True
            return self._settle_create(path, content)
        except OSError as error:
            if not _already_exists(error):
                raise
        current = self.read(path)
        return current is not None and current.content == content

    def _link_new(self, path: str, content: bytes) -> bool:
        """Written in full under a temporary name, then hard-linked to `path` (which fails if it
        exists): no reader ever sees a half-written lock."""
        temp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
        with open(temp, "wb") as f:
            f.write(content)
        try:
            os.link(temp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(temp)

    def _settle_create(self, path: str, content: bytes) -> bool:
        if self.fs.exists(path):
            return False
        self.fs.pipe_file(path, content)
        time.sleep(self.settle_s)  # a rival's write that overtook ours shows by then
        current = self.read(path)
        return current is not None and current.content == content

    def replace(self, path: str, expected: bytes, content: bytes | None) -> bool:
        """Change `path` from `expected` to `content` (None: remove it); False when it no longer
        holds `expected` or another changer is at it. Race-safe wherever `create` is exclusive."""
        claim = self._claim(path, expected)
        if claim is None:
            return False
        try:
            current = self.read(path)
            if current is None or current.content != expected:
                return False
            if content is None:
                self.fs.rm(path)
            elif self.kind == "local":  # readers see the old lock or the new one, never half of one
                temp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
                with open(temp, "wb") as f:
                    f.write(content)
                os.replace(temp, path)
            else:
                retry_transient(lambda: self.fs.pipe_file(path, content), f"writing {path}", log=log.warning)
            return True
        finally:
            try:
                self.fs.rm(claim)
            except OSError as error:  # a claim left behind goes stale; it blocks nothing for long
                log.debug(f"could not remove the claim {claim}: {type(error).__name__}: {error}")

    def _claim(self, path: str, expected: bytes) -> str | None:
        """The claim file to change `path` from `expected`, created exclusively; None when another
        changer holds it. A claim older than CLAIM_STALE_S (its changer died) is passed over."""
        digest = content_digest(expected)
        for generation in range(8):
            claim = f"{path}.claim-{digest}-{generation}"
            if self.create(claim, f"{socket.gethostname()} {os.getpid()} {_now()}\n".encode()):
                return claim
            modified = self.modified(claim)
            if modified is not None and time.time() - modified < CLAIM_STALE_S and not self._dead_changer(claim):
                return None
        return None

    def obsolete_claim(self, path: str) -> bool:
        """Whether `path` is a claim file whose changer died on this host and whose lock no longer
        holds the content it claimed: nobody can use it, removing it changes nothing."""
        match = CLAIM_PATH.fullmatch(path)
        if match is None or not self._dead_changer(path):
            return False
        lock = self.read(match["lock"])
        return lock is None or content_digest(lock.content) != match["digest"]

    def _dead_changer(self, claim: str) -> bool:
        """A claim whose changer died on this host (killed mid-change) is passed over at once."""
        try:
            return dead_here(self.fs.cat_file(claim))
        except FileNotFoundError:  # its changer finished meanwhile: look at the lock again
            return False


def content_digest(content: bytes) -> str:
    return hashlib.blake2b(content, digest_size=8).hexdigest()


def _already_exists(error: OSError) -> bool:
    """A conditional create refused because the file exists (s3fs raises FileExistsError, or an
    EINVAL OSError for a 412 PreconditionFailed without its condition named), or because another
    conditional write of it is in flight (S3's 409 ConditionalRequestConflict): a race lost, not
    a storage fault; the caller looks at what is there."""
    text = str(error)
    return isinstance(error, FileExistsError) or any(
        marker in text for marker in ("PreconditionFailed", "pre-conditions", "ConditionalRequestConflict"))


# ── the heartbeat ───────────────────────────────────────────────────────────────────────────────

class LeaseKeeper:
    """Renews a held lock every fifth of its lease from a daemon thread. A renewal that fails is
    logged; `lost` says why the lock is no longer this run's: another run took it over, or it
    could not be renewed for longer than its lease (another run may have taken it over since)."""

    def __init__(self, store: LockStore, path: str, record: dict):
        self.store, self.path, self.record = store, path, record
        self.content = encode(record)
        self.lease_s = float(record["lease_s"])
        self.renewed_at = time.monotonic()
        self.taken_by: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease {path}", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    @property
    def lost(self) -> str | None:
        if self.taken_by:
            return self.taken_by
        unrenewed_s = time.monotonic() - self.renewed_at
        if unrenewed_s > self.lease_s:
            return (f"the lock {self.path} could not be renewed for {unrenewed_s:.0f}s, longer than its lease of "
                    f"{self.lease_s:.0f}s, so another run may have taken it over")
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.lease_s / RENEWALS_PER_LEASE):
            self.renew()
            if self.taken_by:
                return

    def renew(self) -> None:
        record = {**self.record, "renewed": _now()}
        try:
            if self.store.replace(self.path, self.content, encode(record)):
                self.record, self.content, self.renewed_at = record, encode(record), time.monotonic()
                return
            current = self.store.read(self.path)
        except Exception as error:  # the next renewal may succeed; `lost` tells when it is too late
            log.warning(f"could not renew the lock {self.path}: {type(error).__name__}: {error}")
            return
        if current is None or current.content != self.content:
            holder = current.record if current and current.record else {}
            self.taken_by = (f"the lock {self.path} was taken over by pid {holder.get('pid')} on "
                             f"{holder.get('host')}" if holder else f"the lock {self.path} was removed")
            log.error(f"{self.taken_by}; this run commits no more shards")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
