"""The online load test: arrivals, diagnoses, CSV, recommendation, the regression gate, and a
real short run of `lengthwise loadtest` on the shipped sample."""

import csv
import dataclasses
import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from pipeline.core.values import Duration
from pipeline.cli import cli
from pipeline.online.config import BatcherConfig
from pipeline.tuning.config import OnlineLoadtestConfig
from pipeline.core.errors import UsageError
from pipeline.tuning.loadtest import ONLINE_MEASURES, OnlineLevelResult, level_configs, level_status, poisson_arrivals
from pipeline.tuning.levels import compare_sweeps, read_sweep_csv, recommend, write_sweep_csv
from tests.conftest import SAMPLE_DIR

DOCUMENTED_COLUMNS = ["max_batch_size", "requests", "total_s", "latency_ms_avg", "latency_ms_p50", "latency_ms_p95",
                      "latency_ms_p99", "latency_ms_max", "qps_achieved", "rejected", "timed_out", "mean_batch_size",
                      "peak_memory_bytes"]
MIB = 2**20


def level(value: int, qps_achieved: float = 40.0, p50: float = 30.0, p99: float = 60.0, rejected: int = 0,
          timed_out: int = 0, mean_batch: float = 4.0, batch_size: int = 8, timeout_ms: float = 20.0,
          qps: float = 40.0, depth: int = 2, by: tuple[int, int, int] = (50, 0, 50)) -> OnlineLevelResult:
    return OnlineLevelResult(
        level=value, status=level_status(rejected, timed_out, 0, qps_achieved, qps), max_batch_size=batch_size,
        batch_timeout_ms=timeout_ms, max_batch_tokens=2048, qps_target=qps, concurrency=64, requests=400,
        qps_offered=qps, total_s=10.2, latency_ms_avg=p50 * 1.1, latency_ms_p50=p50, latency_ms_p95=p99 * 0.9,
        latency_ms_p99=p99, latency_ms_max=p99 * 1.2, qps_achieved=qps_achieved, rejected=rejected,
        timed_out=timed_out, mean_batch_size=mean_batch, mean_batch_padded_tokens=mean_batch * 40, batches=100, batches_by_size=by[0], batches_by_tokens=by[1],
        batches_by_timeout=by[2], oom_splits=0, max_queue_depth=depth * 2,
        queue_depth_at_end=depth, wait_ms_p50=p50 / 2, wait_ms_p99=p99 / 2, compute_ms_p50=10.0, compute_ms_p99=20.0,
        peak_memory_bytes=50 * MIB)


def test_poisson_arrivals_have_the_rate_and_stay_in_the_window():
    arrivals = poisson_arrivals(200.0, 50.0, np.random.default_rng(1))
    assert arrivals[0] == 0.0 and arrivals[-1] < 50.0 and np.all(np.diff(arrivals) >= 0)
    assert len(arrivals) == pytest.approx(10_000, rel=0.03)
    gaps = np.diff(arrivals)
    assert gaps.std() == pytest.approx(gaps.mean(), rel=0.05)  # exponential: std = mean
    assert np.array_equal(arrivals, poisson_arrivals(200.0, 50.0, np.random.default_rng(1)))


def test_the_answer_rate_is_not_lowered_by_the_drains_tail():
    from pipeline.tuning.loadtest import PhaseOutcome

    keeping_up = PhaseOutcome([0.5] * 11, [0.5 + i for i in range(11)], 0, 0, total_s=10.9, queue_depth_at_end=0)
    assert keeping_up.answers_per_s() == 1.0  # 11 answers in 10.9 s of total, but one a second
    assert PhaseOutcome([0.5], [3.0], 0, 0, 3.0, 0).answers_per_s() == 0.0


def test_a_level_whose_answers_fall_behind_the_arrivals_is_overloaded():
    assert level_status(0, 0, 0, 35.5, 61.4) == "overloaded"
    assert level_status(0, 0, 0, 60.0, 61.4) == "ok"
    assert level_status(0, 0, 2, 60.0, 61.4) == "oom"


def test_the_diagnosis_reads_the_load_tests_csv_rows():
    """Every key the diagnosis reads is a column of the load test's CSV."""
    from pipeline.tuning.diagnosis import LOADTEST_KEYS, diagnose_loadtest

    assert set(LOADTEST_KEYS) <= set(OnlineLevelResult.columns())
    rows = [dataclasses.asdict(level(32, batch_size=32, mean_batch=1.3, qps=40, timeout_ms=20, by=(0, 0, 100)))]
    assert [f.code for f in diagnose_loadtest(rows)] == ["batches-never-fill"]


