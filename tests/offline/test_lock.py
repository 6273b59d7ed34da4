"""The output's lock: lease arithmetic, takeover of expired and unreadable locks, the heartbeat,
and two real processes racing for one lock many times, on a local disk and on a moto S3 server."""

import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import time

import fsspec
import pytest
from click.testing import CliRunner

from pipeline.core.errors import StorageError, UsageError
from pipeline.offline.lock import (Lease, LeaseKeeper, LockFile, LockStore, content_digest, create_kind, encode,
                                   lease_of, lost_as_read, new_record, parse_time, takeover_reason)
from pipeline.offline.manifest import RunManifest
from pipeline.offline.source import WorkerSlot

HOST = socket.gethostname()
LONG_AGO = "2026-01-01T00:00:00+00:00"
ROUNDS = 20


def foreign_record(renewed: str, lease_s: float = 300.0) -> dict:
    return {"host": "otherhost", "pid": 4242, "since": LONG_AGO, "renewed": renewed, "lease_s": lease_s,
            "index": 0, "count": 1, "token": "theirs"}


def iso(seconds_since_epoch: float) -> str:
    import datetime
    return datetime.datetime.fromtimestamp(seconds_since_epoch, datetime.timezone.utc).isoformat(timespec="seconds")


# ── lease arithmetic ────────────────────────────────────────────────────────────────────────────

def test_a_lease_counts_from_its_renewal_else_its_start_else_the_files_time():
    now = parse_time("2026-12-01T10:00:00+00:00")
    assert lease_of({"renewed": "2026-12-01T09:58:00+00:00", "since": LONG_AGO, "lease_s": 300}, now, None,
                    60) == Lease(300.0, 120.0)
    assert lease_of({"since": "2026-12-01T09:59:00+00:00"}, now, None, 60) == Lease(60.0, 60.0)  # an older lock
    assert lease_of({"since": "earlier"}, now, now - 5, 60) == Lease(60.0, 5.0)  # no readable time: the file's
    assert lease_of(None, now, now - 400, 300) == Lease(300.0, 400.0)  # an empty file
    assert lease_of(None, now, None, 300).age_s is None  # a store that keeps no times: never expired
    assert lease_of({"renewed": "2026-12-01T10:03:00+00:00"}, now, None, 60).age_s == 0.0  # a clock ahead of ours


def test_a_lease_expires_only_after_its_full_length():
    assert not Lease(300.0, 300.0).expired and Lease(300.0, 300.5).expired
    assert Lease(300.0, 120.0).expires_in_s == 180.0 and Lease(300.0, 400.0).expires_in_s == -100.0
    assert not Lease(300.0, None).expired and Lease(300.0, None).expires_in_s is None


def test_a_lock_is_taken_over_on_this_host_by_its_process_elsewhere_by_its_lease():
    alive, dead = (lambda pid: True), (lambda pid: False)
    mine = {"host": HOST, "pid": 7, "since": "s"}
    assert takeover_reason(mine, Lease(300, 10), HOST, alive) is None
    assert takeover_reason(mine, Lease(300, 10_000), HOST, alive) is None  # a live process here is never taken over
    assert "process 7 on" in takeover_reason(mine, Lease(300, 10), HOST, dead)
    theirs = foreign_record(LONG_AGO)
    assert takeover_reason(theirs, Lease(300, 299), HOST, dead) is None  # its pid means nothing here
    assert takeover_reason(theirs, Lease(300, 301), HOST, alive) == (
        f"took over the lock of process 4242 on otherhost (since {LONG_AGO}): its lease of 300s expired, it was "
        "last renewed 301s ago")
    assert takeover_reason(None, Lease(300, 100), HOST, alive) is None
    assert "unreadable lock file" in takeover_reason(None, Lease(300, 400), HOST, alive)


