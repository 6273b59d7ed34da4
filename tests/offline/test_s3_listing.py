"""Listing an object store that refuses: no credentials is exit 2, a store that cannot be
reached exit 4, each one line (as when writing), for run, status and verify; against a real
S3-compatible server (moto) on loopback and a closed port."""

import socket
import uuid

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline.cli import cli

pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

NO_CREDENTIALS = ("no credentials for the object store (NoCredentialsError: Unable to locate credentials); set them "
                  "in the environment (for s3: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) or in "
                  "the storage options (--storage-option key=… --storage-option secret=…; anon=true for a public "
                  "bucket)")
UNREACHABLE = "cannot reach the object store (EndpointConnectionError: Could not connect to the endpoint URL: "
UNREACHABLE_ADVICE = ("check its address (--storage-option endpoint_url=…) and the network, or wait for it to come "
                      "back, then rerun the same command: committed shards are kept and it resumes")
ONE_TRY = 'config_kwargs={"retries": {"max_attempts": 1}}'  # botocore's own retries of the connection, kept short


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def endpoint(moto_endpoint):
    return moto_endpoint


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    """No AWS credentials anywhere botocore looks: variables, files, instance metadata."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # a filesystem an earlier test made with credentials is not reused
    yield
    s3fs.S3FileSystem.clear_instance_cache()  # nor one made without them by later tests


@pytest.fixture
def bucket(endpoint, no_credentials, sample_table):
    """A bucket with one 20-row shard under in/, made with credentials moto accepts."""
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing")
    name = f"lw-listing-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    with fs.open(f"{name}/in/part-00000.parquet", "wb") as f:
        pq.write_table(sample_table.slice(0, 20), f)
    return name


def only_line(result) -> str:
    lines = result.output.splitlines()
    assert len(lines) == 1, result.output
    return lines[0]


def test_run_without_credentials_is_one_line_exit_2(endpoint, bucket, no_credentials, tiny_encoder_path, tmp_path):
    result = CliRunner().invoke(cli, ["run", "--input", f"s3://{bucket}/in/", "--output", str(tmp_path / "out"),
                                      "--model", tiny_encoder_path, "--storage-option", f"endpoint_url={endpoint}",
                                      "--no-progress"])
    assert result.exit_code == 2
    assert only_line(result) == f"error: cannot list input 's3://{bucket}/in/': {NO_CREDENTIALS}"
    assert not (tmp_path / "out").exists()


def test_run_to_an_output_on_s3_without_credentials_is_one_line_exit_2(endpoint, bucket, no_credentials,
                                                                      tiny_encoder_path, tmp_path, sample_table):
    (tmp_path / "in").mkdir()
    pq.write_table(sample_table.slice(0, 10), tmp_path / "in" / "part-00000.parquet")
    result = CliRunner().invoke(cli, ["run", "--input", str(tmp_path / "in"), "--output", f"s3://{bucket}/out",
                                      "--model", tiny_encoder_path, "--storage-option", f"endpoint_url={endpoint}",
                                      "--no-progress"])
    assert result.exit_code == 2
    assert only_line(result) == f"error: s3://{bucket}/out: {NO_CREDENTIALS}"


@pytest.mark.parametrize("command", ["status", "verify"])
def test_status_and_verify_without_credentials_are_one_line_exit_2(endpoint, bucket, no_credentials, command):
    output = f"s3://{bucket}/out"  # as verify shows it: without a trailing slash
    result = CliRunner().invoke(cli, [command, "--output", output, "--storage-option", f"endpoint_url={endpoint}"])
    assert result.exit_code == 2
    assert only_line(result) == f"error: {output}: {NO_CREDENTIALS}"


def test_run_with_the_store_down_is_one_line_exit_4_and_verbose_adds_the_traceback(tiny_encoder_path, tmp_path):
    down = f"http://127.0.0.1:{free_port()}"
    args = ["run", "--input", "s3://nightly/in/", "--output", str(tmp_path / "out"), "--model", tiny_encoder_path,
            "--storage-option", f"endpoint_url={down}", "--storage-option", "key=testing", "--storage-option",
            "secret=testing", "--storage-option", ONE_TRY, "--no-progress"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 4
    line = only_line(result)
    assert line.startswith(f"error: cannot list input 's3://nightly/in/': {UNREACHABLE}\"{down}/nightly?")
    assert line.endswith(f"); {UNREACHABLE_ADVICE}")
    assert "testing" not in line
    assert not (tmp_path / "out").exists()
    verbose = CliRunner().invoke(cli, [*args, "--verbose"])
    assert verbose.exit_code == 4
    assert "Traceback" in verbose.output and "EndpointConnectionError" in verbose.output


@pytest.mark.parametrize("command", ["status", "verify"])
def test_status_and_verify_with_the_store_down_are_one_line_exit_4(command):
    down = f"http://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(cli, [command, "--output", "s3://nightly/out", "--storage-option",
                                      f"endpoint_url={down}", "--storage-option", "key=testing", "--storage-option",
                                      "secret=testing", "--storage-option", ONE_TRY])
    assert result.exit_code == 4
    line = only_line(result)
    assert line.startswith(f"error: s3://nightly/out: {UNREACHABLE}\"{down}/nightly/out")
    assert line.endswith(f"); {UNREACHABLE_ADVICE}")