def test_csv_has_the_documented_columns_and_round_trips(tmp_path):
    levels = [level(1), level(8, rejected=3)]
    write_sweep_csv(str(tmp_path / "l.csv"), levels, OnlineLevelResult)
    header = next(csv.reader(open(tmp_path / "l.csv")))
    assert set(DOCUMENTED_COLUMNS) <= set(header)
    back = read_sweep_csv(str(tmp_path / "l.csv"), OnlineLevelResult)
    assert back == levels and back[1].status == "overloaded" and isinstance(back[0].rejected, int)
    with pytest.raises(UsageError, match="not a lengthwise sweep CSV"):
        read_sweep_csv(str(tmp_path / "l.csv"))  # an online CSV given to the offline sweep's --compare
    (tmp_path / "other.csv").write_text("level,status\n1,ok\n")
    with pytest.raises(UsageError, match="not a lengthwise online load test CSV"):
        read_sweep_csv(str(tmp_path / "other.csv"), OnlineLevelResult)


def test_the_recommendation_skips_overloaded_and_slow_levels_and_counts_requests():
    levels = [level(1, qps_achieved=30.0, rejected=40), level(4, qps_achieved=39.5, p99=70),
              level(16, qps_achieved=40.0, p99=200)]
    chosen = recommend(levels, "max-batch-size", 8 * 2**30, 0.1, max_p99_ms=100, measures=ONLINE_MEASURES)
    assert chosen.level == 4 and "highest throughput (39.5 requests/s)" in chosen.reason
    assert "p99 latency 70 ms ≤ 100 ms" in chosen.reason
    assert chosen.excluded[1] == "overloaded: 30.0 of 40.0 requests/s served, 40 rejected, 0 timed out of 400"
    assert chosen.excluded[16] == "p99 latency 200 ms > 100 ms"


