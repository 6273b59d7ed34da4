"""Storage that refuses the output: a full disk (a real 48 KiB tmpfs), an immutable output
folder (chattr +i) and an object store that answers 503 (moto behind a flaky proxy, in
tests/offline/test_s3.py). Each ends with one line naming the path, the cause and what to do, exit 4,
committed shards intact, no partial file, and a rerun that resumes. A complete output on
read-only storage (a read-only bind mount) is nothing to do: exit 0."""

import json
import shutil
import subprocess

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.core.errors import StorageError, as_storage_error
from pipeline.offline.lock import new_record
from tests.conftest import write_shards

SIZES = [20, 190, 190]


def run_args(inputs, output, model, *extra) -> list[str]:
    return ["run", "--input", str(inputs), "--output", str(output), "--model", model, "--keep-columns", "text",
            "--max-length", "64", "--no-progress", "--tokenize-workers", "0", "--no-probe", *extra]


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:") or "Traceback" in line]


def test_storage_errors_name_the_path_the_cause_and_what_to_do():
    full = as_storage_error(OSError(28, "No space left on device"), "out/.a.parquet.1.tmp")
    assert str(full).startswith("out/.a.parquet.1.tmp: no space left (OSError: [Errno 28] No space left on device); "
                                "free space there or choose another --output, then rerun the same command")
    denied = as_storage_error(PermissionError(13, "Permission denied"), "out/.lengthwise")
    assert "out/.lengthwise: permission denied (PermissionError: [Errno 13] Permission denied)" in str(denied)
    down = as_storage_error(OSError("An error occurred (ServiceUnavailable) when calling PutObject"), "s3://b/o")
    assert "s3://b/o: the object store kept failing through its retries" in str(down)
    assert as_storage_error(ValueError("bad row"), "x") is None and as_storage_error(FileNotFoundError(), "x") is None
    assert isinstance(down, StorageError)


