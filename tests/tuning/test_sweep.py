"""The sweep: CSV, recommendation, regression check, plot, and a real sweep end to end."""

import csv
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from jobs.embed import EmbedJob
from pipeline.core.buckets import bucket_bounds, plan_batches
from pipeline.cli import cli
from pipeline.core.device import padding_multiple
from pipeline.core.errors import UsageError
from pipeline.tuning.sweep import LevelSettings, measure_level, read_sample
from pipeline.offline.source import list_shards
from pipeline.tuning.levels import (LevelResult, compare_sweeps, markdown_table, plot_sweep, read_sweep_csv,
                                    recommend, sample_positions, write_sweep_csv)
from pipeline.core.tokenize import TokenizerPool, load_tokenizer_spec
from tests.conftest import SAMPLE_DIR

GIB, MIB = 2**30, 2**20

DOCUMENTED_COLUMNS = ["level", "rows", "total_s", "rows_per_s", "tokens_per_s", "padding_efficiency",
                      "batch_latency_ms_avg", "batch_latency_ms_p50", "batch_latency_ms_p95", "batch_latency_ms_p99",
                      "batch_latency_ms_max", "row_latency_ms_p50", "row_latency_ms_p95", "row_latency_ms_p99",
                      "row_latency_ms_max", "peak_device_bytes", "peak_rss_bytes", "batches", "oom_splits"]


def level(value: int, rows_per_s: float, p99_ms: float = 100.0, peak: int = 100 * MIB, status: str = "ok",
          splits: int = 0) -> LevelResult:
    return LevelResult(level=value, status=status, rows=1000, total_s=1000 / rows_per_s, rows_per_s=rows_per_s,
                       tokens_per_s=rows_per_s * 50, padding_efficiency=0.98, batch_latency_ms_avg=p99_ms / 2,
                       batch_latency_ms_p50=p99_ms / 2, batch_latency_ms_p95=p99_ms * 0.9,
                       batch_latency_ms_p99=p99_ms, batch_latency_ms_max=p99_ms, row_latency_ms_p50=p99_ms / 2,
                       row_latency_ms_p95=p99_ms * 0.9, row_latency_ms_p99=p99_ms, row_latency_ms_max=p99_ms,
                       peak_device_bytes=peak, peak_rss_bytes=peak + GIB, batches=10, oom_splits=splits)


# ── recommendation ─────────────────────────────────────────────────────────────────────


def test_the_knee_is_the_smallest_level_within_3_percent_of_the_best():
    levels = [level(512, 30.0), level(1024, 39.0), level(2048, 40.5), level(4096, 41.0), level(8192, 38.0)]
    chosen = recommend(levels, "max-batch-tokens", 8 * GIB, 0.1)
    assert chosen.level == 2048  # 40.5 ≥ 0.97 × 41.0; 39.0 is not
    assert "knee" in chosen.reason and "41.0 rows/s at 4096" in chosen.reason


def test_the_best_level_wins_when_no_smaller_one_is_close():
    levels = [level(512, 30.0), level(1024, 35.0), level(2048, 41.0)]
    chosen = recommend(levels, "max-batch-tokens", 8 * GIB, 0.1)
    assert chosen.level == 2048 and "the highest throughput" in chosen.reason


def test_a_best_level_at_the_largest_value_tried_says_to_try_larger():
    rising = recommend([level(512, 100.0), level(1024, 150.0), level(2048, 200.0)], "max-batch-tokens", GIB, 0.1)
    assert rising.level == 2048
    assert "best throughput was at the largest level tried (2048): try larger --values" in rising.reason
    flat = recommend([level(512, 100.0), level(1024, 200.0), level(2048, 150.0)], "max-batch-tokens", GIB, 0.1)
    assert "try larger" not in flat.reason


def test_the_p99_limit_excludes_slow_levels():
    levels = [level(1, 10.0, p99_ms=20), level(8, 40.0, p99_ms=60), level(64, 80.0, p99_ms=400)]
    chosen = recommend(levels, "max-batch-rows", 8 * GIB, 0.1, max_p99_ms=80)
    assert chosen.level == 8
    assert "64" in str(chosen.excluded) and "400 ms > 80 ms" in chosen.excluded[64]