def test_the_load_test_plot_has_a_legend_the_target_rate_and_axes_from_zero(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from pipeline.tuning.levels import plot_sweep

    levels = [level(1, qps_achieved=30.0, rejected=40), level(4, qps_achieved=39.5, p99=70),
              level(16, qps_achieved=40.0, p99=200)]
    plot_sweep(str(tmp_path / "online.png"), levels, "max-batch-size", 4, "online", ONLINE_MEASURES)
    with Image.open(tmp_path / "online.png") as image:
        assert image.format == "PNG" and image.size[0] > 600 and image.size[1] > 600


def test_levels_that_keep_up_tie_within_the_noise_of_their_requests_and_the_smallest_wins():
    """Never "the lowest p99" of a handful of requests: one rule, ties to the smallest level."""
    levels = [level(4, qps_achieved=61.2, p99=408), level(16, qps_achieved=61.2, p99=344),
              level(32, qps_achieved=62.0, p99=57), level(64, qps_achieved=60.8, p99=80)]
    chosen = recommend(levels, "max-batch-size", 8 * 2**30, 0.1, measures=ONLINE_MEASURES)
    assert chosen.level == 4, chosen.reason
    assert "within 10% (the measurement's noise) of the best (62.0 requests/s at 32)" in chosen.reason  # 400
    many = [dataclasses.replace(result, requests=100_000) for result in levels]  # 2/√n below 3%: 3% it is
    assert recommend(many, "max-batch-size", 8 * 2**30, 0.1, measures=ONLINE_MEASURES).level == 4
    apart = [level(4, qps_achieved=50.0), level(16, qps_achieved=62.0)]
    assert recommend(apart, "max-batch-size", 8 * 2**30, 0.1, measures=ONLINE_MEASURES).level == 16



def test_the_comparison_flags_lower_throughput_higher_p99_and_new_overload():
    before = [level(1), level(4), level(16)]
    now = [level(1, qps_achieved=36.0), level(4, p99=80.0), level(16, timed_out=5)]
    flags = {c.level: c.flags for c in compare_sweeps(before, now, 0.05, 0.10, ONLINE_MEASURES)}
    assert flags == {1: ["overloaded now: overloaded: 36.0 of 40.0 requests/s served, 0 rejected, 0 timed out of 400"],
                     4: ["p99 +33.3%"],
                     16: ["overloaded now: overloaded: 40.0 of 40.0 requests/s served, 0 rejected, 5 timed out of 400"]}
    slower = [level(1, qps_achieved=38.4), level(4, qps_achieved=38.4, qps=38.0)]  # 4% fewer answers, still ok
    assert [c.flags for c in compare_sweeps(before[:2], slower, 0.03, 0.10, ONLINE_MEASURES)] == \
        [["throughput -4.0%"], ["throughput -4.0%"]]


def test_levels_whose_window_reaches_the_request_timeout_are_refused_up_front():
    config = OnlineLoadtestConfig.of(input=("x",), vary="batch-timeout-ms", values=(10, 500), out="o.csv",
                                     batcher=BatcherConfig.of(request_timeout_ms=500))
    with pytest.raises(UsageError, match="batch-timeout-ms 500: a request timeout of 500 ms is not more"):
        level_configs(config)
    sizes = level_configs(OnlineLoadtestConfig.of(input=("x",), vary="max-batch-size", values=(8, 1, 8), out="o.csv"))
    assert [(value, c.max_batch_size) for value, c in sizes] == [(1, 1), (8, 8)]


@pytest.mark.parametrize("text, seconds", [("30s", 30.0), ("500ms", 0.5), ("2m", 120.0), ("1.5", 1.5)])
def test_durations_read_with_their_units(text, seconds):
    assert math.isclose(Duration().parse(text), seconds)


@pytest.mark.slow
def test_a_real_load_test_end_to_end(tmp_path, tiny_encoder_path):
    """Two levels on the shipped sample with a tiny model: the CSV, the side JSON, the plot,
    the table, and --compare against an impossibly good earlier run failing with exit 3."""
    pytest.importorskip("matplotlib")
    write_sweep_csv(str(tmp_path / "previous.csv"), [level(1, qps_achieved=1e6, p99=0.01),
                                                     level(4, qps_achieved=1e6, p99=0.01)], OnlineLevelResult)
    args = ["loadtest", "--input", str(SAMPLE_DIR), "--model", tiny_encoder_path, "--dtype", "float32",
            "--max-length", "64", "--qps", "20", "--duration", "2s", "--warmup", "300ms", "--batch-timeout-ms", "10",
            "--request-timeout-ms", "5000", "--vary", "max-batch-size", "--values", "4,1", "--no-probe",
            "--sample-rows", "200", "--out", str(tmp_path / "online.csv"), "--plot", str(tmp_path / "online.png"),
            "--compare", str(tmp_path / "previous.csv"), "--fail-on-regression"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 3, result.output
    assert "| max-batch-size | status | requests |" in result.output and "REGRESSION" in result.output
    assert "recommendation: " in result.output  # which level (or none) depends on this shared machine's load
    levels = read_sweep_csv(str(tmp_path / "online.csv"), OnlineLevelResult)
    assert [r.level for r in levels] == [1, 4] and [r.max_batch_size for r in levels] == [1, 4]
    for r in levels:
        assert r.requests > 20 and r.rejected == 0 and r.timed_out == 0 and r.status in ("ok", "overloaded")
        assert r.qps_achieved > 0 and 0 < r.latency_ms_p50 <= r.latency_ms_p99 <= r.latency_ms_max
        assert 1 <= r.mean_batch_size <= r.max_batch_size and r.batches >= r.requests / r.max_batch_size
    assert levels[0].mean_batch_size == 1.0 and levels[0].requests == levels[1].requests  # the same arrivals
    settings = json.loads((tmp_path / "online.csv.json").read_text())
    assert settings["vary"] == "max-batch-size" and settings["max_batch_size"] is None
    assert settings["qps"] == 20 and settings["duration_s"] == 2.0 and settings["sample_token_lengths"]["max"] <= 64
    assert (tmp_path / "online.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_load_test_table_is_the_sweeps_with_its_own_columns_and_sizes_as_lengthwise_prints_them():
    from pipeline.tuning.levels import markdown_table
    from pipeline.tuning.loadtest import LOADTEST_COLUMNS, OnlineLevelResult

    values = {field.name: 0 for field in dataclasses.fields(OnlineLevelResult)}
    result = OnlineLevelResult(**{**values, "level": 8, "status": "ok", "requests": 1200, "qps_achieved": 39.94,
                                  "latency_ms_p99": 81.25, "mean_batch_size": 2.5, "peak_memory_bytes": 3 * 2**29})
    header, rule, row = markdown_table([result], 8, LOADTEST_COLUMNS, "max-batch-size").splitlines()
    assert header.startswith("| max-batch-size | status | requests | req/s achieved |") and rule.count("|") == 13
    assert row == "| 8 ← | ok | 1,200 | 39.9 | 0.0 | 0.0 | 81.2 | 0.0 | 2.50 | 0 | 0 | 1.50 GiB |"