@pytest.fixture
def small_disk(tmp_path):
    """A real 48 KiB filesystem: the first, small shard's output fits, the second's does not."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


@pytest.mark.slow
def test_a_full_disk_stops_the_run_with_one_line_and_a_rerun_resumes(tmp_path, small_disk, sample_table,
                                                                      tiny_encoder_path):
    write_shards(tmp_path / "in", sample_table, SIZES)
    output = small_disk / "out"
    full = CliRunner().invoke(cli, run_args(tmp_path / "in", output, tiny_encoder_path))
    assert full.exit_code == 4, full.output
    [line] = error_lines(full)
    assert line.startswith(f"error: {output}/.part-00001.parquet.") and "no space left (OSError: [Errno 28]" in line
    assert line.endswith("free space there or choose another --output, then rerun the same command: committed "
                         "shards are kept and it resumes")
    assert sorted(p.name for p in output.iterdir()) == [".lengthwise", "part-00000.parquet"]  # no partial file
    assert pq.read_table(output / "part-00000.parquet")["id"].to_pylist() == sample_table["id"].to_pylist()[:20]
    assert not [p for p in (output / ".lengthwise").rglob("*.tmp")]

    subprocess.run(["mount", "-o", "remount,size=2m", str(small_disk)], check=True)  # space freed
    rerun = CliRunner().invoke(cli, run_args(tmp_path / "in", output, tiny_encoder_path))
    assert rerun.exit_code == 0, rerun.output
    assert "1 of 3 shards already done, resuming" in rerun.stderr
    ids = [i for p in sorted(output.glob("*.parquet")) for i in pq.read_table(p)["id"].to_pylist()]
    assert ids == sample_table["id"].to_pylist()  # every row once


@pytest.fixture
def immutable_folder(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode != 0:
        pytest.skip("chattr +i is not available on this filesystem")
    yield folder
    subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_an_output_folder_it_may_not_write_is_one_line_and_exit_4(tmp_path, immutable_folder, sample_table,
                                                                    tiny_encoder_path):
    write_shards(tmp_path / "in", sample_table.slice(0, 20), [10, 10])
    denied = CliRunner().invoke(cli, run_args(tmp_path / "in", immutable_folder, tiny_encoder_path))
    assert denied.exit_code == 4, denied.output
    [line] = error_lines(denied)
    assert line.startswith(f"error: {immutable_folder}/.lengthwise/shards: permission denied (PermissionError: "
                           "[Errno 1] Operation not permitted")
    assert "an immutable flag shown by `lsattr`" in line and list(immutable_folder.iterdir()) == []
    verbose = CliRunner().invoke(cli, run_args(tmp_path / "in", immutable_folder, tiny_encoder_path, "--verbose"))
    assert verbose.exit_code == 4 and "Traceback" in verbose.stderr  # the traceback only with --verbose

    subprocess.run(["chattr", "-i", str(immutable_folder)], check=True)
    rerun = CliRunner().invoke(cli, run_args(tmp_path / "in", immutable_folder, tiny_encoder_path))
    assert rerun.exit_code == 0, rerun.output
    assert sorted(p.name for p in immutable_folder.glob("*.parquet")) == ["part-00000.parquet", "part-00001.parquet"]
    markers = (immutable_folder / ".lengthwise" / "shards").glob("*.json")
    assert sorted(json.loads(p.read_text())["status"] for p in markers) == ["done", "done"]


def test_an_output_folder_it_may_not_create_is_exit_4_too(tmp_path, immutable_folder, sample_table,
                                                         tiny_encoder_path):
    """One fault, one exit code: storage refusing the output folder itself is 4, as refusing any
    write in it, not 2 ("a usage error, do not retry")."""
    write_shards(tmp_path / "in", sample_table.slice(0, 20), [10, 10])
    output = immutable_folder / "night"
    denied = CliRunner().invoke(cli, run_args(tmp_path / "in", output, tiny_encoder_path))
    assert denied.exit_code == 4, denied.output
    [line] = error_lines(denied)
    assert line.startswith(f"error: {output}: permission denied (PermissionError: [Errno 1] Operation not permitted")
    assert line.endswith("then rerun the same command: committed shards are kept and it resumes")
    assert list(immutable_folder.iterdir()) == []


@pytest.fixture
def read_only_view(tmp_path):
    """`mount(target)`: a read-only bind mount of `target` at tmp_path/ro (a real EROFS)."""
    view = tmp_path / "ro"
    view.mkdir()

    def mount(target):
        for command in (["mount", "--bind", str(target), str(view)], ["mount", "-o", "remount,bind,ro", str(view)]):
            mounted = subprocess.run(command, capture_output=True, text=True)
            if mounted.returncode != 0:
                pytest.skip(f"cannot bind-mount read-only here: {mounted.stderr.strip()}")
        return view

    yield mount
    subprocess.run(["umount", str(view)], capture_output=True)


@pytest.mark.slow
def test_a_complete_output_on_read_only_storage_is_nothing_to_do_and_a_pending_one_is_exit_4(
        tmp_path, read_only_view, sample_table, tiny_encoder_path):
    write_shards(tmp_path / "in", sample_table.slice(0, 20), [10, 10])
    output = tmp_path / "out"
    assert CliRunner().invoke(cli, run_args(tmp_path / "in", output, tiny_encoder_path)).exit_code == 0
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = output / ".lengthwise" / "lock"
    lock.write_text(json.dumps({**new_record(0, 1, 300.0), "pid": dead.pid}))  # of a run killed after its last commit
    read_only = read_only_view(output)
    retry = CliRunner().invoke(cli, run_args(tmp_path / "in", read_only, tiny_encoder_path))
    assert retry.exit_code == 0, retry.output  # no lock is needed to do nothing
    assert "nothing to do: 2 of 2 shards done" in retry.stderr and error_lines(retry) == []
    assert lock.exists()  # the dead run's lock could not be removed, and holds nothing
    assert CliRunner().invoke(cli, ["status", "--output", str(read_only)]).exit_code == 0
    assert CliRunner().invoke(cli, ["verify", "--output", str(read_only)]).exit_code == 0
    summary = CliRunner().invoke(cli, run_args(tmp_path / "in", read_only, tiny_encoder_path, "--summary-json",
                                               str(read_only / ".summary.json")))
    assert summary.exit_code == 4, summary.output  # a --summary-json it may not write is storage too
    assert error_lines(summary)[0].startswith(f"error: {read_only}/.summary.json: permission denied (OSError: "
                                              "[Errno 30] Read-only file system")

    subprocess.run(["umount", str(read_only)], check=True)
    (output / ".lengthwise" / "shards" / "part-00001.json").unlink()  # a shard left to do
    read_only_view(output)
    pending = CliRunner().invoke(cli, run_args(tmp_path / "in", read_only, tiny_encoder_path))
    assert pending.exit_code == 4, pending.output
    [line] = error_lines(pending)
    assert line.startswith(f"error: {read_only}/.lengthwise/lock: permission denied (OSError: [Errno 30] "
                           "Read-only file system")