def test_only_stores_with_a_precondition_count_as_conditional():
    assert create_kind(fsspec.filesystem("file")) == "local"
    assert create_kind(fsspec.filesystem("memory")) == "settle"
    s3fs = pytest.importorskip("s3fs")
    assert create_kind(s3fs.S3FileSystem(anon=True)) == "conditional"


def test_a_create_refused_for_a_rival_is_a_race_lost_not_a_storage_fault():
    import errno

    from pipeline.offline.lock import _already_exists

    assert _already_exists(FileExistsError("exists"))
    assert _already_exists(OSError(errno.EINVAL, "At least one of the pre-conditions you specified did not hold"))
    assert _already_exists(OSError(errno.EIO, "An error occurred (ConditionalRequestConflict) when calling the "
                                              "PutObject operation"))
    assert not _already_exists(OSError(errno.EIO, "An error occurred (AccessDenied)"))


# ── one process ─────────────────────────────────────────────────────────────────────────────────

def manifest_at(tmp_path) -> RunManifest:
    return RunManifest(fsspec.filesystem("file"), str(tmp_path / "out"))


def write_lock(tmp_path, content) -> str:
    path = tmp_path / "out" / ".lengthwise" / "lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_an_expired_foreign_lease_is_taken_over_with_a_warning(tmp_path):
    path = write_lock(tmp_path, foreign_record(iso(time.time() - 400)))
    manifest = manifest_at(tmp_path)
    note = manifest.acquire_lock(WorkerSlot(), 300.0)
    try:
        assert note.startswith(f"took over the lock of process 4242 on otherhost (since {LONG_AGO}): its lease of "
                               "300s expired, it was last renewed 4")
        record = json.loads(open(path).read())
        assert (record["host"], record["pid"], record["lease_s"]) == (HOST, os.getpid(), 300.0)
    finally:
        manifest.release_lock()
    assert not os.path.exists(path) and os.listdir(os.path.dirname(path)) == ["shards"]  # no claim file left


def test_a_live_foreign_lease_is_refused_saying_when_it_expires(tmp_path):
    path = write_lock(tmp_path, foreign_record(iso(time.time() - 100)))
    with pytest.raises(UsageError) as refused:
        manifest_at(tmp_path).acquire_lock(WorkerSlot(), 300.0)
    message = str(refused.value)
    assert message.startswith(f"another run (pid 4242 on otherhost, since {LONG_AGO}) is writing to this output; "
                              "its lease was renewed 10")
    assert re.search(r"renewed 10[01]s ago and expires in (199|200)s unless renewed", message), message
    assert message.endswith(f"delete {path} if that run is gone")
    assert json.loads(open(path).read())["token"] == "theirs"  # left alone


def test_an_empty_lock_file_is_refused_while_young_and_taken_over_once_older_than_the_lease(tmp_path):
    path = write_lock(tmp_path, "")
    manifest = manifest_at(tmp_path)
    with pytest.raises(UsageError, match=r"^the lock .*/lock is unreadable \(empty or truncated\) and was written "
                                         r"\d+s ago; it is taken over once it is older than the lease \(300s\)"):
        manifest.acquire_lock(WorkerSlot(), 300.0)
    status = manifest.read_locks()
    assert status[0]["unreadable"] and status[0]["alive"]
    os.utime(path, (time.time() - 400, time.time() - 400))
    note = manifest.acquire_lock(WorkerSlot(), 300.0)
    try:
        assert note.startswith("took over an unreadable lock file (empty or truncated), last written 40")
    finally:
        manifest.release_lock()


def test_a_truncated_lock_file_of_a_killed_writer_is_no_traceback(tmp_path):
    write_lock(tmp_path, '{"host": "otherhost", "pid": 12')
    with pytest.raises(UsageError, match="is unreadable"):
        manifest_at(tmp_path).acquire_lock()


