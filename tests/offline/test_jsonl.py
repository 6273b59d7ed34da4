"""JSONL shards (`.jsonl`, `.jsonl.gz`): rows, row errors, bad lines, the byte-scan count, the line limit;
and end to end: a JSONL run equals the Parquet run of the same rows, resumes, reuses, and `status`/`verify`."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import UsageError
from pipeline.offline.footer import ROW_GROUP_BYTES_VARIABLE
from pipeline.offline.readers import Columns, jsonl
from pipeline.offline.source import list_shards, output_stem, read_blocks
from tests.conftest import run_in_this_process


def write_jsonl(path: Path, rows, end: str = "\n") -> Path:
    """One JSON object a line (a row given as a string is written as it is: a bad line); gzip for `.gz`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + end for row in rows)
    path.write_bytes(gzip.compress(text.encode()) if path.name.endswith(".gz") else text.encode())
    return path


def rows_of(blocks, column: str) -> list:
    return [value for block in blocks if block.failure is None for value in getattr(block, column).to_pylist()]


def errors_of(blocks) -> list:
    return [error for block in blocks if block.failure is None
            for error in (block.errors.to_pylist() if block.errors is not None else [None] * block.num_rows)]


ODD_LINES = ['{"id": "a", "text": "hello", "tag": "x"}', "", "  \t", '{"id": "b", "text": 5}',
             '{"id": 3, "text": "an integer id in a shard of string ids"}', '{"text": "no id"}',
             '{"id": "e", "text": null, "tag": {"nested": [1, 2]}}', '{"id": "f", "text": "\\ud800"}',
             '{"id": "g", "id2": 1, "tag": 7}', '{"id": "h", "text": "last", "tag": true}']


@pytest.mark.parametrize("name", ["odd.jsonl", "odd.jsonl.gz"])
def test_each_row_reads_in_place_with_its_error_and_blank_lines_hold_none(tmp_path, name):
    write_jsonl(tmp_path / name, ODD_LINES, end="\r\n")
    [shard] = list_shards([str(tmp_path)], "id", "text", keep_columns=["tag"])
    assert (shard.stem, shard.num_rows, shard.problem) == ("odd", 8, None)
    blocks = list(read_blocks([shard], "id", "text", block_rows=3, keep_columns=["tag"]))
    assert [(b.first_row, b.num_rows, b.is_last_of_shard) for b in blocks] == [(0, 3, False), (3, 3, False),
                                                                                (6, 2, True)]
    assert rows_of(blocks, "ids") == ["a", "b", None, None, "e", "f", "g", "h"]
    assert rows_of(blocks, "texts") == ["hello", None, None, None, None, None, None, "last"]
    assert errors_of(blocks) == [None, "'text' is a JSON number, not a string",
                                 "id is an integer, but this shard's ids are strings (as its first id is)",
                                 "line has no key 'id'", None, "'text' is not valid Unicode (a lone surrogate)",
                                 "line has no key 'text'", None]  # e's null text: `text is null`, as for Parquet
    assert [v for b in blocks for v in b.kept["tag"].to_pylist()] == ["x", None, None, None, '{"nested": [1, 2]}',
                                                                     None, "7", "true"]


def test_integer_ids_stay_integers_and_a_string_among_them_is_that_rows_error(tmp_path):
    write_jsonl(tmp_path / "ints.jsonl", [{"text": "no id first"}, {"id": 7, "text": "a"}, {"id": "8", "text": "b"},
                                         {"id": 2 ** 70, "text": "c"}, {"id": 1.5, "text": "d"}, {"id": True, "text": "e"}])
    [block] = read_blocks(list_shards([str(tmp_path)], "id", "text"), "id", "text", block_rows=10)
    assert block.ids.type == pa.int64() and block.ids.to_pylist() == [None, 7, None, None, None, None]
    assert block.errors.to_pylist() == ["line has no key 'id'", None,
                                        "id is a string, but this shard's ids are integers (as its first id is)",
                                        "id is an integer beyond 64 bits", "id is a JSON number, not a string or an "
                                        "integer", "id is a JSON boolean, not a string or an integer"]