def test_the_memory_headroom_excludes_levels_that_use_too_much():
    budget = GIB
    levels = [level(1024, 30.0, peak=500 * MIB), level(2048, 40.0, peak=950 * MIB)]  # 950 MiB > 90% of 1 GiB
    chosen = recommend(levels, "max-batch-tokens", budget, 0.10)
    assert chosen.level == 1024 and "budget" in chosen.excluded[2048]
    assert recommend(levels, "max-batch-tokens", budget, 0.0).level == 2048


def test_an_out_of_memory_level_is_never_recommended():
    levels = [level(1024, 30.0), level(2048, 50.0, status="oom", splits=3)]
    chosen = recommend(levels, "max-batch-tokens", 8 * GIB, 0.1)
    assert chosen.level == 1024 and "out of memory" in chosen.excluded[2048]


def test_no_eligible_level_gives_no_recommendation_and_says_why():
    chosen = recommend([level(1024, 30.0, p99_ms=500)], "max-batch-tokens", 8 * GIB, 0.1, max_p99_ms=80)
    assert chosen.level is None and "no level met the limits" in chosen.reason and "500 ms" in chosen.reason


# ── CSV, comparison, table, plot ───────────────────────────────────────────────────────


def test_csv_has_the_documented_columns_and_round_trips_types(tmp_path):
    levels = [level(512, 30.0), level(1024, 41.5, status="oom", splits=2)]
    write_sweep_csv(str(tmp_path / "s.csv"), levels)
    header = next(csv.reader(open(tmp_path / "s.csv")))
    assert set(DOCUMENTED_COLUMNS) <= set(header) and header[0] == "level"
    back = read_sweep_csv(str(tmp_path / "s.csv"))
    assert back == levels
    assert isinstance(back[0].peak_device_bytes, int) and isinstance(back[0].rows_per_s, float)


def test_reading_a_file_that_is_not_a_sweep_csv_says_so(tmp_path):
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    with pytest.raises(UsageError, match="not a lengthwise sweep CSV"):
        read_sweep_csv(str(tmp_path / "other.csv"))
    with pytest.raises(UsageError, match="cannot read"):
        read_sweep_csv(str(tmp_path / "missing.csv"))


def test_the_regression_check_flags_throughput_drops_p99_rises_and_new_oom(tmp_path):
    before = [level(512, 100.0, p99_ms=100), level(1024, 100.0, p99_ms=100), level(2048, 100.0, p99_ms=100),
              level(4096, 100.0), level(8192, 100.0)]
    now = [level(512, 96.0, p99_ms=109),  # -4%, +9%: within the thresholds
           level(1024, 94.0, p99_ms=100),  # -6%: flagged
           level(2048, 100.0, p99_ms=111),  # +11% p99: flagged
           level(4096, 100.0, status="oom", splits=1),  # ran before, out of memory now
           level(16384, 10.0)]  # not in the earlier sweep: not compared
    write_sweep_csv(str(tmp_path / "before.csv"), before)
    write_sweep_csv(str(tmp_path / "now.csv"), now)
    changes = compare_sweeps(read_sweep_csv(str(tmp_path / "before.csv")), read_sweep_csv(str(tmp_path / "now.csv")),
                             max_throughput_drop=0.05, max_p99_rise=0.10)
    flags = {change.level: change.flags for change in changes}
    assert flags == {512: [], 1024: ["throughput -6.0%"], 2048: ["p99 +11.0%"], 4096: ["runs out of memory now"]}
    assert math.isclose(changes[0].throughput_change, -0.04)


def test_markdown_table_marks_the_recommended_level():
    table = markdown_table([level(512, 30.0), level(1024, 40.0)], recommended=1024)
    lines = table.splitlines()
    assert len(lines) == 4 and lines[3].startswith("| 1024 ← | ok | 40.0 |")