def test_the_heartbeat_renews_the_lease_and_release_stops_it(tmp_path):
    manifest = manifest_at(tmp_path)
    manifest.acquire_lock(WorkerSlot(), 1.0)  # renewed every 0.2 s
    path = tmp_path / "out" / ".lengthwise" / "lock"
    first = json.loads(path.read_text())
    time.sleep(1.6)
    renewed = json.loads(path.read_text())
    assert renewed["token"] == first["token"] and renewed["since"] == first["since"]
    assert parse_time(renewed["renewed"]) > parse_time(first["renewed"])
    manifest.check_lock_held()  # 1.6 s past a 1 s lease, and still held
    keeper = manifest._leases[str(path)]
    manifest.release_lock()
    assert not path.exists() and not keeper._thread.is_alive()


def test_a_run_whose_lock_was_taken_over_commits_no_more(tmp_path):
    manifest = manifest_at(tmp_path)
    manifest.acquire_lock(WorkerSlot(), 300.0)
    path = write_lock(tmp_path, foreign_record(iso(time.time())))  # another host took it over meanwhile
    keeper = manifest._leases[path]
    keeper.renew()
    with pytest.raises(StorageError, match=r"^the lock .*/lock was taken over by pid 4242 on otherhost; this run "
                                           r"stopped before committing more shards"):
        manifest.check_lock_held()
    manifest.release_lock()
    assert json.loads(open(path).read())["token"] == "theirs"  # the release left the new holder's lock alone


def test_a_shard_finished_after_the_lock_was_taken_over_is_not_committed(tmp_path):
    import pyarrow as pa

    from pipeline.offline.sink import ShardSink
    from pipeline.offline.source import Shard

    sink = ShardSink(str(tmp_path / "out"))
    sink.create()
    manifest = RunManifest(sink.fs, sink.output_dir)
    manifest.acquire_lock(WorkerSlot(), 300.0)
    shard = Shard(url="in/part-00000.parquet", stem="part-00000", num_rows=2)
    sink.write(0, shard, pa.table({"id": ["a", "b"], "value": [1, 2]}))
    path = write_lock(tmp_path, foreign_record(iso(time.time())))
    manifest._leases[path].renew()  # the heartbeat finds another host's lock
    with pytest.raises(StorageError, match="was taken over by pid 4242 on otherhost"):
        sink.commit(0, manifest)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".lengthwise"]  # no output, no temporary
    manifest.release_lock()


def test_a_lease_not_renewed_for_longer_than_it_lasts_is_lost(tmp_path):
    store = LockStore(fsspec.filesystem("file"))
    path = str(tmp_path / "lock")
    record = new_record(0, 1, 2.0)
    assert store.create(path, encode(record)) and not store.create(path, b"other")
    keeper = LeaseKeeper(store, path, record)
    assert keeper.lost is None
    keeper.renewed_at -= 3.2  # the storage refused every renewal for 3.2 s
    assert keeper.lost == (f"the lock {path} could not be renewed for 3s, longer than its lease of 2s, so another "
                           "run may have taken it over")


def test_a_change_whose_claim_is_held_by_another_changer_stands_back(tmp_path):
    store = LockStore(fsspec.filesystem("file"))
    path = str(tmp_path / "lock")
    store.create(path, b"old")
    claim = store._claim(path, b"old")
    assert claim is not None and store._claim(path, b"old") is None  # the second changer of one content waits
    assert not store.replace(path, b"old", b"new")
    os.utime(claim, (time.time() - 300, time.time() - 300))  # its changer died holding it: passed over
    assert store.replace(path, b"old", b"new") and open(path, "rb").read() == b"new"
    assert not store.replace(path, b"old", b"newer")  # it no longer holds what was read


