"""`run --reuse`: a second night with rows edited, added, deleted and moved, in a new partition, reuses
exactly the unchanged rows (bit-identical) and equals a full run within float tolerance (cell for cell at
one row a batch); duplicate texts run once; rows whose error may change are retried; other settings are
refused (exit 2, nothing written)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.offline.config import RunConfig
from pipeline.engines.local import run_job
from pipeline.core.row_hashes import text_hash
from pipeline.offline.reuse import RowHashes, ReusedRows, merge_reused
from pipeline.offline.verify import verify_output


def test_text_hash_is_stable_and_tells_texts_apart():
    assert text_hash("hello") == text_hash(b"hello") == text_hash("hello")
    assert text_hash("hello") != text_hash("hello ") and text_hash(None) is None


def test_hash_files_a_killed_attempt_left_are_removed_for_this_workers_shards_only(tmp_path):
    """A kill between a shard's first block and its commit leaves STEM.hashes.ATTEMPT.tmp in
    text-hashes/; the next claim removes those of its own shards (hive stems too), never a
    committed hash file or another worker's temporary."""
    import fsspec

    from pipeline.offline.manifest import RunManifest
    from pipeline.offline.reuse import remove_stale_hash_temporaries

    folder = tmp_path / "out" / ".lengthwise" / "text-hashes"
    names = ["part-00000.hashes", "part-00000.hashes.0123456789ab.tmp", "dt=1/part-00001.hashes.abcdef012345.tmp",
             "theirs.hashes.0123456789ab.tmp", "part-00000.hashes.notanattempt.tmp"]
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"PAR1 half written")
    manifest = RunManifest(fsspec.filesystem("file"), str(tmp_path / "out"))
    assert remove_stale_hash_temporaries(manifest, ["part-00000", "dt=1/part-00001"]) == 2
    left = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert left == ["part-00000.hashes", "part-00000.hashes.notanattempt.tmp", "theirs.hashes.0123456789ab.tmp"]
    assert remove_stale_hash_temporaries(RunManifest(fsspec.filesystem("file"), str(tmp_path / "none")), ["a"]) == 0


@pytest.mark.slow
def test_a_run_killed_while_writing_hashes_leaves_no_hash_temporary_after_the_rerun(tmp_path, sample_table,
                                                                                      tiny_encoder_path):
    import sys
    from pathlib import Path

    from tests.conftest import kill_when_written, run_in_this_process, write_shards

    write_shards(tmp_path / "in", sample_table.select(["id", "text"]), [200, 200])
    command = [str(Path(sys.executable).parent / "lengthwise"), "run", "--input", str(tmp_path / "in"), "--output",
               str(tmp_path / "out"), "--model", tiny_encoder_path, "--max-length", "64", "--window-rows", "50",
               "--no-progress", "--no-probe", "--tokenize-workers", "0"]
    hashes = tmp_path / "out" / ".lengthwise" / "text-hashes"
    # one row per batch: the first shard's hash file stays open, half written, for many steps
    left = kill_when_written(command + ["--max-batch-rows", "1"], hashes, "*.tmp", 120)
    assert left, "the run was not killed while a hash file was being written"
    # the encoder process removes the files it held open as its run dies; any it could not, the rerun does
    run_in_this_process(command)
    assert not list(hashes.glob("*.tmp"))
    assert sorted(p.name for p in hashes.iterdir()) == ["part-00000.hashes", "part-00001.hashes"]


def test_merge_reused_takes_result_columns_of_reused_rows_only():
    computed = pa.table({"id": [1, 2, 3], "score": [0.0, 0.5, 0.0], "error": ["x", None, "y"]})
    reused = ReusedRows(RowHashes(np.zeros(3, np.int64), pa.array([0, 0, 0], pa.int64())),
                        np.array([True, False, True]), pa.table({"score": [0.1, 0.3], "error": [None, None]}))
    merged = merge_reused(computed, reused)
    assert merged.to_pydict() == {"id": [1, 2, 3], "score": [0.1, 0.5, 0.3], "error": [None, None, None]}
    assert merge_reused(computed, None) is computed


def write_night(root, parts: dict[str, pa.Table]) -> str:
    for partition, table in parts.items():
        (root / partition).mkdir(parents=True, exist_ok=True)
        pq.write_table(table, root / partition / "part-00000.parquet", row_group_size=32)
    return str(root)


def run(input_dir, output, model, **settings) -> dict:
    settings = {"max_batch_rows": 1, **settings}
    config = RunConfig.of(input=(input_dir,), output=str(output), model=model, max_length=128, dtype="float32",
                          tokenize_workers=0, progress=False, **settings)
    return json.loads(run_job(config).to_json())


