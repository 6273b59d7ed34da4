"""The whole pipeline: every row once, in order, and outputs that do not depend on batching."""

import dataclasses

import numpy as np
import pyarrow as pa
import pytest

from pipeline.offline.windows import group_into_windows
from pipeline.offline.source import RowBlock
from tests.conftest import run_to_table

SETTINGS = {
    "one row at a time": dict(max_batch_rows=1),
    "small token budget": dict(max_batch_tokens=300),
    "large token budget": dict(max_batch_tokens=16384, max_batch_rows=4096),
    "few rows per batch, small windows": dict(max_batch_rows=7, window_rows=33),
    "two tokenizer workers": dict(tokenize_workers=2, window_rows=64),
}
LAYOUTS = {"one shard": [200], "three shards": [60, 70, 70], "with a tiny and an empty shard": [1, 99, 0, 100]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("setting", SETTINGS)
def test_outputs_do_not_depend_on_batching_workers_or_shards(tmp_path, rows_with_bad_ones, tiny_encoder_path,
                                                             baseline, setting, layout):
    expected, _ = baseline
    output, summary = run_to_table(tmp_path, "run", rows_with_bad_ones, LAYOUTS[layout], model=tiny_encoder_path,
                                   max_length=128, **SETTINGS[setting])
    assert output["id"].to_pylist() == rows_with_bad_ones["id"].to_pylist()
    assert output["error"].to_pylist() == expected["error"].to_pylist()
    assert output["truncated"].to_pylist() == expected["truncated"].to_pylist()
    ours, theirs = output["embedding"].to_pylist(), expected["embedding"].to_pylist()
    assert [v is None for v in ours] == [v is None for v in theirs]
    good = [i for i, v in enumerate(theirs) if v is not None]
    np.testing.assert_allclose(np.array([ours[i] for i in good]), np.array([theirs[i] for i in good]), atol=2e-5)
    assert summary["rows"] == 200 and summary["error_rows"] == 4


def test_bad_rows_get_errors_and_null_results_in_place(baseline):
    output, summary = baseline
    errors = output["error"].to_pylist()
    assert {i: e for i, e in enumerate(errors) if e} == {
        0: "text is null", 17: "text is empty or whitespace only", 99: "text is empty or whitespace only",
        150: "text is null"}
    embeddings = output["embedding"].to_pylist()
    assert [i for i, v in enumerate(embeddings) if v is None] == [0, 17, 99, 150]
    assert output.schema.field("embedding").type == pa.list_(pa.float32(), 32)
    assert output.column_names == ["id", "embedding", "truncated", "error"]


def test_summary_counts_tokens_and_stages(baseline):
    _, summary = baseline
    assert summary["rows"] == 200 and summary["shards"] == 1
    assert summary["truncated_rows"] >= 1  # the sample has docstrings longer than 128 tokens
    assert 0 < summary["real_tokens"] <= summary["padded_tokens"]
    assert summary["padding_efficiency"] == pytest.approx(summary["real_tokens"] / summary["padded_tokens"])
    assert set(summary["stage_s"]) == {"setup", "read", "tokenize", "collate", "wait_for_batch", "forward", "write"}
    # what setup spent its time on, in the order it ran; the tokenizer pool started before the model loaded
    assert list(summary["setup_steps"]) == ["shards", "model code and dtype", "output check", "tokenizer",
                                            "model load", "compile decision", "batch plan", "output claim",
                                            "tokenizer pool", "other"]
    assert sum(summary["setup_steps"].values()) == pytest.approx(summary["stage_s"]["setup"], abs=0.01)
    assert 0 < summary["device_busy_fraction"] <= 1
    assert summary["rows_per_s"] > 0 and summary["tokens_per_s"] > 0


def test_windows_hold_exactly_window_rows_and_keep_shard_ends():
    def block(shard, first, n, last):
        ids = pa.array([f"{shard}-{first + i}" for i in range(n)])
        return RowBlock(shard, first, ids, ids, last)

    blocks = [block(0, 0, 5, False), block(0, 5, 2, True), block(1, 0, 0, True), block(2, 0, 6, True)]
    windows = list(group_into_windows(blocks, 4))
    assert [sum(b.num_rows for b in w) for w in windows] == [4, 4, 4, 1]
    flat = [b for w in windows for b in w]
    assert [i for b in flat for i in b.ids.to_pylist()] == [i for b in blocks for i in b.ids.to_pylist()]
    assert [(b.shard_index, b.first_row) for b in flat if b.is_last_of_shard] == [(0, 5), (1, 0), (2, 5)]


def test_a_window_spanning_shards_is_cut_after_a_shards_last_row_into_parts_of_a_minimum_size():
    from pipeline.core.tokenize import EncodedRows
    from pipeline.offline.windows import Window, window_parts

    sizes = [300, 100, 100, 500, 200]  # five shards in one 1,200-row window
    blocks = [RowBlock(index, 0, pa.array(range(rows)), pa.array(["x"] * rows), True)
              for index, rows in enumerate(sizes)]
    rows = sum(sizes)
    window = Window(blocks, EncodedRows(np.zeros(rows, np.int32), np.arange(rows + 1), np.zeros(rows, bool),
                                        [None] * rows, 0.0))
    parts = window_parts(window, min_rows=200)
    assert [(p.first_block, p.end_block, p.start_row, p.end_row) for p in parts] == [
        (0, 1, 0, 300), (1, 3, 300, 500), (3, 4, 500, 1000), (4, 5, 1000, 1200)]
    assert [(p.start_row, p.end_row) for p in window_parts(window, min_rows=1)] == [
        (0, 300), (300, 400), (400, 500), (500, 1000), (1000, 1200)]
    assert len(window_parts(window, min_rows=5000)) == 1
    # a window inside one long shard is one part, whatever the minimum
    inside = Window([dataclasses.replace(blocks[0], is_last_of_shard=False)], EncodedRows(
        np.zeros(300, np.int32), np.arange(301), np.zeros(300, bool), [None] * 300, 0.0))
    assert [(p.start_row, p.end_row) for p in window_parts(inside, min_rows=1)] == [(0, 300)]


def test_a_tokenizer_pool_started_ahead_is_stopped_when_the_claim_fails(tmp_path, rows_with_bad_ones,
                                                                         tiny_encoder_path, monkeypatch):
    """The local engine starts its tokenizer processes before the model loads; a run that never
    comes (here: the output's lock refused) must not leave them behind in the caller's process."""
    import psutil

    from pipeline.core.errors import UsageError
    from pipeline.offline.config import RunConfig
    from pipeline.engines.local import run_job
    from pipeline.offline.manifest import RunManifest
    from tests.conftest import write_shards

    def refuse(self, slot, lease_s):
        raise UsageError("another run holds this output")

    monkeypatch.setattr(RunManifest, "acquire_lock", refuse)
    write_shards(tmp_path / "in", rows_with_bad_ones, [200])
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(UsageError, match="another run holds"):
        run_job(RunConfig.of(input=(str(tmp_path / "in"),), output=str(tmp_path / "out"), model=tiny_encoder_path,
                             progress=False, tokenize_workers=2, max_length=128, probe=False))
    left = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert [c for c in left if "resource_tracker" not in c] == []  # multiprocessing's tracker stays by design


def test_auto_windows_hold_sixteen_batches_of_the_row_limit_within_bounds():
    from pipeline.core.settings import auto_window_rows

    assert [auto_window_rows(rows) for rows in (1, 512, 1000, 4096, 16384)] == [8192, 8192, 16000, 65536, 65536]


@pytest.mark.slow
def test_a_run_scales_an_auto_window_with_its_row_limit_and_keeps_an_explicit_one(baseline, tmp_path,
                                                                                   rows_with_bad_ones,
                                                                                   tiny_encoder_path):
    assert baseline[1]["settings"]["window_rows"] == 8192  # the CPU's 512 rows
    for name, settings, window in (("wide", dict(max_batch_rows=2048), 32768),
                                   ("explicit", dict(max_batch_rows=2048, window_rows=33), 33)):
        output, summary = run_to_table(tmp_path, name, rows_with_bad_ones, [200], model=tiny_encoder_path,
                                       max_length=128, **settings)
        assert summary["settings"]["window_rows"] == window and output["id"].to_pylist() == rows_with_bad_ones[
            "id"].to_pylist()


def test_auto_tokenizer_workers_leave_a_cuda_run_three_cores_for_its_own_threads():
    from pipeline.core.settings import tokenize_workers_for

    assert [tokenize_workers_for(None, "cuda", cores) for cores in (16, 4, 2)] == [13, 1, 1]
    assert tokenize_workers_for(None, "cpu", cores=16) == 16  # the forward waits while a window is tokenized
    assert (tokenize_workers_for(0, "cuda", cores=16), tokenize_workers_for(20, "cuda", cores=16)) == (0, 20)


def test_output_files_compress_all_but_float_vectors(tmp_path, rows_with_bad_ones, tiny_encoder_path):
    """zstd on the id, truncated and error columns; the embedding's floats uncompressed (zstd saved 8% of their
    bytes and cost the writer a third of its rows/s: docs/performance.md, "The output writer")."""
    import pyarrow.parquet as pq

    run_to_table(tmp_path, "codec", rows_with_bad_ones.slice(0, 20), [20], model=tiny_encoder_path, max_length=32)
    row_group = pq.read_metadata(tmp_path / "codec-out" / "part-00000.parquet").row_group(0)
    codecs = {row_group.column(i).path_in_schema: row_group.column(i).compression
              for i in range(row_group.num_columns)}
    assert codecs == {"id": "ZSTD", "embedding.list.element": "UNCOMPRESSED", "truncated": "ZSTD", "error": "ZSTD"}