def dead_pid() -> int:
    """The pid of a process of this host that has exited."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_claim_whose_changer_died_on_this_host_is_passed_over_at_once(tmp_path):
    store = LockStore(fsspec.filesystem("file"))
    path = str(tmp_path / "lock")
    store.create(path, b"old")
    claim = f"{path}.claim-{content_digest(b'old')}-0"
    with open(claim, "w") as f:
        f.write(f"{HOST} {dead_pid()} {iso(time.time())}\n")  # killed a moment ago, mid-change
    assert store.replace(path, b"old", b"new") and open(path, "rb").read() == b"new"
    store.create(str(tmp_path / "lock2"), b"old")
    with open(f"{tmp_path / 'lock2'}.claim-{content_digest(b'old')}-0", "w") as f:
        f.write(f"otherhost 12 {iso(time.time())}\n")  # a changer elsewhere: its pid means nothing here
    assert not store.replace(str(tmp_path / "lock2"), b"old", b"new")


def test_a_follower_reads_from_the_lock_file_whether_its_run_still_holds_it():
    """What a Ray actor on any node checks before it commits for its driver."""
    now = float(int(time.time()))  # whole seconds, as the lock records them
    ours = {**new_record(0, 1, 300.0), "renewed": iso(now - 20)}

    def read(record) -> LockFile:
        return LockFile(encode(record), record, None)

    assert lost_as_read(read(ours), ours["token"], now, "out/lock") is None
    assert lost_as_read(None, ours["token"], now, "out/lock") == "the lock out/lock was removed"
    assert lost_as_read(read(foreign_record(iso(now))), ours["token"], now, "out/lock") == (
        "the lock out/lock was taken over by pid 4242 on otherhost")
    assert lost_as_read(LockFile(b"", None, now), ours["token"], now, "out/lock") == (
        "the lock out/lock was taken over by an unreadable lock")
    lapsed = {**ours, "renewed": iso(now - 301)}  # the driver was cut off, or its storage refused every renewal
    assert lost_as_read(read(lapsed), ours["token"], now, "out/lock") == (
        "the lock out/lock was last renewed 301s ago, longer ago than its lease of 300s, so another run may have "
        "taken it over")


def test_only_locks_and_claims_of_processes_dead_on_this_host_are_removed(tmp_path):
    """What a rerun with nothing to do clears: a run killed after its last commit left its lock."""
    manifest = manifest_at(tmp_path)
    dead_lock = write_lock(tmp_path, {**new_record(0, 1, 300.0), "pid": dead_pid()})
    dead_content = open(dead_lock, "rb").read()
    folder = tmp_path / "out" / ".lengthwise"
    (folder / "lock-worker-1-of-2").write_text(json.dumps(new_record(1, 2, 300.0)))  # this live process
    (folder / "lock-worker-0-of-2").write_text(json.dumps(foreign_record(LONG_AGO)))  # expired, but elsewhere
    (folder / f"lock.claim-{content_digest(dead_content)}-0").write_text(f"{HOST} {dead_pid()} {LONG_AGO}\n")
    (folder / f"lock-worker-1-of-2.claim-{'0' * 16}-0").write_text(f"{HOST} {os.getpid()} {LONG_AGO}\n")
    assert manifest.remove_dead_locks() == 2  # the dead lock, then its dead changer's claim
    assert sorted(p.name for p in folder.iterdir()) == ["lock-worker-0-of-2", "lock-worker-1-of-2",
                                                        f"lock-worker-1-of-2.claim-{'0' * 16}-0"]
    assert manifest.remove_dead_locks() == 0


def test_status_shows_each_locks_lease(tmp_path, monkeypatch):
    from pipeline.cli.job_commands import lock_line

    write_lock(tmp_path, foreign_record(iso(time.time() - 30)))
    (live,) = manifest_at(tmp_path).read_locks()
    assert live["alive"] and 29 <= live["lease_age_s"] <= 32 and 268 <= live["lease_expires_in_s"] <= 271
    assert lock_line(live).startswith(f"running: pid 4242 on otherhost since {LONG_AGO}; lease renewed 3")
    write_lock(tmp_path, foreign_record(iso(time.time() - 1000)))
    (stale,) = manifest_at(tmp_path).read_locks()
    assert not stale["alive"]
    assert lock_line(stale).startswith("stale lock (its lease expired 70")


@pytest.mark.slow
def test_status_json_says_an_expired_lease_is_not_running(tmp_path, sample_table, tiny_encoder_path):
    from pipeline.cli import cli
    from tests.conftest import write_shards

    write_shards(tmp_path / "in", sample_table.slice(0, 60), [30, 30])

    result = CliRunner().invoke(cli, ["run", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                                      "--model", tiny_encoder_path, "--tokenize-workers", "0", "--no-progress"])
    assert result.exit_code == 0, result.output
    write_lock(tmp_path, foreign_record(iso(time.time() - 1000)))
    report = json.loads(CliRunner().invoke(cli, ["status", "--output", str(tmp_path / "out"), "--json"]).output)
    assert report["workers"][0]["running"] is False and report["lock"]["alive"] is False
    assert report["lock"]["lease_expires_in_s"] < -690
    nothing = CliRunner().invoke(cli, ["run", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                                       "--model", tiny_encoder_path, "--tokenize-workers", "0", "--no-progress"])
    assert nothing.exit_code == 0 and "nothing to do" in nothing.output  # a done output needs no lock
    assert json.loads((tmp_path / "out" / ".lengthwise" / "lock").read_text())["pid"] == 4242  # nor removes it
    (tmp_path / "out" / "part-00001.parquet").unlink()  # now there is work, so the stale lock is taken over
    rerun = CliRunner().invoke(cli, ["run", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                                     "--model", tiny_encoder_path, "--tokenize-workers", "0", "--no-progress"])
    assert rerun.exit_code == 0 and "took over the lock of process 4242 on otherhost" in rerun.output


@pytest.mark.slow
def test_a_rerun_with_nothing_to_do_removes_the_lock_of_a_run_killed_after_its_last_commit(tmp_path, sample_table,
                                                                                             tiny_encoder_path):
    from pipeline.cli import cli
    from tests.conftest import write_shards

    write_shards(tmp_path / "in", sample_table.slice(0, 20), [10, 10])
    args = ["run", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--model", tiny_encoder_path,
            "--tokenize-workers", "0", "--no-progress", "--no-probe"]
    assert CliRunner().invoke(cli, args).exit_code == 0
    folder = tmp_path / "out" / ".lengthwise"
    before = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "out").rglob("*"))
    write_lock(tmp_path, {**new_record(0, 1, 300.0), "pid": dead_pid()})  # SIGKILLed between its last commit and release
    nothing = CliRunner().invoke(cli, args)
    assert nothing.exit_code == 0, nothing.output
    assert "nothing to do: 2 of 2 shards done" in nothing.output
    assert "removed the lock of a run that is no longer running" in nothing.output
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "out").rglob("*")) == before  # nothing else
    assert not list(folder.glob("lock*"))


def test_a_lease_of_zero_is_a_usage_error(tmp_path):
    from pipeline.cli import cli

    result = CliRunner().invoke(cli, ["run", "--input", str(tmp_path), "--output", str(tmp_path / "out"),
                                      "--lock-lease", "0s"])
    assert result.exit_code == 2 and "--lock-lease must be more than 0s" in result.output


# ── two processes racing ────────────────────────────────────────────────────────────────────────

def race_for_locks(url: str, storage_options: dict, barrier, results, rounds: int) -> None:
    """One racer: in each round, take the lock of a fresh output at the moment the other racer
    does (a barrier), report what happened, and hold it until both have reported."""
    fs = fsspec.filesystem(fsspec.core.split_protocol(url)[0] or "file", **storage_options)
    for round_index in range(rounds):
        manifest = RunManifest(fs, f"{fsspec.core.split_protocol(url)[1]}/round-{round_index:02d}")
        barrier.wait()
        try:
            note = manifest.acquire_lock(WorkerSlot(), 300.0)
            outcome = ("won", note)
        except UsageError as error:
            outcome = ("refused", str(error))
        except BaseException as error:  # noqa: BLE001 - every other outcome is a failure the test reports
            outcome = ("error", f"{type(error).__name__}: {error}")
        results.put((round_index, os.getpid(), *outcome))
        barrier.wait()
        manifest.release_lock()


def race(url: str, storage_options: dict, rounds: int = ROUNDS) -> dict[int, list[tuple]]:
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    racers = [context.Process(target=race_for_locks, args=(url, storage_options, barrier, results, rounds))
              for _ in range(2)]
    for racer in racers:
        racer.start()
    by_round: dict[int, list[tuple]] = {}
    for _ in range(2 * rounds):
        round_index, pid, *outcome = results.get(timeout=120)
        by_round.setdefault(round_index, []).append((pid, *outcome))
    for racer in racers:
        racer.join(timeout=30)
        assert racer.exitcode == 0
    return by_round


def assert_one_winner_each_round(by_round: dict[int, list[tuple]], expect_note: bool) -> None:
    assert sorted(by_round) == list(range(ROUNDS))
    for round_index, outcomes in by_round.items():
        kinds = sorted(outcome[1] for outcome in outcomes)
        assert kinds == ["refused", "won"], f"round {round_index}: {outcomes}"
        (winner,) = [o for o in outcomes if o[1] == "won"]
        (loser,) = [o for o in outcomes if o[1] == "refused"]
        assert loser[2].startswith(f"another run (pid {winner[0]} on {HOST}, since "), loser[2]
        assert "is writing to this output" in loser[2]
        assert (winner[2] is not None) == expect_note, winner


def seed_expired_locks(fs, root: str) -> None:
    for round_index in range(ROUNDS):
        fs.makedirs(f"{root}/round-{round_index:02d}/.lengthwise", exist_ok=True)
        fs.pipe_file(f"{root}/round-{round_index:02d}/.lengthwise/lock",
                     encode(foreign_record(iso(time.time() - 1000))))


@pytest.mark.slow
def test_two_processes_racing_on_a_local_disk_one_wins_each_round(tmp_path):
    assert_one_winner_each_round(race(str(tmp_path), {}), expect_note=False)


@pytest.mark.slow
def test_two_takers_of_one_expired_lock_on_a_local_disk_one_wins_each_round(tmp_path):
    seed_expired_locks(fsspec.filesystem("file"), str(tmp_path))
    assert_one_winner_each_round(race(str(tmp_path), {}), expect_note=True)


@pytest.fixture
def s3_bucket(moto_endpoint, request):
    import s3fs

    options = {"endpoint_url": moto_endpoint, "key": "testing", "secret": "testing"}
    fs = s3fs.S3FileSystem(**options)
    name = "lw-lock-" + request.node.name.lower().replace("_", "-")[-30:].strip("-")
    fs.mkdir(name)
    return fs, name, options


def test_the_s3_server_refuses_a_second_conditional_create(s3_bucket):
    fs, name, _ = s3_bucket
    store = LockStore(fs)
    assert store.kind == "conditional"
    assert store.create(f"{name}/lock", b"first")
    assert not store.create(f"{name}/lock", b"second")  # 412 PreconditionFailed, If-None-Match
    assert fs.cat_file(f"{name}/lock") == b"first"


@pytest.mark.slow
def test_two_processes_racing_on_s3_one_wins_each_round(s3_bucket):
    _, name, options = s3_bucket
    assert_one_winner_each_round(race(f"s3://{name}", options), expect_note=False)


@pytest.mark.slow
def test_two_takers_of_one_expired_lock_on_s3_one_wins_each_round(s3_bucket):
    fs, name, options = s3_bucket
    seed_expired_locks(fs, name)
    assert_one_winner_each_round(race(f"s3://{name}", options), expect_note=True)
