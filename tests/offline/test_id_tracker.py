"""The duplicate-id count holds memory bounded whatever the rows: a run's id hashes are spilled,
not kept (10M rows would hold 80 MB and sort a copy), and the count is the same."""

import glob
import os
import subprocess
import sys
import tempfile
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.row_hashes import id_hash
from pipeline.offline.summary import SPILL_PREFIX, IdTracker, remove_orphaned_spills


def add_in_shards(tracker: IdTracker, hashes: np.ndarray, shard_rows: int = 10_000) -> None:
    for start in range(0, len(hashes), shard_rows):
        tracker.add_hashes(hashes[start:start + shard_rows])


def test_memory_stays_bounded_as_rows_grow(monkeypatch):
    """1M hashes (8 MB) through a tracker that buffers 64k: its peak allocation stays near the
    buffer's, not the rows' (the tracker that kept every hash peaked above 8 MB)."""
    monkeypatch.setattr(IdTracker, "BUFFERED_HASHES", 1 << 16)
    hashes = np.random.default_rng(0).integers(-2**63, 2**63 - 1, 1_000_000, dtype=np.int64)
    hashes[500_000:500_010] = hashes[:10]  # 10 rows repeat an earlier id
    tracker = IdTracker()
    tracemalloc.start()
    try:
        add_in_shards(tracker, hashes)
        count, _ = tracker.duplicates(None, [])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 10
    assert peak < 3 * 2**20  # the buffer (0.5 MB) and its sorted copy, a part's counts; not 8 MB


def test_spilled_count_and_examples_equal_the_in_memory_ones(monkeypatch, tmp_path):
    ids = [f"r{i}" for i in range(5_000)] + ["r7", "r7", "r42", "r4999"]
    pq.write_table(pa.table({"id": ids}), tmp_path / "part-0.parquet")
    hashes = np.array([id_hash(value) for value in ids], np.int64)
    in_memory = IdTracker()
    add_in_shards(in_memory, hashes, 1_000)
    expected = in_memory.duplicates(None, [str(tmp_path / "part-0.parquet")])
    monkeypatch.setattr(IdTracker, "BUFFERED_HASHES", 1_000)
    spilled = IdTracker()
    add_in_shards(spilled, hashes, 1_000)
    assert spilled._spill is not None  # it did spill
    folder = spilled._spill.name
    assert spilled.duplicates(None, [str(tmp_path / "part-0.parquet")]) == expected == (4, ["r7", "r42", "r4999"])
    assert not glob.glob(folder) and not glob.glob(f"{tempfile.gettempdir()}/{folder.rsplit('/', 1)[-1]}")


def test_hashes_returns_every_hash_added_and_removes_the_spill(monkeypatch):
    monkeypatch.setattr(IdTracker, "BUFFERED_HASHES", 100)
    hashes = np.random.default_rng(1).integers(-2**63, 2**63 - 1, 1_050, dtype=np.int64)
    tracker = IdTracker()
    add_in_shards(tracker, hashes, 70)
    folder = tracker._spill.name
    assert sorted(tracker.hashes().tolist()) == sorted(hashes.tolist())
    assert not glob.glob(folder)


def test_a_spill_of_a_killed_run_is_removed_by_the_next_spill_and_a_live_ones_stays(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"{SPILL_PREFIX}{gone.stdout.strip()}-abc"
    live = tmp_path / f"{SPILL_PREFIX}{os.getpid()}-def"
    other = tmp_path / "lengthwise-other"
    for folder in (orphan, live, other):
        folder.mkdir()
        (folder / "part-00").write_bytes(b"x")
    assert remove_orphaned_spills(str(tmp_path)) == [str(orphan)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])