def read_output(output) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted(output.rglob("*.parquet"))
                            if ".lengthwise" not in p.parts)


@pytest.mark.slow
def test_second_night_reuses_exactly_the_unchanged_rows_and_equals_a_full_run(tmp_path, rows_with_bad_ones,
                                                                                 tiny_encoder_path):
    first = {"region=eu": rows_with_bad_ones.slice(0, 120), "region=us": rows_with_bad_ones.slice(120, 80)}
    night1 = write_night(tmp_path / "night1", first)
    run(night1, tmp_path / "out1", tiny_encoder_path)

    eu = first["region=eu"].to_pylist()
    for position in (5, 40, 77):  # edited texts
        eu[position]["text"] += " (edited)"
    deleted = {eu[10]["id"], eu[11]["id"]}
    eu = [row for row in eu if row["id"] not in deleted]
    eu.insert(3, {"id": "new-1", "text": "a row added tonight"})
    eu.append({"id": "new-2", "text": "another row added tonight"})
    asia = [{"id": f"asia-{i}", "text": f"a text of a new shard, number {i}"} for i in range(30)]
    second = {"region=eu": pa.Table.from_pylist(eu, schema=rows_with_bad_ones.schema), "region=us": first["region=us"],
              "region=asia": pa.Table.from_pylist(asia, schema=rows_with_bad_ones.schema)}
    night2 = write_night(tmp_path / "night2", second)

    summary = run(night2, tmp_path / "out2", tiny_encoder_path, reuse=str(tmp_path / "out1"))
    full = run(night2, tmp_path / "full", tiny_encoder_path)

    error_rows = 2  # the null texts of rows_with_bad_ones have no text hash: computed again (the blank ones are reused)
    unchanged = (120 - 3 - 2) + 80 - error_rows
    assert (summary["reused_rows"], summary["computed_rows"]) == (unchanged, 3 + 2 + 30 + error_rows)
    assert summary["rows"] == full["rows"] == 120 - 2 + 2 + 80 + 30
    assert (summary["error_rows"], summary["truncated_rows"]) == (full["error_rows"], full["truncated_rows"])
    assert full["reused_rows"] == 0 and full["computed_rows"] == full["rows"]
    ours, theirs = read_output(tmp_path / "out2"), read_output(tmp_path / "full")
    assert ours.schema == theirs.schema
    assert ours.equals(theirs), "a reused output must equal a full run cell for cell"
    assert verify_output(None, str(tmp_path / "out2")).complete

    # the third night reuses the second's output (its text hashes were written under --reuse too)
    third = run(night2, tmp_path / "out3", tiny_encoder_path, reuse=str(tmp_path / "out2"))
    assert (third["reused_rows"], third["computed_rows"]) == (summary["rows"] - error_rows, error_rows)
    assert read_output(tmp_path / "out3").equals(theirs)


@pytest.mark.slow
def test_reuse_of_other_settings_is_refused_and_writes_nothing(tmp_path, rows_with_bad_ones, tiny_encoder_path):
    night = write_night(tmp_path / "night", {"region=eu": rows_with_bad_ones.slice(0, 20)})
    run(night, tmp_path / "out1", tiny_encoder_path)
    arguments = ["run", "--input", night, "--model", tiny_encoder_path, "--dtype", "float32", "--tokenize-workers",
                 "0", "--no-progress"]
    result = CliRunner().invoke(cli, [*arguments, "--max-length", "64", "--output", str(tmp_path / "out2"),
                                      "--reuse", str(tmp_path / "out1")])
    assert result.exit_code == 2, result.output
    assert "was made with other settings (max_length: 128 → 64)" in result.output
    assert not (tmp_path / "out2").exists()
    result = CliRunner().invoke(cli, [*arguments, "--max-length", "128", "--output", str(tmp_path / "out1"),
                                      "--reuse", str(tmp_path / "out1")])
    assert result.exit_code == 2 and "is --output itself" in result.output