def lines_with_text(data: bytes) -> int:
    """The obviously right count: lines with a byte other than space, tab, CR."""
    return sum(1 for line in data.split(b"\n") if line.strip(b" \t\r"))


@pytest.mark.parametrize("seed", range(6))
def test_the_byte_scan_counts_what_splitting_lines_counts_across_chunk_edges(tmp_path, monkeypatch, seed):
    """The fast count (newlines, blank lines only where a chunk may hold one) against the slow obvious one,
    with chunks a few bytes long so that lines, blank runs and CRLFs straddle their edges."""
    rng = random.Random(seed)
    pieces = ['{"id": 1, "text": "x"}', "", " ", "\t\r", '{"id": 2, "text": " spaced "}', "\r", '  {"id": 3}']
    data = "\n".join(rng.choice(pieces) for _ in range(300)) + rng.choice(["", "\n", "\n\n", " "])
    (tmp_path / "rows.jsonl").write_bytes(data.encode())
    for chunk_bytes in (1, 2, 3, 7, 64, 1 << 20):
        monkeypatch.setattr(jsonl, "CHUNK_BYTES", chunk_bytes)
        with open(tmp_path / "rows.jsonl", "rb") as f:
            facts = jsonl.count_rows(f, "rows.jsonl", Columns("id", ("text",)))
        assert facts.num_rows == lines_with_text(data.encode()), chunk_bytes
        with open(tmp_path / "rows.jsonl", "rb") as f:
            _, batches = jsonl.open_batches(f, "rows.jsonl", Columns("id", ("text",)), 50)
            assert sum(batch.num_rows for batch in batches) == facts.num_rows


@pytest.mark.parametrize("line, said", [
    ('{"id": "x", "text": "cut', "line 3 is not JSON (Unterminated string starting at: column 21)"),
    ('["id", "text"]', "line 3 is a JSON array, not an object; each line must be one object with the id and text keys"),
    ("[" * 100_000, "line 3 is not JSON this reader takes (nested too deeply)"),
])
def test_a_line_that_is_not_an_object_fails_its_shard_naming_the_file_and_line(tmp_path, line, said):
    write_jsonl(tmp_path / "a.jsonl", [{"id": "a1", "text": "fine"}])
    bad = write_jsonl(tmp_path / "b.jsonl", [{"id": "b1", "text": "fine"}, "", line, {"id": "b2", "text": "fine"}])
    shards = list_shards([str(tmp_path)], "id", "text")
    assert [s.problem for s in shards] == [None, None]  # found while streaming, as a corrupt Parquet page is
    blocks = list(read_blocks(shards, "id", "text", block_rows=1))
    assert rows_of(blocks, "ids") == ["a1"]  # b1 was held back: a failed shard's blocks go nowhere
    assert [b.failure for b in blocks if b.failure] == [f"file://{bad}: {said}; fix or remove that line"
                                                        if "not JSON" in said else f"file://{bad}: {said}"]
    assert not any(b.is_last_of_shard for b in blocks if b.shard_index == 1)  # never committed


