"""The --reuse index (offline/reuse_index.py): rows found by id and text, or by text alone, in any
previous shard; memory bounded by its bucket size, not the row count. No torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from pipeline.offline.reuse_index import (
    EDITED,
    NEW,
    OK,
    PERMANENT_ERROR,
    RETRY,
    RETRYABLE_ERROR,
    SAME,
    ReuseIndex,
    bucket_bits,
)


def hash_batch(ids, texts, status=None) -> pa.RecordBatch:
    columns = {"id_hash": pa.array(ids, pa.int64()), "text_hash": pa.array(texts, pa.int64())}
    if status is not None:
        columns["status"] = pa.array(status, pa.int8())
    return pa.RecordBatch.from_pydict(columns)


def build(shards: list[list[pa.RecordBatch]], tmp_path, bucket_rows=2) -> ReuseIndex:
    index = ReuseIndex(str(tmp_path / "index"), total_rows=sum(b.num_rows for s in shards for b in s),
                       bucket_rows=bucket_rows)
    for number, batches in enumerate(shards):
        index.add_shard(number, batches)
    index.finish()
    return index


def test_bucket_bits_keep_buckets_near_the_bound():
    assert bucket_bits(0, 100) == bucket_bits(100, 100) == 0
    assert bucket_bits(101, 100) == 1 and bucket_bits(1_000_000, 1 << 16) == 4
    assert bucket_bits(10**12, 1) == 12  # capped: at most 4,096 buckets


def test_rows_are_found_by_id_and_text_in_any_shard_and_by_text_under_another_id(tmp_path):
    big = -(1 << 62)  # keys spread over several buckets, negative ones too
    index = build([[hash_batch([1, 2, big], [10, 20, 30], [OK, OK, OK])],
                   [hash_batch([4, 5], [40, 50], [RETRYABLE_ERROR, PERMANENT_ERROR]), hash_batch([6], [60], [OK])]],
                  tmp_path)
    assert index.rows == 6
    today_ids = np.array([6, big, 1, 2, 4, 5, 7, 8, 9], np.int64)
    today_texts = np.array([60, 30, 11, 0, 40, 50, 20, 99, 10], np.int64)
    has_text = np.array([True] * 3 + [False] + [True] * 5)
    found = index.match(today_ids, today_texts, has_text)
    assert found.kind.tolist() == [SAME, SAME, EDITED, EDITED, RETRY, SAME, NEW, NEW, NEW]
    assert found.shard.tolist() == [1, 0, -1, -1, -1, 1, 0, -1, 0]
    assert found.row.tolist() == [2, 2, -1, -1, -1, 1, 1, -1, 0]  # rows count across a shard's batches
    assert found.by_text.tolist() == [False] * 6 + [True, False, True]
    assert found.reused.tolist() == [True, True, False, False, False, True, True, False, True]
    index.close()


def test_a_duplicate_id_yesterday_is_matched_by_its_text_and_an_old_hash_file_retries_its_errors(tmp_path):
    old_file = hash_batch([3, 3, 3, 8], [30, None, 31, None])  # no status column: a null text hash is an error
    index = build([[old_file]], tmp_path)
    found = index.match(np.array([3, 3, 8], np.int64), np.array([31, 30, 80], np.int64), np.ones(3, bool))
    assert found.kind.tolist() == [SAME, SAME, EDITED] and found.row.tolist() == [2, 0, -1]
    index.close()
    assert not (tmp_path / "index").exists()


def test_holds_says_whether_a_hash_file_has_an_id_at_a_row(tmp_path):
    """What proves yesterday's output still lines up with its hash file at a row copied from (an id twice
    yesterday has a record for each of its rows)."""
    index = build([[hash_batch([1, 2, 3], [10, 20, 30])], [hash_batch([3, 4, 3], [31, 40, 32])]], tmp_path)
    ids = np.array([1, 2, 3, 3, 3, 3, 4, 2, 9], np.int64)
    shards = np.array([0, 0, 0, 1, 1, 1, 1, 0, 0], np.int32)
    rows = np.array([0, 1, 2, 0, 2, 1, 1, 2, 0], np.int32)
    assert index.holds(ids, shards, rows).tolist() == [True, True, True, True, True, False, True, False, False]
    assert index.holds(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32)).tolist() == []
    index.close()


HELD_INDEX = """
import sys, time
from pipeline.offline.reuse_index import ReuseIndex
index = ReuseIndex()
print(index.folder, flush=True)
time.sleep(120)
"""


def start_holder(temporary_dir) -> tuple[subprocess.Popen, str]:
    """A real process that builds an index in `temporary_dir` and holds it."""
    import os

    process = subprocess.Popen([sys.executable, "-c", HELD_INDEX], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "TMPDIR": str(temporary_dir)})
    return process, process.stdout.readline().strip()


def test_the_index_a_killed_run_left_is_removed_by_the_next_and_a_live_ones_is_kept(tmp_path, monkeypatch, caplog):
    import logging
    import os
    import signal
    import tempfile
    import time

    temporary_dir = tmp_path / "tmp"
    temporary_dir.mkdir()
    killed, killed_folder = start_holder(temporary_dir)
    live, live_folder = start_holder(temporary_dir)
    try:
        (Path(killed_folder) / "by-id" / "0000.keys").write_bytes(b"\0" * 4096)  # what it had written so far
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        old, young = temporary_dir / "lengthwise-reuse-old1234", temporary_dir / "lengthwise-reuse-new1234"
        for unleased in (old, young):  # an older lengthwise's folders: no lease, judged by age
            (unleased / "by-id").mkdir(parents=True)
        os.utime(old, (time.time() - 30 * 24 * 3600,) * 2)  # a month old; the young one just made
        (temporary_dir / "lengthwise-reuse-a-file").write_text("not a folder: left alone")

        monkeypatch.setattr(tempfile, "tempdir", str(temporary_dir))
        with caplog.at_level(logging.INFO, logger="pipeline"):
            index = ReuseIndex()
        assert Path(index.folder).name.startswith(f"lengthwise-reuse-{os.getpid()}-")
        assert sorted(p.name for p in temporary_dir.iterdir()) == sorted(
            [Path(live_folder).name, Path(index.folder).name, young.name, "lengthwise-reuse-a-file"])
        assert f"--reuse: removed 2 index folder(s) killed runs left in {temporary_dir} (4 KiB)" in caplog.text
        second = ReuseIndex()  # one of this process's own is live too
        assert Path(index.folder).exists() and Path(second.folder).exists()
        index.close()
        second.close()
        assert not Path(index.folder).exists()
    finally:
        live.kill()
        live.wait()
    ReuseIndex().close()
    assert sorted(p.name for p in temporary_dir.iterdir()) == sorted([young.name, "lengthwise-reuse-a-file"])


MILLION_ROWS_LOOKUP = """
import sys, tracemalloc
import numpy as np, pyarrow as pa
from pipeline.offline.reuse_index import ReuseIndex
rows, shards, bucket_rows = 1_000_000, 10, 1 << 16
rng = np.random.default_rng(0)
ids = rng.integers(-2**63, 2**63 - 1, rows, dtype=np.int64)
texts = rng.integers(-2**63, 2**63 - 1, rows, dtype=np.int64)
warm = ReuseIndex(sys.argv[1] + "-warm")  # imports (pyarrow.compute, numpy's lazy parts) are not the index
warm.add_shard(0, [pa.RecordBatch.from_pydict({"id_hash": pa.array([1]), "text_hash": pa.array([None], pa.int64())})])
warm.finish()
warm.match(np.array([1]), np.array([2]), np.ones(1, bool))
warm.close()
tracemalloc.start()
index = ReuseIndex(sys.argv[1], total_rows=rows, bucket_rows=bucket_rows)
per_shard = rows // shards
for shard in range(shards):
    part = slice(shard * per_shard, (shard + 1) * per_shard)
    batches = (pa.RecordBatch.from_arrays([pa.array(ids[part][s:s + 65536]), pa.array(texts[part][s:s + 65536]),
               pa.array(np.zeros(len(ids[part][s:s + 65536]), np.int8))], ["id_hash", "text_hash", "status"])
               for s in range(0, per_shard, 65536))
    index.add_shard(shard, batches)