@pytest.mark.slow
def test_indexed_workers_each_reuse_their_own_shards(tmp_path, rows_with_bad_ones, tiny_encoder_path):
    texts = rows_with_bad_ones.slice(20, 60)  # no error rows
    parts = {f"part={i}": texts.slice(20 * i, 20) for i in range(3)}
    night1 = write_night(tmp_path / "night1", parts)
    run(night1, tmp_path / "out1", tiny_encoder_path)
    edited = parts["part=1"].to_pylist()
    edited[0]["text"] += " (edited)"
    night2 = write_night(tmp_path / "night2", {**parts, "part=1": pa.Table.from_pylist(edited, schema=texts.schema)})
    summaries = [run(night2, tmp_path / "out2", tiny_encoder_path, reuse=str(tmp_path / "out1"), num_shards=2,
                     shard_index=index) for index in (0, 1)]
    assert sum(s["reused_rows"] for s in summaries) == 59 and sum(s["computed_rows"] for s in summaries) == 1
    run(night2, tmp_path / "full", tiny_encoder_path)
    assert read_output(tmp_path / "out2").equals(read_output(tmp_path / "full"))
    assert verify_output(None, str(tmp_path / "out2")).complete


def night_two(night1: dict[str, pa.Table]) -> tuple[dict[str, pa.Table], dict]:
    """Tonight's export of `night1` in a new date partition: 3 texts edited, 2 rows deleted, 2 new, 10 moved to
    the other shard, and one new id whose text is an unchanged row's. Returns the shards and what changed."""
    first, second = night1["part-00000"].to_pylist(), night1["part-00001"].to_pylist()
    for row in (first[5], first[40], second[30]):
        row["text"] += " (edited)"
    edited = {first[5]["id"], first[40]["id"], second[30]["id"]}
    deleted = {first[10]["id"], second[60]["id"]}
    moved = first[50:60]
    first = [row for row in first[:50] + first[60:] if row["id"] not in deleted]
    second = [row for row in second if row["id"] not in deleted] + moved
    second.insert(7, {"id": "new-1", "text": "a row added tonight"})
    first.append({"id": "new-2", "text": "another row added tonight"})
    first.append({"id": "same-text-as-row-20", "text": first[20]["text"]})
    schema = night1["part-00000"].schema
    return ({"dt=2026-11-30/part-00000": pa.Table.from_pylist(first, schema=schema),
             "dt=2026-11-30/part-00001": pa.Table.from_pylist(second, schema=schema)},
            {"edited": edited, "deleted": deleted, "moved": {row["id"] for row in moved}})


def write_files(root, tables: dict[str, pa.Table], row_group_size: int = 32) -> str:
    for name, table in tables.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, root / f"{name}.parquet", row_group_size=row_group_size)
    return str(root)


@pytest.mark.slow
def test_a_night_in_a_new_partition_reuses_every_unchanged_row_and_recomputes_exactly_the_rest(
        tmp_path, rows_with_bad_ones, tiny_encoder_path):
    """Real batching (a window's rows packed by length, several rows a batch): reused rows are bit-identical
    to yesterday's, recomputed ones equal a full run within float tolerance (atol 2e-5)."""
    from tests.conftest import assert_equal_outputs

    night1 = {"part-00000": rows_with_bad_ones.slice(0, 100), "part-00001": rows_with_bad_ones.slice(100, 100)}
    batching = {"max_batch_rows": None, "max_batch_tokens": 2048, "window_rows": 64}
    run(write_files(tmp_path / "night1", {f"dt=2026-11-29/{k}": v for k, v in night1.items()}), tmp_path / "out1",
        tiny_encoder_path, **batching)
    tables, changed = night_two(night1)
    night2 = write_files(tmp_path / "night2", tables)
    summary = run(night2, tmp_path / "out2", tiny_encoder_path, reuse=str(tmp_path / "out1"), **batching)
    full = run(night2, tmp_path / "full", tiny_encoder_path, **batching)

    null_texts = 2  # rows 0 and 150: no text hash, computed again (an error again, without the device)
    rows = 200 - 2 + 3
    assert summary["rows"] == full["rows"] == rows
    assert summary["computed_rows"] == 3 + 2 + null_texts  # edited, new, null texts
    assert summary["reused_rows"] == rows - summary["computed_rows"]
    assert summary["reuse"] == {"reused_by_text": 1, "moved": 10, "new": 2, "edited": 3, "retried": 0, "fixed": 0,
                                "skipped": 0}
    assert not summary["reuse_warning"]

    ours, theirs = read_output(tmp_path / "out2"), read_output(tmp_path / "full")
    assert_equal_outputs(ours, theirs)
    yesterday = read_output(tmp_path / "out1").to_pylist()
    yesterday_by_id = {row["id"]: row["embedding"] for row in yesterday}
    yesterday_by_text = {row["text"]: row["id"] for row in rows_with_bad_ones.to_pylist()}
    tonight = pa.concat_tables(tables.values()).to_pylist()
    for row, computed in zip(ours.to_pylist(), tonight):
        assert row["id"] == computed["id"]
        if row["id"] in changed["edited"] or row["id"].startswith("new-") or computed["text"] is None:
            continue
        source = yesterday_by_text[computed["text"]] if row["id"].startswith("same-text") else row["id"]
        assert row["embedding"] == yesterday_by_id[source], f"{row['id']}: a reused row must be bit-identical"
    assert verify_output(None, str(tmp_path / "out2")).complete