def test_bytes_that_are_not_utf8_fail_the_shard_and_damaged_gzip_is_unreadable(tmp_path):
    (tmp_path / "latin1.jsonl").write_bytes(b'{"id": "a", "text": "ok"}\n{"id": "b", "text": "caf\xe9"}\n')
    data = gzip.compress(b'{"id": "a", "text": "ok"}\n' * 2000)
    (tmp_path / "cut.jsonl.gz").write_bytes(data[:len(data) // 2])
    (tmp_path / "plain.jsonl.gz").write_bytes(b'{"id": "a", "text": "not gzipped"}\n')
    shards = {s.stem: s for s in list_shards([str(tmp_path)], "id", "text")}
    assert shards["cut"].problem.startswith(f"cannot read file://{tmp_path / 'cut.jsonl.gz'} as JSONL (damaged gzip")
    assert shards["plain"].problem.startswith(f"cannot read file://{tmp_path / 'plain.jsonl.gz'} as JSONL (Not a")
    [failure] = [b.failure for b in read_blocks([shards["latin1"]], "id", "text", 10) if b.failure]
    assert failure == f"file://{tmp_path / 'latin1.jsonl'}: line 2 is not UTF-8 (byte 25); fix or remove that line"


def test_columns_are_checked_from_the_first_lines_as_parquet_columns_are(tmp_path):
    write_jsonl(tmp_path / "body.jsonl", [{"id": "a", "body": "the text under another key"}])
    write_jsonl(tmp_path / "good.jsonl", [{"id": "a", "text": "a text", "body": "a body"}])
    shard, good = list_shards([str(tmp_path)], "id", "text")
    assert good.problem is None and shard.problem == f"shard {shard.url} has no column 'text' (columns: id, body); set --text-column"
    with pytest.raises(UsageError, match=r"has no column 'tag' to keep \(its columns: id, body\)"):
        list_shards([str(tmp_path / "body.jsonl")], "id", "body", keep_columns=["tag"])
    (tmp_path / "empty.jsonl").write_bytes(b"\n")
    empty = list_shards([str(tmp_path / "empty.jsonl")], "id", "text")
    [block] = read_blocks(empty, "id", "text", block_rows=10)
    assert (empty[0].num_rows, empty[0].problem, block.num_rows, block.is_last_of_shard) == (0, None, 0, True)


def test_outputs_are_named_after_the_input_without_its_suffix_and_must_not_collide(tmp_path):
    assert [output_stem(name) for name in ("dt=1/x.jsonl.gz", "x.jsonl", "x.parquet", "x.json")] == [
        "dt=1/x", "x", "x", "x.json"]
    write_jsonl(tmp_path / "x.jsonl", [{"id": "a", "text": "t"}])
    pq.write_table(pa.table({"id": ["b"], "text": ["t"]}), tmp_path / "x.parquet")
    with pytest.raises(UsageError, match="would both write x.parquet"):
        list_shards([str(tmp_path)], "id", "text")


@pytest.mark.parametrize("text_bytes", [300, 3 << 20])  # a line within one chunk, and one across many
def test_a_line_over_the_limit_fails_its_shard_from_the_count_and_in_the_stream(tmp_path, monkeypatch, text_bytes):
    limit = text_bytes // 2
    monkeypatch.setenv(ROW_GROUP_BYTES_VARIABLE, str(limit))
    path = write_jsonl(tmp_path / "long.jsonl.gz", [{"id": "a", "text": "short"}, {"id": "b", "text": "x" * text_bytes},
                                                    {"id": "c", "text": "short"}])
    write_jsonl(tmp_path / "short.jsonl", [{"id": "d", "text": "short"}])
    shard, short = list_shards([str(tmp_path)], "id", "text")
    assert short.problem is None
    said = (f"file://{path}: line 2 is longer than the {jsonl.size_text(limit)} a line may take "
            f"({ROW_GROUP_BYTES_VARIABLE}, the limit of a Parquet row group); split that row")
    assert shard.problem == said
    from pipeline.offline.source import Shard

    blocks = list(read_blocks([Shard(shard.url, shard.stem, 3)], "id", "text", block_rows=1))  # as if it had passed
    assert blocks[-1].failure == said and not any(b.is_last_of_shard for b in blocks)


class BreaksOnceAfter:
    """JSONL batches that raise a transient error after `after` batches, the first time the file is opened."""

    opened = 0

    def __init__(self, open_batches, after: int):
        self.open_batches, self.after = open_batches, after

    def __call__(self, *args):
        BreaksOnceAfter.opened += 1
        schema, batches = self.open_batches(*args)

        def breaking():
            for count, batch in enumerate(batches):
                if BreaksOnceAfter.opened == 1 and count == self.after:
                    raise TimeoutError("Read timed out (injected)")
                yield batch

        return schema, breaking()


def test_a_dropped_connection_mid_jsonl_reopens_and_carries_on_without_gaps(tmp_path, monkeypatch):
    import pipeline.offline.source as source

    rows = [{"id": f"r{i}", "text": f"text {i}"} for i in range(500)]
    write_jsonl(tmp_path / "big.jsonl.gz", rows)
    shards = list_shards([str(tmp_path)], "id", "text")
    BreaksOnceAfter.opened = 0
    monkeypatch.setattr(jsonl, "open_batches", BreaksOnceAfter(jsonl.open_batches, after=3))
    monkeypatch.setattr(source, "backoff_delay_s", lambda attempt: 0.0)
    blocks = list(read_blocks(shards, "id", "text", block_rows=40))
    assert BreaksOnceAfter.opened == 2, "the error was not injected or the file was not reopened"
    assert rows_of(blocks, "ids") == [row["id"] for row in rows] and not any(b.failure for b in blocks)


@pytest.mark.slow
def test_a_gzip_bomb_of_one_line_is_refused_by_the_count_without_holding_it(tmp_path):
    """300 MB of one line in 300 kB of gzip, a 64 MiB limit: refused at the count, which holds a chunk."""
    path = tmp_path / "bomb.jsonl.gz"
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(b'{"id": "b", "text": "')
        for _ in range(300):
            f.write(b"a" * (1 << 20))
        f.write(b'"}\n')
    assert path.stat().st_size < 2 << 20
    write_jsonl(tmp_path / "good.jsonl", [{"id": "a", "text": "short"}])
    script = f"""
from pipeline.offline.source import list_shards, read_blocks, Shard
def peak_kib():
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1])
base = peak_kib()
shard, good = list_shards(["{tmp_path}"], "id", "text")
counted = peak_kib()
blocks = list(read_blocks([Shard(shard.url, shard.stem, 1)], "id", "text", 10))
print(counted - base, peak_kib() - base)
print(shard.problem)
print(blocks[-1].failure)
"""
    finished = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                              env={**os.environ, ROW_GROUP_BYTES_VARIABLE: str(64 << 20)},
                              cwd=Path(__file__).resolve().parents[2])
    grown_kib, problem, failure = finished.stdout.splitlines()
    counted_kib, streamed_kib = map(int, grown_kib.split())
    assert problem.endswith("line 1 is longer than the 67.1 MB a line may take (LENGTHWISE_MAX_ROW_GROUP_BYTES, "
                            "the limit of a Parquet row group); split that row"), finished.stderr[-2000:]
    assert failure == problem  # the stream, too, stops at the limit
    # the count holds a chunk; the stream holds up to the limit of the line it refuses, never the 300 MB
    assert counted_kib < 20_000 and streamed_kib < 120_000, (counted_kib, streamed_kib)


def run_cli(*arguments: str):
    from click.testing import CliRunner

    from pipeline.cli import cli

    return CliRunner().invoke(cli, list(arguments))


def run_over(source: Path, output: Path, model: str, *extra: str):
    return run_cli("run", "--input", str(source), "--output", str(output), "--model", model, "--tokenize-workers", "0",
                   "--dtype", "float32", "--compile", "off", "--max-length", "128", "--no-progress", *extra)


def outputs(folder: Path) -> dict[str, pa.Table]:
    return {p.name: pq.read_table(p) for p in sorted(folder.glob("*.parquet"))}


@pytest.fixture(scope="module")
def night(rows_with_bad_ones) -> list[dict]:
    """200 rows (null, empty and blank texts among them) with a kept `source` column."""
    return [{**row, "source": f"feed-{i % 3}"} for i, row in enumerate(rows_with_bad_ones.to_pylist())]


@pytest.mark.slow
def test_a_jsonl_run_equals_the_parquet_run_of_the_same_rows_cell_for_cell(tmp_path, night, tiny_encoder_path):
    """Three shards as Parquet, and as .jsonl, .jsonl.gz and Parquet mixed in one folder: the same outputs,
    named after the inputs; `status` and `verify` read the JSONL input as they read Parquet."""
    parts = [night[:80], night[80:150], night[150:]]
    (tmp_path / "parquet").mkdir()
    for index, rows in enumerate(parts):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "parquet" / f"part-{index:05d}.parquet")
    write_jsonl(tmp_path / "mixed" / "part-00000.jsonl", parts[0])
    write_jsonl(tmp_path / "mixed" / "part-00001.jsonl.gz", parts[1])
    pq.write_table(pa.Table.from_pylist(parts[2]), tmp_path / "mixed" / "part-00002.parquet")
    for name in ("parquet", "mixed"):
        result = run_over(tmp_path / name, tmp_path / f"{name}-out", tiny_encoder_path, "--keep-columns", "source")
        assert result.exit_code == 0, result.output
    expected, got = outputs(tmp_path / "parquet-out"), outputs(tmp_path / "mixed-out")
    assert list(got) == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"] == list(expected)
    for name in expected:
        assert got[name].equals(expected[name]), name
    assert got["part-00000.parquet"]["error"].to_pylist().count(None) < 80  # the bad texts are row errors here too

    status = run_cli("status", "--output", str(tmp_path / "mixed-out"))
    assert status.exit_code == 0 and "3 of 3 shards done, 0 failed, 0 pending; 200 of 200 rows done" in \
        status.output, status.output
    verified = run_cli("verify", "--output", str(tmp_path / "mixed-out"))
    assert verified.exit_code == 0 and "complete: 3 of 3 shards agree with the input; 200 rows" in verified.output, \
        verified.output
    write_jsonl(tmp_path / "mixed" / "part-00000.jsonl", parts[0][:-1])  # a row lost upstream: verify says which
    verified = run_cli("verify", "--output", str(tmp_path / "mixed-out"))
    assert verified.exit_code == 1 and f"1 row(s) extra: ids {parts[0][-1]['id']!r}" in verified.output, \
        verified.output


