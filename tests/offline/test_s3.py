"""Input and output on S3 through fsspec/s3fs, against a real S3-compatible server (moto) on
loopback: a full run, a kill and resume, and a corrupt shard."""

import http.client
import http.server
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

LENGTHWISE = str(Path(sys.executable).parent / "lengthwise")
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def endpoint(monkeypatch_module, moto_endpoint):
    for name, value in CREDENTIALS.items():
        monkeypatch_module.setenv(name, value)
    return moto_endpoint


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture
def bucket(endpoint, request, sample_table):
    """A fresh bucket with three 40-row shards under in/."""
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing")
    name = "lw-" + request.node.name.lower().replace("_", "-")[:40]
    fs.mkdir(name)
    for index in range(3):
        with fs.open(f"{name}/in/part-{index:05d}.parquet", "wb") as f:
            pq.write_table(sample_table.slice(40 * index, 40), f)
    fs.invalidate_cache()
    return fs, name


def run_args(endpoint, bucket_name, model, *extra):
    return ["run", "--input", f"s3://{bucket_name}/in/", "--output", f"s3://{bucket_name}/out/", "--model", model,
            "--storage-option", f"endpoint_url={endpoint}", "--max-length", "64", "--no-progress",
            "--tokenize-workers", "0", *extra]


def read_outputs(fs, bucket_name) -> dict[str, list]:
    fs.invalidate_cache()
    return {path.rsplit("/", 1)[-1]: pq.read_table(path, filesystem=fs).to_pylist()
            for path in sorted(fs.glob(f"{bucket_name}/out/*.parquet"))}


@pytest.mark.slow
def test_full_run_on_s3(bucket, endpoint, tiny_encoder_path, sample_table):
    from click.testing import CliRunner

    from pipeline.cli import cli

    fs, name = bucket
    result = CliRunner().invoke(cli, run_args(endpoint, name, tiny_encoder_path))
    assert result.exit_code == 0, result.output
    outputs = read_outputs(fs, name)
    assert sorted(outputs) == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    ids = [row["id"] for shard in outputs.values() for row in shard]
    assert ids == sample_table["id"].to_pylist()[:120]
    assert not fs.glob(f"{name}/out/.*.tmp")
    markers = fs.glob(f"{name}/out/.lengthwise/shards/*.json")
    assert len(markers) == 3
    run_json = json.loads(fs.cat(f"{name}/out/.lengthwise/run.json"))
    assert run_json["config"]["storage_options"] == {"endpoint_url": endpoint}
    status = CliRunner().invoke(cli, ["status", "--output", f"s3://{name}/out/", "--storage-option",
                                      f"endpoint_url={endpoint}", "--json"])
    assert json.loads(status.output)["done"] == 3


@pytest.mark.slow
def test_corrupt_shard_on_s3_fails_alone(bucket, endpoint, tiny_encoder_path):
    from click.testing import CliRunner

    from pipeline.cli import cli

    fs, name = bucket
    fs.pipe(f"{name}/in/part-00001.parquet", b"PAR1 not really")
    result = CliRunner().invoke(cli, run_args(endpoint, name, tiny_encoder_path))
    assert result.exit_code == 1
    assert sorted(read_outputs(fs, name)) == ["part-00000.parquet", "part-00002.parquet"]
    marker = json.loads(fs.cat(f"{name}/out/.lengthwise/shards/part-00001.json"))
    assert marker["status"] == "failed" and "cannot read" in marker["error"]


