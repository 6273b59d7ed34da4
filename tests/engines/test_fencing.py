"""Fencing, driven by hand without Ray: each attempt carries a token, the engine grants the
shard to one attempt at a time, and only the holder commits."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.offline.manifest import RunManifest
from pipeline.offline.sink import ShardSink, StaleAttempt
from pipeline.offline.source import Shard

SHARD = Shard(url="in/part-00000.parquet", stem="part-00000", num_rows=3)


def rows(tag: str) -> pa.Table:
    return pa.table({"id": ["a", "b", "c"], "value": [f"{tag}-{i}" for i in range(3)]})


def attempt(output, token: str) -> tuple[ShardSink, RunManifest]:
    sink = ShardSink(str(output), attempt=token)
    sink.create()
    return sink, RunManifest(sink.fs, sink.output_dir)


def temporaries(output) -> list[str]:
    return sorted(p.name for p in output.glob(".*.tmp"))


def test_a_stale_attempt_committing_after_the_newer_one_stands_down(tmp_path):
    output = tmp_path / "out"
    old, manifest = attempt(output, "run1.1")
    manifest.grant_attempt(SHARD.stem, "run1.1")
    old.write(0, SHARD, rows("old"))  # the first attempt writes, then goes quiet (a zombie)
    new, _ = attempt(output, "run1.2")
    manifest.grant_attempt(SHARD.stem, "run1.2")  # the engine gave up on it and hands the shard on
    new.write(0, SHARD, rows("new"))
    assert new.commit(0, manifest) == f"{output}/part-00000.parquet"
    manifest.mark(SHARD.stem, "done", attempt="run1.2")
    assert len(temporaries(output)) == 1  # the zombie's, still open

    with pytest.raises(StaleAttempt, match="attempt run1.1 stood down, the shard was handed to attempt run1.2"):
        old.commit(0, manifest)  # the zombie comes back and tries to commit
    assert pq.read_table(output / "part-00000.parquet")["value"].to_pylist() == ["new-0", "new-1", "new-2"]
    assert temporaries(output) == []  # its temporary file is gone
    marker = json.loads((output / ".lengthwise" / "shards" / "part-00000.json").read_text())
    assert (marker["status"], marker["attempt"]) == ("done", "run1.2")


def test_a_stale_attempt_committing_before_the_newer_one_stands_down_too(tmp_path):
    output = tmp_path / "out"
    old, manifest = attempt(output, "run1.1")
    manifest.grant_attempt(SHARD.stem, "run1.1")
    old.write(0, SHARD, rows("old"))
    manifest.grant_attempt(SHARD.stem, "run1.2")  # handed on while the old one was still writing
    with pytest.raises(StaleAttempt):
        old.commit(0, manifest)
    assert not (output / "part-00000.parquet").exists() and temporaries(output) == []
    new, _ = attempt(output, "run1.2")
    new.write(0, SHARD, rows("new"))
    new.commit(0, manifest)
    assert pq.read_table(output / "part-00000.parquet")["value"].to_pylist()[0] == "new-0"


def test_the_holder_commits_and_an_engine_that_grants_nothing_is_not_fenced(tmp_path):
    output = tmp_path / "out"
    holder, manifest = attempt(output, "run2.1")
    manifest.grant_attempt(SHARD.stem, "run2.1")
    holder.write(0, SHARD, rows("a"))
    holder.commit(0, manifest)
    assert manifest.attempt_holder(SHARD.stem) == "run2.1"
    other = Shard(url="in/part-00001.parquet", stem="part-00001", num_rows=3)
    local = ShardSink(str(output))  # one process: its lock fences it, no grant
    local.write(1, other, rows("b"))
    local.commit(1, manifest)
    assert sorted(p.name for p in output.glob("*.parquet")) == ["part-00000.parquet", "part-00001.parquet"]


def test_an_attempt_under_another_processes_lock_commits_only_while_that_lock_holds(tmp_path):
    """A Ray actor commits under its driver's lock, on any node, without renewing it: before each
    commit it reads the lock, and once another run took it over it commits nothing."""
    from pipeline.core.errors import StorageError
    from pipeline.offline.lock import LockStore, encode, new_record
    from pipeline.offline.source import WorkerSlot

    output = tmp_path / "out"
    driver = RunManifest(ShardSink(str(output)).fs, str(output))
    driver.acquire_lock(WorkerSlot(), 300.0)
    try:
        actor, manifest = attempt(output, "run3.1")
        manifest.follow_lock(driver.lock_token())
        manifest.grant_attempt(SHARD.stem, "run3.1")
        actor.write(0, SHARD, rows("a"))
        actor.commit(0, manifest)  # the driver's lease runs: committed
        other = Shard(url="in/part-00001.parquet", stem="part-00001", num_rows=3)
        manifest.grant_attempt(other.stem, "run3.2")
        late, _ = attempt(output, "run3.2")
        late.write(1, other, rows("b"))
        lock = output / ".lengthwise" / "lock"
        taken = {**new_record(0, 1, 300.0), "host": "driver-b", "pid": 51}  # another driver took it over
        assert LockStore(late.fs).replace(str(lock), lock.read_bytes(), encode(taken))
        with pytest.raises(StorageError, match=r"the lock .*/lock was taken over by pid 51 on driver-b; this run "
                                               r"stopped before committing more shards"):
            late.commit(1, manifest)
    finally:
        driver.release_lock()
    assert sorted(p.name for p in output.glob("*.parquet")) == ["part-00000.parquet"] and temporaries(output) == []
    assert json.loads(lock.read_text())["host"] == "driver-b"  # the old driver's release left it alone