def test_a_low_match_warns_and_says_why():
    from pipeline.offline.summary import low_reuse_warning

    counts = {"new": 950, "edited": 20}
    assert low_reuse_warning(1000, 100, counts, 1000, "y/") == ""  # 10% is enough
    assert low_reuse_warning(1000, 30, counts, 1000, "y/") == (
        "--reuse matched 30 of 1,000 rows (3%): 950 rows have an id y/ does not have; is --id-column the same, "
        "and are ids stable from one export to the next?")
    assert "rows have yesterday's id but another text; is --text-column" in low_reuse_warning(
        1000, 30, {"new": 5, "edited": 965}, 1000, "y/")
    assert "y/ has no done shard with text hashes" in low_reuse_warning(1000, 0, {"new": 1000, "edited": 0}, 0, "y/")


def test_the_summary_line_says_what_reuse_did():
    from pipeline.offline.summary import RunSummary

    summary = RunSummary(rows=1000, reused_rows=900, computed_rows=100, shards=1,
                         reuse={"reused_by_text": 12, "moved": 80, "new": 20, "edited": 50, "retried": 3, "fixed": 2})
    assert summary.to_text().splitlines()[1] == (
        "reused          900 rows from the previous output (80 moved from another shard, 12 by text under another "
        "id); 100 computed: 20 new, 50 edited, 3 retried after an error (2 fixed), 27 without a text")


def test_first_of_each_text_maps_duplicates_to_their_first_eligible_copy():
    from pipeline.offline.windows import first_of_each_text

    hashes = np.array([7, 5, 7, 9, 5, 7, 3], np.int64)
    eligible = np.array([False, True, True, True, True, True, True])  # row 0 had an error: not a source
    assert first_of_each_text(hashes, eligible).tolist() == [0, 1, 2, 3, 1, 2, 6]
    assert first_of_each_text(np.zeros(0, np.int64), np.zeros(0, bool)).tolist() == []
    rng = np.random.default_rng(3)  # many rows, few texts: each row's source is its text's first eligible row
    hashes, eligible = rng.integers(-2**63, 2**63 - 1, 40)[rng.integers(0, 40, 5_000)], rng.random(5_000) < 0.8
    first_eligible = {}
    for row in np.flatnonzero(eligible):
        first_eligible.setdefault(int(hashes[row]), int(row))
    expected = [first_eligible[int(h)] if ok else row for row, (h, ok) in enumerate(zip(hashes, eligible))]
    assert first_of_each_text(hashes, eligible).tolist() == expected


@pytest.mark.slow
def test_duplicate_texts_are_computed_once_and_come_out_identical(tmp_path, rows_with_bad_ones, tiny_encoder_path):
    """One spam text on 20% of the rows, scattered, with real batching: run once per window, copied bit for bit;
    --no-dedupe computes each (and agrees within float tolerance)."""
    from tests.conftest import assert_equal_outputs

    rows = rows_with_bad_ones.to_pylist()
    spam = "WIN A FREE PHONE!!! click the link in my bio"
    for position in range(3, 200, 5):
        rows[position]["text"] = spam
    night = write_files(tmp_path / "in", {"part-00000": pa.Table.from_pylist(rows[:120], schema=rows_with_bad_ones.schema),
                                          "part-00001": pa.Table.from_pylist(rows[120:], schema=rows_with_bad_ones.schema)})
    batching = {"max_batch_rows": None, "max_batch_tokens": 2048, "window_rows": 100}
    once = run(night, tmp_path / "once", tiny_encoder_path, **batching)
    each = run(night, tmp_path / "each", tiny_encoder_path, dedupe=False, **batching)
    windows = 2  # 200 rows, windows of 100: the spam runs once in each
    texts = [[row["text"] for row in rows[w * 100:(w + 1) * 100] if row["text"] and row["text"].strip()]
             for w in range(windows)]
    assert once["deduplicated_rows"] == sum(len(t) - len(set(t)) for t in texts) >= len(range(3, 200, 5)) - windows
    assert each["deduplicated_rows"] == 0
    assert once["rows"] == each["rows"] == 200 and once["error_rows"] == each["error_rows"] == 4
    assert once["real_tokens"] < each["real_tokens"]
    ours = read_output(tmp_path / "once")
    spam_embeddings = {tuple(row["embedding"]) for row in ours.to_pylist() if row["id"] in
                       {rows[p]["id"] for p in range(3, 200, 5)}}
    assert len(spam_embeddings) <= windows
    assert_equal_outputs(ours, read_output(tmp_path / "each"))
    # what tomorrow's --reuse reads is the same either way
    assert pq.read_table(tmp_path / "once/.lengthwise/text-hashes/part-00000.hashes").equals(
        pq.read_table(tmp_path / "each/.lengthwise/text-hashes/part-00000.hashes"))