@pytest.mark.slow
def test_kill_and_resume_on_s3(bucket, endpoint, tiny_encoder_path):
    from click.testing import CliRunner

    from pipeline.cli import cli

    fs, name = bucket
    env = {**__import__("os").environ, **CREDENTIALS}
    clean = CliRunner(env=CREDENTIALS).invoke(cli, run_args(endpoint, name, tiny_encoder_path, "--max-batch-rows", "1"))
    assert clean.exit_code == 0, clean.output  # the reference and the rerun need no process: only the killed run
    expected = read_outputs(fs, name)
    fs.rm(f"{name}/out", recursive=True)
    process = subprocess.Popen([LENGTHWISE, *run_args(endpoint, name, tiny_encoder_path, "--max-batch-rows", "1")],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        fs.invalidate_cache()
        if fs.glob(f"{name}/out/.lengthwise/shards/*.json"):
            break
        time.sleep(0.1)
    process.send_signal(signal.SIGKILL)
    process.wait()
    rerun = CliRunner(env=CREDENTIALS).invoke(cli, run_args(endpoint, name, tiny_encoder_path, "--max-batch-rows", "1"))
    assert rerun.exit_code == 0 and "already done, resuming" in rerun.stderr, rerun.output  # in this process too
    assert read_outputs(fs, name) == expected


class FlakyProxy(http.server.ThreadingHTTPServer):
    """A real HTTP proxy in front of moto that answers `503 SlowDown` to the requests
    `fails(method, path, count)` picks (count: the requests of that method and path so far)."""

    daemon_threads = True

    def __init__(self, target: str, fails):
        self.target, self.fails, self.seen, self.refused = urllib.parse.urlsplit(target), fails, {}, []
        super().__init__(("127.0.0.1", 0), ProxyHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b'<Message>Please reduce your request rate.</Message><RequestId>1</RequestId></Error>')


class ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        proxy = self.server
        key = (self.command, self.path.split("?")[0])
        proxy.seen[key] = proxy.seen.get(key, 0) + 1
        if proxy.fails(self.command, self.path, proxy.seen[key]):
            proxy.refused.append(key)
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(SLOW_DOWN)))
            self.end_headers()
            self.wfile.write(SLOW_DOWN)
            return
        connection = http.client.HTTPConnection(proxy.target.hostname, proxy.target.port, timeout=30)
        connection.request(self.command, self.path, body, dict(self.headers))
        answer = connection.getresponse()
        data = answer.read()
        self.send_response(answer.status)
        for name, value in answer.getheaders():
            if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(name, value)
        # a HEAD answer has no body but the object's length
        self.send_header("Content-Length", answer.getheader("Content-Length", "0") if self.command == "HEAD"
                         else str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        connection.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


FEW_RETRIES = ("--storage-option", 'config_kwargs={"retries": {"max_attempts": 2}}')


@pytest.mark.slow
def test_throttling_on_s3_is_retried_and_the_run_completes(bucket, endpoint, tiny_encoder_path):
    from click.testing import CliRunner

    from pipeline.cli import cli

    fs, name = bucket
    proxy = FlakyProxy(endpoint, lambda method, path, count: method == "PUT" and "/out/.part-" in path and count <= 2)
    args = run_args(endpoint, name, tiny_encoder_path)
    args[args.index(f"endpoint_url={endpoint}")] = f"endpoint_url={proxy.url}"
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert len(proxy.refused) == 6  # every output shard's upload was refused twice first
    outputs = read_outputs(fs, name)
    assert [len(rows) for rows in outputs.values()] == [40, 40, 40]
    proxy.shutdown()


@pytest.mark.slow
def test_an_object_store_down_for_good_is_one_line_exit_4_and_a_rerun_resumes(bucket, endpoint, tiny_encoder_path):
    from click.testing import CliRunner

    from pipeline.cli import cli

    fs, name = bucket
    down = FlakyProxy(endpoint, lambda method, path, count: method == "PUT" and "/out/.part-00001" in path)
    args = [*run_args(endpoint, name, tiny_encoder_path), *FEW_RETRIES]
    args[args.index(f"endpoint_url={endpoint}")] = f"endpoint_url={down.url}"
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 4, result.output
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error:") or "Traceback" in line]
    assert line.startswith(f"error: s3://{name}/out/.part-00001.parquet.") and "the object store kept failing" in line
    assert "Please reduce your request rate" in line
    assert line.endswith("then rerun the same command: committed shards are kept and it resumes")
    fs.invalidate_cache()
    assert sorted(read_outputs(fs, name)) == ["part-00000.parquet"] and not fs.glob(f"{name}/out/.*.tmp")
    down.shutdown()
    rerun = CliRunner().invoke(cli, run_args(endpoint, name, tiny_encoder_path))
    assert rerun.exit_code == 0 and "1 of 3 shards already done, resuming" in rerun.stderr, rerun.output
    assert [len(rows) for rows in read_outputs(fs, name).values()] == [40, 40, 40]


@pytest.mark.slow
def test_reuse_and_verify_on_s3(tmp_path, bucket, endpoint, tiny_encoder_path):
    """--reuse reads yesterday's output and text hashes from S3; verify audits an S3 output."""
    from click.testing import CliRunner

    from pipeline.cli import cli

    fs, name = bucket
    assert CliRunner().invoke(cli, run_args(endpoint, name, tiny_encoder_path)).exit_code == 0
    for index in range(3):  # tonight's export, under a new prefix: same file names, one text edited
        table = pq.read_table(f"{name}/in/part-{index:05d}.parquet", filesystem=fs)
        texts = table["text"].to_pylist()
        texts[3] += " (edited)" * (index == 1)
        with fs.open(f"{name}/in2/part-{index:05d}.parquet", "wb") as f:
            pq.write_table(table.set_column(table.schema.get_field_index("text"), "text", [texts]), f)
    fs.invalidate_cache()
    summary_path = tmp_path / "summary.json"
    arguments = run_args(endpoint, name, tiny_encoder_path, "--reuse", f"s3://{name}/out/", "--summary-json",
                         str(summary_path))
    arguments[arguments.index(f"s3://{name}/out/")] = f"s3://{name}/out2/"
    arguments[arguments.index(f"s3://{name}/in/")] = f"s3://{name}/in2/"
    result = CliRunner().invoke(cli, arguments)
    assert result.exit_code == 0, result.output
    summary = json.loads(summary_path.read_text())
    assert (summary["reused_rows"], summary["computed_rows"]) == (119, 1)
    verify = CliRunner().invoke(cli, ["verify", "--output", f"s3://{name}/out2/", "--storage-option",
                                      f"endpoint_url={endpoint}", "--json"])
    assert verify.exit_code == 0, verify.output
    assert json.loads(verify.output)["rows"] == 120
    fs.rm(f"{name}/out2/part-00002.parquet")
    verify = CliRunner().invoke(cli, ["verify", "--output", f"s3://{name}/out2/", "--storage-option",
                                      f"endpoint_url={endpoint}"])
    assert verify.exit_code == 1 and "part-00002: no output file" in verify.output


@pytest.mark.slow
def test_nested_credentials_never_reach_the_buckets_run_json(bucket, endpoint, tiny_encoder_path):
    """client_kwargs carrying a key and secret (moto accepts any): the run works with them, run.json
    keeps the endpoint only, and `status` reaches the store with the caller's own credentials."""
    from click.testing import CliRunner

    from pipeline.cli import cli

    fs, name = bucket
    nested = json.dumps({"endpoint_url": endpoint, "aws_access_key_id": "AKIDNESTED",
                         "aws_secret_access_key": "nested-secret-value"})
    args = run_args(endpoint, name, tiny_encoder_path)
    args[args.index(f"endpoint_url={endpoint}")] = f"client_kwargs={nested}"
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    run_json = fs.cat(f"{name}/out/.lengthwise/run.json").decode()
    assert "AKIDNESTED" not in run_json and "nested-secret-value" not in run_json
    assert json.loads(run_json)["config"]["storage_options"] == {
        "client_kwargs": {"endpoint_url": endpoint, "aws_access_key_id": "<redacted>",
                          "aws_secret_access_key": "<redacted>"}}
    status = CliRunner().invoke(cli, ["status", "--output", f"s3://{name}/out/", "--json",
                                      "--storage-option", f"endpoint_url={endpoint}"])
    assert status.exit_code == 0, status.output
    assert json.loads(status.output)["done"] == 3


@pytest.mark.slow
def test_credentials_in_an_input_url_are_not_printed_when_listing_fails(endpoint, tiny_encoder_path):
    result = subprocess.run([LENGTHWISE, "run", "--input", "s3://AKIDINURL:secret-in-url@no-such-bucket-x/in/",
                             "--output", "s3://no-such-bucket-x/out/", "--model", tiny_encoder_path,
                             "--storage-option", f"endpoint_url={endpoint}", "--no-progress"],
                            env={**__import__("os").environ, **CREDENTIALS}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "secret-in-url" not in result.stderr and "AKIDINURL" not in result.stderr, result.stderr
    assert "no-such-bucket-x" in result.stderr
