"""The index `--reuse` finds yesterday's rows by, whatever today's shard names: (id hash, text
hash) → (previous shard, row), and text hash → (previous shard, row) for a text seen under another id.

Sorted runs on local disk, never a dict of every row. The keys are split by their top bits into
buckets of at most `bucket_rows` rows; each bucket is a sorted array of keys and one of records
(raw files, memory-mapped), so a lookup is `np.searchsorted` over the pages it touches. Building
holds one hash-file batch, then one bucket, at a time: memory follows `bucket_rows`, not the table.
On disk: 25 bytes a row by id (8 key, 8 text hash, 4 shard, 4 row, 1 status) and 16 by text (8 key,
4 shard, 4 row), so 41 bytes a row; 100M rows take 4.1 GB of local temporary disk.

The folder (`$TMPDIR/lengthwise-reuse-PID-XXXXXXXX`) is leased: its `owner.lock` is locked (flock) by the
process that built it while the index lives, and the kernel drops the lock when that process dies, even by
SIGKILL. Each new index first removes the folders whose lease is free: those killed runs left behind.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable

import numpy as np
import pyarrow as pa

from pipeline.core.units import format_bytes

ID_RECORD = np.dtype([("text_hash", "<i8"), ("shard", "<i4"), ("row", "<i4"), ("status", "i1")])
TEXT_RECORD = np.dtype([("shard", "<i4"), ("row", "<i4")])
OK, PERMANENT_ERROR, RETRYABLE_ERROR = 0, 1, 2  # a previous row's status: reused, reused (its error), computed
BUCKET_ROWS = 1 << 20  # rows a bucket holds at most: ~41 MB while it is sorted
MAX_BUCKET_BITS = 12
HASH_BATCH_ROWS = 1 << 16
INDEX_PREFIX = "lengthwise-reuse-"
LEASE_FILE = "owner.lock"
# a folder without a lease (an older lengthwise's, or one killed in the instant before it took its lease) is
# removed once older than this; no index lives without its lease longer than that instant
UNLEASED_AGE_S = 24 * 3600

log = logging.getLogger(__name__)


def bucket_bits(total_rows: int, bucket_rows: int) -> int:
    """The top bits of a key that pick its bucket: enough that a bucket holds about `bucket_rows` rows."""
    bits = 0
    while (total_rows >> bits) > bucket_rows and bits < MAX_BUCKET_BITS:
        bits += 1
    return bits


def bucket_of(keys: np.ndarray, bits: int) -> np.ndarray:
    if bits == 0:
        return np.zeros(len(keys), np.int64)
    return (keys.view(np.uint64) >> np.uint64(64 - bits)).astype(np.int64)


class SortedRuns:
    """Keys (int64) with one record each, bucketed by the keys' top bits, each bucket sorted."""

    def __init__(self, folder: str, record: np.dtype, bits: int):
        self.folder, self.record, self.bits = folder, record, bits
        os.makedirs(folder, exist_ok=True)
        self._maps: dict[int, tuple[np.ndarray, np.ndarray] | None] = {}
        self.rows = 0

    def _paths(self, bucket: int) -> tuple[str, str]:
        return f"{self.folder}/{bucket:04d}.keys", f"{self.folder}/{bucket:04d}.records"

    def append(self, keys: np.ndarray, records: np.ndarray) -> None:
        """Add unsorted rows (call `finish` once all are in)."""
        buckets = bucket_of(keys, self.bits)
        order = np.argsort(buckets, kind="stable")
        buckets, keys, records = buckets[order], keys[order], records[order]
        starts = np.flatnonzero(np.r_[True, buckets[1:] != buckets[:-1]]) if len(buckets) else []
        for start, end in zip(starts, [*starts[1:], len(buckets)]):
            key_path, record_path = self._paths(int(buckets[start]))
            with open(key_path, "ab") as f:
                f.write(keys[start:end].tobytes())
            with open(record_path, "ab") as f:
                f.write(records[start:end].tobytes())
        self.rows += len(keys)

    def finish(self, tie_break: str | None = None) -> None:
        """Sort each bucket by key (then by `tie_break`, a record field), one bucket in memory at a time."""
        for bucket in range(1 << self.bits):
            key_path, record_path = self._paths(bucket)
            if not os.path.exists(key_path):
                continue
            keys = np.fromfile(key_path, np.int64)
            records = np.fromfile(record_path, self.record)
            order = np.lexsort((records[tie_break], keys)) if tie_break else np.argsort(keys, kind="stable")
            keys[order].tofile(key_path)
            records[order].tofile(record_path)
            del keys, records, order

    def _bucket(self, bucket: int) -> tuple[np.ndarray, np.ndarray] | None:
        if bucket not in self._maps:
            key_path, record_path = self._paths(bucket)
            self._maps[bucket] = ((np.memmap(key_path, np.int64, "r"), np.memmap(record_path, self.record, "r"))
                                  if os.path.exists(key_path) and os.path.getsize(key_path) else None)
        return self._maps[bucket]

    def ranges(self, keys: np.ndarray) -> Iterable[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Per bucket the queries touch: (query positions, first match, end of matches, the bucket's records)."""
        buckets = bucket_of(keys, self.bits)
        for bucket in np.unique(buckets).tolist():
            found = self._bucket(bucket)
            if found is None:
                continue
            sorted_keys, records = found
            positions = np.flatnonzero(buckets == bucket)
            queries = keys[positions]
            yield (positions, np.searchsorted(sorted_keys, queries, "left"),
                   np.searchsorted(sorted_keys, queries, "right"), records)

    def close(self) -> None:
        self._maps.clear()


def take_lease(folder: str) -> int:
    """Lock `folder`'s lease for this process (the descriptor holds it); locked before it takes its name,
    so that no other process ever sees this folder with a free lease while this one lives."""
    temporary = f"{folder}/{LEASE_FILE}.{os.getpid()}.tmp"
    descriptor = os.open(temporary, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(descriptor, f"pid {os.getpid()}\n".encode())
    os.rename(temporary, f"{folder}/{LEASE_FILE}")
    return descriptor


def lease_is_free(folder: str) -> bool | None:
    """Whether the process that leased `folder` is gone; None where it has no lease."""
    try:
        descriptor = os.open(f"{folder}/{LEASE_FILE}", os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(descriptor)
    return True


def is_abandoned(folder: str, now: float) -> bool:
    """An index folder a killed run left: its lease is free, or it has none and is older than UNLEASED_AGE_S."""
    free = lease_is_free(folder)
    return free if free is not None else now - os.path.getmtime(folder) > UNLEASED_AGE_S


def remove_abandoned_indexes(temporary_dir: str) -> tuple[int, int]:
    """Delete the index folders killed runs left in `temporary_dir` (another user's are not ours to
    check); how many went, and their bytes."""
    removed = removed_bytes = 0
    now = time.time()
    for entry in os.scandir(temporary_dir):
        if not entry.name.startswith(INDEX_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if not is_abandoned(entry.path, now):
                continue
            size = sum(os.path.getsize(os.path.join(top, name)) for top, _, names in os.walk(entry.path)
                       for name in names)
        except OSError:  # another user's folder, or one removed meanwhile
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed, removed_bytes = removed + 1, removed_bytes + size
    return removed, removed_bytes


def leased_index_folder() -> tuple[str, int]:
    """A new index folder in the temporary folder, leased (the lease's descriptor), once those killed runs
    left are gone."""
    temporary_dir = tempfile.gettempdir()
    removed, removed_bytes = remove_abandoned_indexes(temporary_dir)
    if removed:
        log.info(f"--reuse: removed {removed} index folder(s) killed runs left in {temporary_dir} "
                 f"({format_bytes(removed_bytes)})")
    folder = tempfile.mkdtemp(prefix=f"{INDEX_PREFIX}{os.getpid()}-")
    return folder, take_lease(folder)


class ReuseIndex:
    """Yesterday's rows by (id hash, text hash) and by text hash, with the previous shard each is in;
    by default in a leased temporary folder (see the module's docstring)."""

    def __init__(self, folder: str | None = None, total_rows: int = 0, bucket_rows: int = BUCKET_ROWS):
        self.folder, self._lease = (folder, None) if folder else leased_index_folder()
        bits = bucket_bits(total_rows, bucket_rows)
        self.by_id = SortedRuns(f"{self.folder}/by-id", ID_RECORD, bits)
        self.by_text = SortedRuns(f"{self.folder}/by-text", TEXT_RECORD, bits)

    def add_shard(self, shard: int, hashes: Iterable[pa.RecordBatch]) -> None:
        """One previous shard's hash file, batch by batch (`id_hash`, `text_hash`, and `status` where the
        file has one: a file of an older version marks an error by a null text hash, retried)."""
        row = 0
        for batch in hashes:
            ids = batch.column("id_hash").to_numpy()
            text = batch.column("text_hash")
            status = (batch.column("status").to_numpy() if "status" in batch.schema.names
                      else np.where(text.is_null().to_numpy(zero_copy_only=False), RETRYABLE_ERROR, OK))
            records = np.zeros(len(ids), ID_RECORD)
            records["text_hash"] = text.fill_null(0).to_numpy()
            records["shard"], records["row"] = shard, np.arange(row, row + len(ids))
            records["status"] = status
            self.by_id.append(ids, records)
            ok = (records["status"] == OK) & text.is_valid().to_numpy(zero_copy_only=False)
            self.by_text.append(records["text_hash"][ok], records[["shard", "row"]][ok].astype(TEXT_RECORD))
            row += len(ids)

    def finish(self) -> None:
        self.by_id.finish(tie_break="text_hash")
        self.by_text.finish()

    @property
    def rows(self) -> int:
        return self.by_id.rows

    def match(self, id_hashes: np.ndarray, text_hashes: np.ndarray, has_text: np.ndarray) -> RowMatches:
        """Each row's previous (shard, row) and how it was found; see RowMatches."""
        rows = len(id_hashes)
        matches = RowMatches(np.full(rows, -1, np.int32), np.full(rows, -1, np.int32), np.zeros(rows, np.int8))
        for positions, first, end, records in self.by_id.ranges(id_hashes):
            has_id = end > first
            matches.kind[positions[has_id]] = EDITED
            found = np.where(has_id, first, 0)  # the first record of the id (sorted by text hash within it)
            for index in np.flatnonzero(end - first > 1).tolist():  # the id more than once yesterday: find the text
                same = np.flatnonzero(records["text_hash"][first[index]:end[index]] == text_hashes[positions[index]])
                found[index] = first[index] + (same[0] if len(same) else 0)
            candidates = records[found]
            same = has_id & (candidates["text_hash"] == text_hashes[positions]) & has_text[positions]
            retry = same & (candidates["status"] == RETRYABLE_ERROR)
            matches.kind[positions[retry]] = RETRY
            reused = same & ~retry
            matches.kind[positions[reused]] = SAME
            matches.shard[positions[reused]] = candidates["shard"][reused]
            matches.row[positions[reused]] = candidates["row"][reused]
        unmatched = np.flatnonzero(np.isin(matches.kind, (NEW, EDITED)) & has_text)
        for positions, first, end, records in self.by_text.ranges(text_hashes[unmatched]):
            hit = end > first
            targets = unmatched[positions[hit]]
            matches.shard[targets] = records["shard"][first[hit]]
            matches.row[targets] = records["row"][first[hit]]
            matches.by_text[targets] = True
        return matches

    def holds(self, id_hashes: np.ndarray, shards: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Per row: whether the hash file of previous shard `shards` has `id_hashes` at row `rows`. Read with
        the ids of the output rows a block copies from, it proves the output still lines up with its hashes."""
        held = np.zeros(len(id_hashes), bool)
        for positions, first, end, records in self.by_id.ranges(id_hashes):
            for offset in range(int((end - first).max(initial=0))):  # an id yesterday had n times: n records
                candidates = records[np.minimum(first + offset, len(records) - 1)]
                here = ((first + offset < end) & (candidates["shard"] == shards[positions])
                        & (candidates["row"] == rows[positions]))
                held[positions[here]] = True
        return held

    def close(self) -> None:
        self.by_id.close()
        self.by_text.close()
        shutil.rmtree(self.folder, ignore_errors=True)
        if self._lease is not None:  # released only once the folder is gone
            os.close(self._lease)
            self._lease = None


# a row's id is not in the index; it is, with another text; both; an error; found, in a previous shard whose
# results could not be proven theirs (set by reuse.py: the shard is skipped)
NEW, EDITED, SAME, RETRY, SKIPPED = 0, 1, 2, 3, 4


class RowMatches:
    """Per row of a block: the previous shard and row whose result it takes (-1: none), `kind` (NEW,
    EDITED, SAME, RETRY: the same id and text had an error that may change on a retry, SKIPPED), and
    `by_text`: taken from a row with the same text under another id."""

    def __init__(self, shard: np.ndarray, row: np.ndarray, kind: np.ndarray):
        self.shard, self.row, self.kind = shard, row, kind
        self.by_text = np.zeros(len(kind), bool)

    @property
    def reused(self) -> np.ndarray:
        return (self.kind == SAME) | self.by_text

    def skip(self, rows: np.ndarray) -> None:
        """These rows' previous shard is skipped: they are computed."""
        self.kind[rows], self.by_text[rows] = SKIPPED, False