@pytest.mark.slow
def test_a_bad_line_fails_its_shard_with_exit_1_and_row_errors_commit_with_their_shard(tmp_path, tiny_encoder_path):
    good = write_jsonl(tmp_path / "in" / "a-good.jsonl", [{"id": "a1", "text": "a fine text"}, {"id": "a2"},
                                                          {"id": "a3", "text": ["not", "a", "string"]}])
    bad = write_jsonl(tmp_path / "in" / "b-bad.jsonl.gz", [{"id": "b1", "text": "fine"}, "{'id': 'b2'}"])
    pq.write_table(pa.table({"id": ["c1"], "text": ["a Parquet shard beside them"]}), tmp_path / "in" / "c.parquet")
    result = run_over(tmp_path / "in", tmp_path / "out", tiny_encoder_path)
    assert result.exit_code == 1, result.output
    written = outputs(tmp_path / "out")
    assert list(written) == ["a-good.parquet", "c.parquet"] and good.exists()
    assert written["a-good.parquet"]["error"].to_pylist() == [None, "line has no key 'text'",
                                                               "'text' is a JSON array, not a string"]
    marker = json.loads((tmp_path / "out" / ".lengthwise" / "shards" / "b-bad.json").read_text())
    assert marker["status"] == "failed" and marker["error"] == (
        f"file://{bad}: line 2 is not JSON (Expecting property name enclosed in double quotes: column 2); fix or "
        "remove that line")
    assert "1 shard(s) failed" in result.output