def test_the_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    levels = [level(512, 30.0), level(1024, 40.0, p99_ms=200), level(2048, 41.0, p99_ms=400),
              level(4096, 5.0, status="oom", splits=4)]
    plot_sweep(str(tmp_path / "s.png"), levels, "max-batch-tokens", 1024, "test")
    data = (tmp_path / "s.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# ── the sample and the device part ─────────────────────────────────────────────────────


def test_sample_positions_are_distinct_reproducible_and_capped():
    first = sample_positions(10_000, 500, seed=7)
    assert len(set(first.tolist())) == 500 and first.max() < 10_000
    assert np.array_equal(first, sample_positions(10_000, 500, seed=7))
    assert not np.array_equal(first, sample_positions(10_000, 500, seed=8))
    assert sorted(sample_positions(30, 500, seed=0).tolist()) == list(range(30))


def test_the_sample_takes_rows_from_every_shard():
    shards = list_shards([str(SAMPLE_DIR)], "id", "text")
    texts = read_sample(shards, "text", "id", 100, seed=0, storage_options={})
    import pyarrow.parquet as pq

    by_shard = [set(pq.read_table(s.url)["text"].to_pylist()) for s in shards]
    assert len(texts) == 100
    assert all(any(t in rows for t in texts) for rows in by_shard)
    assert all(any(t in rows for rows in by_shard) for t in texts)


class OutOfMemoryAbove(EmbedJob):
    name = "embed-oom"

    def __init__(self, max_rows: int):
        self.max_rows = max_rows

    def forward(self, model, input_ids, attention_mask, padded=True, packing=None):
        if input_ids.shape[0] > self.max_rows:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return super().forward(model, input_ids, attention_mask, padded, packing)


def encoded_sample(model_path: str, rows: int, max_length: int):
    spec = load_tokenizer_spec(model_path, max_length)
    texts = read_sample(list_shards([str(SAMPLE_DIR)], "id", "text"), "text", "id", rows, 0, {})
    with TokenizerPool(spec, 0) as pool:
        return spec, pool.result(pool.submit(texts))


@pytest.mark.slow
def test_a_level_that_runs_out_of_memory_is_recorded_not_raised(tiny_encoder_path):
    job = OutOfMemoryAbove(max_rows=4)
    model = job.load(tiny_encoder_path, torch.device("cpu"), torch.float32)
    spec, encoded = encoded_sample(tiny_encoder_path, 40, 64)
    settings = LevelSettings(max_batch_tokens=None, max_batch_rows=16, max_length=64, prefetch_batches=2)
    result = measure_level(job, model, torch.device("cpu"), encoded, np.arange(0), np.arange(40), settings, 16,
                           spec.pad_token_id)
    assert result.status == "oom" and result.oom_splits > 0 and result.rows == 40
    fits = measure_level(job, model, torch.device("cpu"), encoded, np.arange(0), np.arange(40),
                         replace(settings, max_batch_rows=4), 4, spec.pad_token_id)
    planned = plan_batches(encoded.lengths, None, 4, bucket_bounds(64, padding_multiple(torch.device("cpu"))))
    assert fits.status == "ok" and fits.oom_splits == 0 and fits.batches == len(list(planned))


@pytest.mark.slow
def test_the_first_level_out_of_memory_ends_the_sweep_upward(tmp_path, tiny_encoder_path, monkeypatch):
    import jobs.registry
    from pipeline.tuning.config import SweepConfig
    from pipeline.tuning.sweep import run_sweep

    monkeypatch.setitem(jobs.registry.JOBS, "embed-oom", OutOfMemoryAbove(max_rows=4))
    report = run_sweep(SweepConfig.of(input=(str(SAMPLE_DIR),), vary="max-batch-rows", values=(16, 2, 8, 4),
                                      out=str(tmp_path / "s.csv"), job="embed-oom", model=tiny_encoder_path,
                                      max_length=64, rows=24, warmup_rows=4, tokenize_workers=0,
                                      plan_cache=str(tmp_path / "cache")))
    assert [(r.level, r.status) for r in report.levels] == [(2, "ok"), (4, "ok"), (8, "oom")]  # 16 never ran
    assert report.recommendation.level in (2, 4) and "out of memory" in report.recommendation.excluded[8]


@pytest.mark.slow
def test_a_real_sweep_end_to_end(tmp_path, tiny_encoder_path):
    """Three levels on the shipped sample: CSV, side JSON, warm-up excluded, the saved
    recommendation used by `run --max-batch-tokens auto` (both under --dtype auto: on a CPU with
    native bf16 they settle one dtype, that of the trial on the input's rows), --compare failing with
    exit 3."""
    previous = [level(64, 1e6), level(256, 1e6), level(1024, 1e6)]  # impossibly fast: everything regressed
    write_sweep_csv(str(tmp_path / "previous.csv"), previous)
    cache = tmp_path / "cache"
    args = ["sweep", "--input", str(SAMPLE_DIR), "--model", tiny_encoder_path, "--vary", "max-batch-tokens",
            "--values", "1024,64,256", "--sample-rows", "60", "--warmup-rows", "20", "--max-length", "64",
            "--tokenize-workers", "0", "--plan-cache", str(cache), "--out", str(tmp_path / "sweep.csv"),
            "--compare", str(tmp_path / "previous.csv"), "--fail-on-regression",
            "--dtype", "auto"]  # as the run's: both trial on the input's rows and share the cached verdict
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 3, result.output
    assert "REGRESSION" in result.output and "recommendation: max-batch-tokens" in result.output

    levels = read_sweep_csv(str(tmp_path / "sweep.csv"))
    assert [r.level for r in levels] == [64, 256, 1024]
    assert all(r.status == "ok" and r.rows == 60 and r.rows_per_s > 0 for r in levels)
    # warm-up rows are not counted: the batches are exactly the plan of the 60 measured rows
    spec, encoded = encoded_sample(tiny_encoder_path, 80, 64)
    measured = encoded.lengths[np.flatnonzero([e is None for e in encoded.errors])[20:80]]
    for r in levels:
        assert r.batches == len(list(plan_batches(measured, r.level, 512, bucket_bounds(64, padding_multiple(torch.device("cpu"))))))
        assert r.row_latency_ms_p99 >= r.batch_latency_ms_p50 > 0
    settings = json.loads((tmp_path / "sweep.csv.json").read_text())
    assert settings["vary"] == "max-batch-tokens" and settings["max_batch_rows"] == 512
    assert settings["rows"] == 60 and settings["warmup_rows"] == 20
    assert settings["sample_token_lengths"]["max"] <= 64
    chosen = settings["recommendation"]["level"]
    assert chosen in (64, 256, 1024)

    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "a.parquet").write_bytes((SAMPLE_DIR / "stdlib-docs-00000.parquet").read_bytes())
    run = CliRunner().invoke(cli, ["run", "--input", str(inputs), "--output", str(tmp_path / "out"),
                                   "--model", tiny_encoder_path, "--max-length", "64", "--max-batch-tokens", "auto",
                                   "--plan-cache", str(cache), "--no-probe", "--no-progress",
                                   "--tokenize-workers", "0"])  # --dtype auto: the sweep's dtype
    assert run.exit_code == 0, run.output
    if "sweep-sample-too-thin" in [finding["code"] for finding in settings["diagnosis"]]:
        # a 60-row sample may be too thin to steer later runs: then nothing is saved, and the run says so
        assert "not saved for `lengthwise run --max-batch-tokens auto`" in result.output
        assert "--max-batch-tokens 2048 (auto: no sweep recommendation" in run.output
    else:
        assert f"--max-batch-tokens {chosen} recommended by the sweep" in run.output