index.finish()
build_peak = tracemalloc.get_traced_memory()[1]
queries = rng.permutation(rows)[:10_000].copy()  # a window of tonight's rows, in another order
tracemalloc.reset_peak()
before = tracemalloc.get_traced_memory()[0]
found = index.match(ids[queries], texts[queries], np.ones(len(queries), bool))
lookup_peak = tracemalloc.get_traced_memory()[1] - before
assert (found.shard * per_shard + found.row == queries).all(), "every row found at its shard and row"
print(build_peak, lookup_peak)
"""


@pytest.mark.slow
def test_the_index_of_a_million_rows_stays_within_its_memory_bound(tmp_path):
    """1M rows in 10 shards, buckets of 64Ki rows: building holds one hash batch or one bucket at a time and a
    lookup of a 10,000-row window only what it touches; the rows' own records are 25 MB by id alone."""
    result = subprocess.run([sys.executable, "-c", MILLION_ROWS_LOOKUP, str(tmp_path / "index")], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    build_peak, lookup_peak = map(int, result.stdout.split())
    assert build_peak < 12_000_000, f"building held {build_peak:,} bytes"
    assert lookup_peak < 2_000_000, f"a lookup held {lookup_peak:,} bytes"
    on_disk = sum(p.stat().st_size for p in (tmp_path / "index").rglob("*") if p.is_file())
    assert on_disk == 1_000_000 * (25 + 16)  # the bytes a row the docs state