@pytest.mark.slow
def test_a_jsonl_run_stopped_by_sigterm_resumes_to_the_outputs_of_an_uninterrupted_run(tmp_path, sample_table,
                                                                                      tiny_encoder_path):
    import signal
    import time

    rows = [{"id": f"{k}/{row['id']}", "text": row["text"]} for k in range(5) for row in sample_table.to_pylist()]
    for index in range(6):
        write_jsonl(tmp_path / "in" / f"part-{index:05d}.jsonl.gz", rows[index * 150:(index + 1) * 150])
    command = [str(Path(sys.executable).parent / "lengthwise"), "run", "--input", str(tmp_path / "in"), "--model",
               tiny_encoder_path, "--max-length", "64", "--max-batch-rows", "1", "--window-rows", "100",
               "--no-progress", "--no-probe", "--tokenize-workers", "0", "--output"]
    run_in_this_process(command + [str(tmp_path / "clean")])
    process = subprocess.Popen(command + [str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    markers = tmp_path / "out" / ".lengthwise" / "shards"
    deadline = time.monotonic() + 120
    while not (markers.exists() and any(markers.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    done = len(list(markers.iterdir()))
    assert 1 <= done < 6, done
    assert f"{done} of 6 shards already done, resuming" in run_in_this_process(command + [str(tmp_path / "out")])
    expected, got = outputs(tmp_path / "clean"), outputs(tmp_path / "out")
    assert list(got) == list(expected) and all(got[name].equals(expected[name]) for name in expected)


@pytest.mark.slow
def test_reuse_of_a_previous_jsonl_output_takes_exactly_the_unchanged_rows(tmp_path, night, tiny_encoder_path):
    """Tonight's export renames its shards (.jsonl.gz now), edits two texts, drops one row and adds one: the rest
    comes from last night's output, and the result equals a full run cell for cell."""
    write_jsonl(tmp_path / "night1" / "export-a.jsonl", night[:120])
    write_jsonl(tmp_path / "night1" / "export-b.jsonl", night[120:])
    tonight = [dict(row) for row in night if row["id"] != night[7]["id"]]
    for position in (3, 150):
        tonight[position]["text"] += " (edited)"
    tonight.insert(50, {"id": "new-1", "text": "a row added tonight", "source": "feed-0"})
    write_jsonl(tmp_path / "night2" / "2026-12-05-a.jsonl.gz", tonight[:100])
    write_jsonl(tmp_path / "night2" / "2026-12-05-b.jsonl.gz", tonight[100:])
    one_row_batches = ("--max-batch-rows", "1", "--summary-json")
    assert run_over(tmp_path / "night1", tmp_path / "out1", tiny_encoder_path, *one_row_batches,
                    str(tmp_path / "s1.json")).exit_code == 0
    reused = run_over(tmp_path / "night2", tmp_path / "out2", tiny_encoder_path, *one_row_batches,
                      str(tmp_path / "s2.json"), "--reuse", str(tmp_path / "out1"))
    assert reused.exit_code == 0, reused.output
    full = run_over(tmp_path / "night2", tmp_path / "full", tiny_encoder_path, *one_row_batches,
                    str(tmp_path / "s3.json"))
    assert full.exit_code == 0, full.output
    summary = json.loads((tmp_path / "s2.json").read_text())
    null_texts = sum(row["text"] is None for row in tonight)  # no text hash: computed again
    assert (summary["reused_rows"], summary["computed_rows"]) == (200 - 1 - 2 - null_texts, 2 + 1 + null_texts)
    ours, theirs = outputs(tmp_path / "out2"), outputs(tmp_path / "full")
    assert list(ours) == ["2026-12-05-a.parquet", "2026-12-05-b.parquet"] == list(theirs)
    assert all(ours[name].equals(theirs[name]) for name in theirs), "a reused output must equal a full run"