@pytest.mark.slow
def test_rows_that_ran_out_of_memory_yesterday_are_retried_on_a_reuse_night(tmp_path, monkeypatch,
                                                                             rows_with_bad_ones, tiny_encoder_path):
    """Night 1 on a device out of memory for any batch padded past 40 tokens, even one row: those rows get
    `out of memory even alone …`. Night 2, same input, room on the device: --reuse retries exactly them (and
    the null texts, which have no hash), fixes them, and reuses the rest, blank texts with their error."""
    import jobs.registry
    from tests.conftest import assert_equal_outputs
    from tests.core.test_out_of_memory_backoff import OutOfMemoryAbove

    night = write_files(tmp_path / "in", {"part-00000": rows_with_bad_ones.slice(0, 120),
                                          "part-00001": rows_with_bad_ones.slice(120, 80)})
    batching = {"max_batch_rows": None, "max_batch_tokens": 2048, "probe": False}
    with monkeypatch.context() as patch:
        patch.setitem(jobs.registry.JOBS, "embed", OutOfMemoryAbove(max_rows=10_000, max_padded_length=40))
        first = run(night, tmp_path / "out1", tiny_encoder_path, **batching)
    errors = read_output(tmp_path / "out1")["error"].to_pylist()
    out_of_memory = sum(1 for e in errors if e and e.startswith("out of memory even alone"))
    assert out_of_memory > 10 and first["error_rows"] == out_of_memory + 4

    second = run(night, tmp_path / "out2", tiny_encoder_path, reuse=str(tmp_path / "out1"), **batching)
    assert (second["reuse"]["retried"], second["reuse"]["fixed"]) == (out_of_memory, out_of_memory)
    assert second["computed_rows"] == out_of_memory + 2 and second["error_rows"] == 4
    assert "retried after an error" in run_text_of(second)
    assert_equal_outputs(read_output(tmp_path / "out2"), read_output(run_full(night, tmp_path, tiny_encoder_path,
                                                                              **batching)))
    third = run(night, tmp_path / "out3", tiny_encoder_path, reuse=str(tmp_path / "out2"), **batching)
    assert third["reuse"]["retried"] == 0 and third["computed_rows"] == 2  # fixed rows are reused from now on


def run_text_of(summary: dict) -> str:
    from pipeline.offline.summary import RunSummary

    return RunSummary(**summary).to_text()


def run_full(night, tmp_path, model, **settings):
    run(night, tmp_path / "full", model, **settings)
    return tmp_path / "full"


@pytest.mark.slow
def test_dedupe_is_on_by_default_and_off_by_flag_environment_or_config_file(tmp_path, tiny_encoder_path,
                                                                            monkeypatch):
    rows = pa.table({"id": [f"r{i}" for i in range(12)], "text": ["same text"] * 6 + [f"text {i}" for i in range(6)]})
    night = write_files(tmp_path / "in", {"part-00000": rows})
    (tmp_path / "job.toml").write_text("dedupe = false\n")
    arguments = ["run", "--input", night, "--model", tiny_encoder_path, "--dtype", "float32", "--max-length", "32",
                 "--tokenize-workers", "0", "--no-progress", "--no-probe"]

    def deduplicated(name: str, *extra: str, env: dict | None = None) -> int:
        result = CliRunner().invoke(cli, [*arguments, "--output", str(tmp_path / name), "--summary-json",
                                          str(tmp_path / f"{name}.json"), *extra], env=env)
        assert result.exit_code == 0, result.output
        return json.loads((tmp_path / f"{name}.json").read_text())["deduplicated_rows"]

    assert deduplicated("default") == 5
    assert deduplicated("flag", "--no-dedupe") == 0
    assert deduplicated("env", env={"LENGTHWISE_DEDUPE": "false"}) == 0
    assert deduplicated("toml", "--config", str(tmp_path / "job.toml")) == 0
    assert deduplicated("flag-wins", "--config", str(tmp_path / "job.toml"), "--dedupe") == 5