def test_the_varied_setting_cannot_also_be_fixed(tmp_path):
    result = CliRunner().invoke(cli, ["sweep", "--input", str(SAMPLE_DIR), "--vary", "max-batch-tokens",
                                      "--values", "512", "--max-batch-tokens", "1024", "--out", str(tmp_path / "s.csv")])
    assert result.exit_code == 2 and "is the varied setting" in result.output


def test_compare_with_a_file_that_is_not_a_sweep_fails_before_running(tmp_path):
    (tmp_path / "x.csv").write_text("a\n1\n")
    result = CliRunner().invoke(cli, ["sweep", "--input", str(SAMPLE_DIR), "--vary", "max-batch-rows",
                                      "--values", "1,2", "--compare", str(tmp_path / "x.csv"),
                                      "--out", str(tmp_path / "s.csv")])
    assert result.exit_code == 2 and "not a lengthwise sweep CSV" in result.output
    assert not (tmp_path / "s.csv").exists()


def test_a_sweep_too_thin_to_trust_saves_no_recommendation():
    from pipeline.tuning.sweep import why_not_saved

    thin = [{"code": "sweep-sample-too-thin", "evidence": "", "action": ""}]
    assert "not saved for `lengthwise run --max-batch-rows auto`" in why_not_saved(thin, "max-batch-rows")
    assert why_not_saved([{"code": "sweep-knee", "evidence": "", "action": ""}], "max-batch-rows") is None
    assert why_not_saved([], "max-batch-tokens") is None
