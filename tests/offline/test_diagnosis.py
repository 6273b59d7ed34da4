"""The diagnosis: each finding from the summary, sweep or load test that triggers it, none
from healthy ones; and the numbers it reads, measured by a real run and a real sweep."""

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.tuning.diagnosis import LOADTEST_KEYS, diagnose_loadtest, diagnose_sweep
from pipeline.core.findings import as_dicts, diagnosis_lines
from pipeline.offline.diagnosis import diagnose_run
from pipeline.offline.summary import RowStats, RunSummary
from pipeline.tuning.levels import LevelResult, Recommendation
from tests.conftest import SAMPLE_DIR, write_shards

MIB = 2**20


# ── runs ───────────────────────────────────────────────────────────────────────────────


def healthy_summary(**changes) -> RunSummary:
    """The 50,000-row imdb run in docs/performance.md, rounded: nothing wrong with it."""
    summary = RunSummary(
        rows=50_000, error_rows=0, truncated_rows=300, shards=6, batches=5_281, real_tokens=10_352_032,
        padded_tokens=10_461_216, padding_efficiency=0.990, rows_per_s=31.7, tokens_per_s=6_560, wall_s=1580.0,
        stage_s={"setup": 1.7, "read": 0.53, "tokenize": 44.18, "collate": 0.79, "wait_for_batch": 2.76,
                 "forward": 1575.82, "write": 0.99},
        device_busy_fraction=0.997, device="cpu", dtype="float32", batch_plan="probed in 3.1s",
        token_lengths={"p50": 238, "p99": 250, "max": 256},
        settings={"max_length": 256, "max_positions": 512, "window_rows": 8192, "tokenize_workers": 2, "cores": 2,
                  "safety": 1.5, "max_batch_tokens": 2048, "max_batch_rows": 512},
        sweep_reference={"vary": "max-batch-tokens", "level": 1024, "rows_per_s": 30.7, "tokens_per_s": 6351.0,
                         "created": "2026-11-29T23:46:29+00:00", "path": "/plans/sweep-x.json"})
    return dataclasses.replace(summary, **changes)


def only(findings, code):
    assert [f.code for f in findings] == [code], findings
    return findings[0]


def test_a_healthy_run_has_no_findings_and_prints_no_diagnosis():
    summary = healthy_summary()
    assert diagnose_run(summary) == []
    assert diagnose_run(json.loads(summary.to_json())) == []  # the summary JSON reads the same
    assert "diagnosis" not in summary.to_text()


def test_preprocessing_bound_names_the_waiting_share_and_the_workers_to_add():
    summary = healthy_summary(stage_s={"setup": 2.0, "read": 0.5, "tokenize": 80.0, "collate": 0.4,
                                       "wait_for_batch": 30.0, "forward": 60.0, "write": 1.0},
                              device_busy_fraction=0.65,
                              settings={**healthy_summary().settings, "tokenize_workers": 2, "cores": 16})
    finding = only(diagnose_run(summary), "preprocessing-bound")
    assert "waited for batches 30.0s, 33% of its time (forward 60.0s; device busy 65%)" in finding.evidence
    assert "tokenize 80.0s over 2 worker(s)" in finding.evidence
    assert finding.action == "--tokenize-workers 4 (now 2, on 16 cores)"


@pytest.mark.parametrize("workers, cores, stages, action", [
    (2, 2, {}, "--tokenize-workers 1: 2 tokenizer processes on 2 cores starve the thread that feeds the device"),
    (0, 8, {}, "--tokenize-workers 7: tokenizing runs in the main process now"),
    (4, 8, {"read": 50.0}, "reading the input is the slowest stage"),
])
def test_preprocessing_bound_action_follows_the_slowest_stage_and_the_cores(workers, cores, stages, action):
    stage_s = {"setup": 1.0, "read": 0.5, "tokenize": 40.0, "collate": 0.2, "wait_for_batch": 20.0, "forward": 30.0,
               **stages}
    summary = healthy_summary(stage_s=stage_s,
                              settings={**healthy_summary().settings, "tokenize_workers": workers, "cores": cores})
    assert only(diagnose_run(summary), "preprocessing-bound").action.startswith(action)


def test_a_short_start_up_wait_is_not_preprocessing_bound():
    summary = healthy_summary(stage_s={"setup": 1.0, "read": 0.1, "tokenize": 0.5, "collate": 0.01,
                                       "wait_for_batch": 0.6, "forward": 1.0, "write": 0.1})
    assert diagnose_run(summary) == []


def test_low_padding_efficiency_suggests_a_larger_window_when_the_input_has_more_rows():
    summary = healthy_summary(padded_tokens=17_253_387, padding_efficiency=0.6)
    finding = only(diagnose_run(summary), "low-padding-efficiency")
    assert finding.evidence == "padding efficiency 0.600: 40% of the 17,253,387 computed tokens were padding"
    assert finding.action.startswith("--window-rows 32768 (now 8192)")
    small = healthy_summary(rows=5000, truncated_rows=30, padded_tokens=17_253_387, padding_efficiency=0.6)
    assert only(diagnose_run(small), "low-padding-efficiency").action.startswith("the whole input was one window")


def test_truncated_rows_say_how_many_and_which_max_length_covers_p99():
    summary = healthy_summary(truncated_rows=1_200, token_lengths={"p50": 120, "p99": 301, "max": 900},
                              settings={**healthy_summary().settings, "max_length": 128})
    finding = only(diagnose_run(summary), "truncated-rows")
    assert finding.evidence == ("1,200 of 50,000 rows (2.4%) were longer than --max-length 128 tokens and truncated; "
                                "token lengths before truncation: p50 120, p99 301, max 900")
    assert finding.action.startswith("--max-length 304 covers 99% of the rows")


def test_truncated_rows_beyond_the_model_say_its_limit():
    summary = healthy_summary(truncated_rows=1_998, rows=2_000, token_lengths={"p50": 238, "p99": 1230, "max": 2102},
                              settings={**healthy_summary().settings, "max_length": 32})
    finding = only(diagnose_run(summary), "truncated-rows")
    assert "1,998 of 2,000 rows (99.9%)" in finding.evidence and "p99 1,230" in finding.evidence
    assert finding.action.startswith("--max-length 512 (the model's limit)")
    at_limit = dataclasses.replace(summary, settings={**summary.settings, "max_length": 512})
    assert only(diagnose_run(at_limit), "truncated-rows").action.startswith(
        "--max-length is at the model's limit (512 positions): --long-text split judges all of every row")


def test_oom_splits_suggest_a_new_probe_or_more_safety():
    summary = healthy_summary(oom_splits=3, lowered_batch_rows={256: 12})
    finding = only(diagnose_run(summary), "oom-splits")
    assert finding.evidence.startswith("3 batches ran out of memory and were halved; rows per padded length lowered "
                                       "to {256: 12}")
    assert finding.action == ("the memory plan is stale or too tight: probe again with --no-plan-cache, or raise "
                              "--safety from 1.5 to 2")


def test_oom_splits_without_a_memory_plan_point_at_the_probe_and_the_tokens_that_ran():
    from pipeline.core.probe import describe_plan

    summary = healthy_summary(oom_splits=6, lowered_batch_rows={"223": 360, "256": 391}, batch_plan=describe_plan(None))
    finding = only(diagnose_run(summary), "oom-splits")
    assert finding.action == ("batches were sized without a memory plan (--no-probe): drop --no-probe so the probe "
                              "sizes them, or lower --max-batch-tokens to 80,280 (what ran after the splits)")


def test_row_errors_list_the_top_reasons_with_counts_and_what_to_do():
    summary = healthy_summary(error_rows=7, error_reasons={
        "text is null": 4, "the model gave a non-finite output (nan or inf) in float16; rerun with --dtype float32": 2,
        "text is empty or whitespace only": 1})
    finding = only(diagnose_run(summary), "row-errors")
    assert finding.evidence == ("7 of 50,000 rows have an error: 4 × 'text is null'; 2 × 'the model gave a "
                                "non-finite output (nan or inf) in float16; rerun with --dtype float32'; "
                                "1 × 'text is empty or whitespace only'")
    assert "--dtype float32" in finding.action and "fix the input rows" in finding.action
    assert finding.action.count("fix the input rows") == 1


def test_duplicate_ids_warn_that_results_joined_by_id_mix_up():
    finding = only(diagnose_run(healthy_summary(duplicate_ids=2, duplicate_id_examples=["a", 7])), "duplicate-ids")
    assert finding.evidence == "2 rows repeat the id of an earlier row (e.g. 'a', 7)"
    assert "--id-column" in finding.action


def test_throughput_far_below_the_sweep_says_so():
    summary = healthy_summary(real_tokens=2_000_000, wall_s=1001.7)  # 2,000 tokens/s after 1.7 s setup
    finding = only(diagnose_run(summary), "below-sweep")
    assert finding.evidence == ("2,000 tokens/s after setup is 31% of the 6,351 tokens/s that the sweep of "
                                "2026-11-29T23:46:29+00:00 measured at --max-batch-tokens 1024 on this model, "
                                "device and dtype")
    assert "lengthwise sweep --vary max-batch-tokens" in finding.action
    assert diagnose_run(dataclasses.replace(summary, sweep_reference={})) == []


def test_findings_print_after_the_summary_and_go_into_its_json():
    summary = healthy_summary(duplicate_ids=1, duplicate_id_examples=["x"])
    summary.diagnosis = as_dicts(diagnose_run(summary))
    lines = summary.to_text().splitlines()
    assert lines[-2] == "diagnosis       duplicate-ids: 1 rows repeat the id of an earlier row (e.g. 'x')"
    assert lines[-1].startswith("                → both rows are kept")
    assert json.loads(summary.to_json())["diagnosis"] == [{"code": "duplicate-ids", "evidence": summary.diagnosis[0][
        "evidence"], "action": summary.diagnosis[0]["action"]}]


def test_row_stats_percentiles_and_top_reasons():
    stats = RowStats()
    stats.add(np.arange(1, 101), [None] * 98 + ["text is null", "text is null"])
    stats.add(np.array([5000]), ["id is null"])
    assert stats.token_lengths() == {"p50": 51, "p99": 100, "max": 5000}
    assert stats.top_reasons() == {"text is null": 2, "id is null": 1}
    assert RowStats().token_lengths() == {}


def test_the_ray_engine_merges_what_the_diagnosis_reads():
    from pipeline.engines.ray import merge_summary

    total = RunSummary()
    for reasons, lengths in (({"text is null": 2}, {"p50": 40, "p99": 300, "max": 900}),
                             ({"text is null": 1, "id is null": 1}, {"p50": 60, "p99": 280, "max": 1200})):
        merge_summary(total, dataclasses.asdict(RunSummary(error_reasons=reasons, token_lengths=lengths,
                                                           settings={"max_length": 256})))
    assert total.error_reasons == {"text is null": 3, "id is null": 1}
    assert total.token_lengths == {"p50": 60, "p99": 300, "max": 1200}  # per shard's largest: an upper bound
    assert total.settings == {"max_length": 256}


# ── the numbers, measured for real ─────────────────────────────────────────────────────


def test_full_lengths_are_the_untruncated_token_counts(minilm_path, sample_table):
    from tokenizers import Tokenizer

    from pipeline.core.tokenize import TokenizerPool, load_tokenizer_spec

    spec = load_tokenizer_spec(minilm_path, 16)
    texts = sample_table["text"].to_pylist()[:40] + [None]
    with TokenizerPool(spec, 0, chunk_rows=16) as pool:
        encoded = pool.result(pool.submit(texts))
    untruncated = Tokenizer.from_str(spec.tokenizer_json)
    untruncated.no_truncation()
    expected = [len(untruncated.encode(text).ids) for text in texts[:40]] + [0]
    assert encoded.full_lengths.tolist() == expected
    assert (encoded.full_lengths > 16).tolist() == encoded.truncated.tolist()
    assert encoded.lengths.max() == 16


@pytest.mark.slow
def test_a_real_run_prints_and_saves_its_findings(tmp_path, rows_with_bad_ones, tiny_encoder_path):
    """The shipped sample with four bad texts and a repeated id, at --max-length 8."""
    table = rows_with_bad_ones.set_column(0, "id", pa.array(["same"] * 2 + rows_with_bad_ones["id"].to_pylist()[2:]))
    write_shards(tmp_path / "in", table, [120, 80])
    result = CliRunner().invoke(cli, ["run", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                                      "--model", tiny_encoder_path, "--max-length", "8", "--no-progress",
                                      "--tokenize-workers", "0", "--dtype", "float32",
                                      "--summary-json", str(tmp_path / "s.json")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "s.json").read_text())
    summary["diagnosis"] = [f for f in summary["diagnosis"] if f["code"] != "oversubscribed"]  # the machine's
    codes = [finding["code"] for finding in summary["diagnosis"]]
    assert codes == ["truncated-rows", "duplicate-ids", "row-errors"]
    assert summary["error_reasons"] == {"text is null": 2, "text is empty or whitespace only": 2}
    assert summary["token_lengths"]["max"] > 8 and summary["settings"]["max_length"] == 8
    assert summary["settings"]["max_positions"] == 512
    truncated = summary["diagnosis"][0]
    assert f"{summary['truncated_rows']:,} of 200 rows" in truncated["evidence"]
    assert f"p99 {summary['token_lengths']['p99']:,}" in truncated["evidence"]
    for line in diagnosis_lines(summary["diagnosis"]):
        assert line in result.output


@pytest.mark.slow
def test_a_real_sweep_saves_its_findings_and_its_throughput_for_the_run(tmp_path, tiny_encoder_path):
    cache = tmp_path / "cache"
    result = CliRunner().invoke(cli, ["sweep", "--input", str(SAMPLE_DIR), "--model", tiny_encoder_path,
                                      "--vary", "max-batch-rows", "--values", "2,4", "--sample-rows", "30",
                                      "--warmup-rows", "4", "--max-length", "32", "--tokenize-workers", "0",
                                      "--dtype", "float32",  # a tiny model's bf16 trial is noise on a native-bf16 CPU
                                      "--plan-cache", str(cache), "--out", str(tmp_path / "sweep.csv")])
    assert result.exit_code == 0, result.output
    settings = json.loads((tmp_path / "sweep.csv.json").read_text())
    assert isinstance(settings["diagnosis"], list)
    for line in diagnosis_lines(settings["diagnosis"]):
        assert line in result.output
    saved = json.loads(next(cache.glob("sweep-*.json")).read_text())
    assert saved["tokens_per_s"] == settings["recommendation"]["tokens_per_s"] > 0

    run = CliRunner().invoke(cli, ["run", "--input", str(SAMPLE_DIR), "--output", str(tmp_path / "out"),
                                   "--model", tiny_encoder_path, "--max-length", "32", "--max-batch-rows", "auto",
                                   "--plan-cache", str(cache), "--no-probe", "--no-progress", "--tokenize-workers",
                                   "0", "--dtype", "float32", "--summary-json", str(tmp_path / "s.json")])
    assert run.exit_code == 0, run.output
    reference = json.loads((tmp_path / "s.json").read_text())["sweep_reference"]
    assert reference["vary"] == "max-batch-rows" and reference["level"] == settings["recommendation"]["level"]
    assert reference["tokens_per_s"] == saved["tokens_per_s"]


# ── sweeps ─────────────────────────────────────────────────────────────────────────────


def level(value: int, rows_per_s: float, padding: float = 0.98, p50_ms: float = 100.0, p99_ms: float = 130.0,
          peak: int = 100 * MIB, status: str = "ok", splits: int = 0) -> LevelResult:
    return LevelResult(level=value, status=status, rows=200, total_s=200 / rows_per_s if rows_per_s else 0.0,
                       rows_per_s=rows_per_s,
                       tokens_per_s=rows_per_s * 200, padding_efficiency=padding, batch_latency_ms_avg=p50_ms,
                       batch_latency_ms_p50=p50_ms, batch_latency_ms_p95=p99_ms, batch_latency_ms_p99=p99_ms,
                       batch_latency_ms_max=p99_ms, row_latency_ms_p50=p50_ms, row_latency_ms_p95=p99_ms,
                       row_latency_ms_p99=p99_ms, row_latency_ms_max=p99_ms, peak_device_bytes=peak,
                       peak_rss_bytes=peak, batches=10, oom_splits=splits)


SWEEP_SETTINGS = {"vary": "max-batch-rows", "rows": 200, "max_length": 256, "memory_budget_bytes": 8 * 1024 * MIB,
                  "sample_token_lengths": {"rows": 200, "median": 230.0, "p90": 256.0, "p99": 256.0, "max": 256}}


def diagnose(levels, chosen, **settings):
    return diagnose_sweep(levels, Recommendation("max-batch-rows", chosen, "why"), {**SWEEP_SETTINGS, **settings})


def test_a_healthy_sweep_has_no_findings():
    levels = [level(8, 20.0), level(16, 25.0), level(32, 30.0)]  # still rising: no knee yet
    assert diagnose(levels, 32) == []
    assert diagnose([dataclasses.asdict(r) for r in levels], 32) == []  # CSV rows as dicts read the same


def test_throughput_falling_with_padding_asks_for_a_sample_as_large_as_the_window():
    levels = [level(8, 20.0, 0.97), level(16, 30.0, 0.96), level(32, 24.0, 0.88), level(64, 21.0, 0.80)]
    finding = only(diagnose(levels, 16), "sweep-sample-too-thin")
    assert finding.evidence == ("padding efficiency falls 0.970 → 0.800 from --max-batch-rows 8 to 64 (rows/s 20.0 → "
                                "21.0, -30% from the best 30.0 at 16); the sample has 200 rows")
    assert finding.action.startswith("--sample-rows 8192: a run packs its batches out of --window-rows (8192) rows")
    assert finding.action.endswith("so their fall in throughput may be the sample's, not the device's")


def test_a_thin_sample_is_named_even_while_throughput_still_rises():
    """The shape of the 200-row imdb sweep in docs/tuning.md: padding 1.000 → 0.906 from 1 to 64 rows."""
    levels = [level(1, 1.1, 1.0), level(8, 12.6, 0.983), level(64, 17.2, 0.906)]
    finding = only(diagnose(levels, 64), "sweep-sample-too-thin")
    assert finding.evidence == ("padding efficiency falls 1.000 → 0.906 from --max-batch-rows 1 to 64 (rows/s 1.1 → "
                                "17.2); the sample has 200 rows")
    assert finding.action.endswith("the larger levels are measured with more padding than the run will have")


def test_throughput_falling_with_padding_on_a_full_sample_is_padding():
    levels = [level(8, 20.0, 0.97), level(16, 30.0, 0.96), level(32, 24.0, 0.88), level(64, 21.0, 0.80)]
    finding = only(diagnose(levels, 16, rows=10_000), "padding-dominates")
    assert finding.evidence == ("from --max-batch-rows 16 to 64 rows/s fall 30.0 → 21.0 (-30%) while padding "
                                "efficiency falls 0.960 → 0.800")
    assert finding.action.startswith("stay at --max-batch-rows 16")


def test_flat_throughput_from_a_small_level_names_the_knee():
    levels = [level(1, 10.0), level(2, 18.0), level(4, 29.0, p99_ms=150), level(8, 30.0, p99_ms=260),
              level(16, 30.5, p99_ms=300, peak=300 * MIB)]
    finding = only(diagnose(levels, 4), "throughput-flat")
    assert finding.evidence == ("rows/s stay within 10% of the best (30.5) from --max-batch-rows 4 to 16 "
                                "(29.0–30.5); meanwhile row p99 150 → 300 ms, peak memory 100 MiB → 300 MiB")
    assert finding.action.startswith("the device is saturated from --max-batch-rows 4 (the knee)")
    assert finding.action.endswith("larger batches buy no throughput, only latency and memory")
    steady = [level(4, 29.0, p99_ms=300), level(8, 30.0, p99_ms=250)]
    assert only(diagnose(steady, 8), "throughput-flat").action.endswith("buy no throughput, only memory")


def test_p99_far_above_p50_blames_long_rows_when_the_sample_has_them():
    levels = [level(8, 20.0, p50_ms=100, p99_ms=450), level(16, 25.0), level(32, 30.0)]
    finding = only(diagnose(levels, 32, sample_token_lengths={"median": 60.0, "p99": 256.0}), "latency-tail")
    assert finding.evidence == ("row p99 is over 3× p50 at --max-batch-rows 8; worst at 8: p99 450 ms = 4.5× p50 "
                                "100 ms (one batch: p50 100 ms, p99 450 ms); sample token lengths median 60, p99 256")
    assert finding.action.startswith("long rows: --max-p99-ms picks a level")


def test_p99_far_above_p50_with_even_rows_is_stalls_or_queueing():
    stalled = [level(8, 20.0, p50_ms=100, p99_ms=450), level(16, 25.0), level(32, 30.0)]
    assert only(diagnose(stalled, 32), "latency-tail").action.startswith("stalls: some batches")  # median 230
    queued = dataclasses.replace(level(16, 25.0), batch_latency_ms_p99=120.0, row_latency_ms_p99=500.0)
    finding = only(diagnose([level(8, 20.0), queued, level(32, 30.0)], 32), "latency-tail")
    assert finding.action.startswith("queueing: rows wait behind earlier batches in the prefetch queue; fewer "
                                     "--prefetch-batches or a smaller level")


def test_memory_headroom_nearly_gone_at_the_recommended_level():
    levels = [level(8, 20.0, peak=2000 * MIB), level(16, 25.0, peak=4000 * MIB),
              level(32, 30.0, peak=7000 * MIB)]
    finding = only(diagnose(levels, 32), "memory-headroom-low")
    assert finding.evidence == ("at the recommended --max-batch-rows 32 the batches peaked at 6.84 GiB of the "
                                "8.00 GiB budget: 15% free")
    assert "use --max-batch-rows 16" in finding.action and "--memory-headroom 0.20" in finding.action


def test_a_level_out_of_memory_is_reported():
    levels = [level(8, 20.0), level(16, 25.0), level(32, 0.0, status="oom", splits=3)]
    finding = only(diagnose(levels, 16), "sweep-out-of-memory")
    assert finding.evidence == "--max-batch-rows 32 ran out of memory (3 batch splits); the sweep stopped there"
    assert finding.action.startswith("levels up to 16 fit")


# ── online load tests ──────────────────────────────────────────────────────────────────


def online(max_batch_size=16, qps=100.0, achieved=99.0, mean_batch=12.0, p50=20.0, p99=45.0, rejected=0,
           timed_out=0, by=(60, 0, 40), timeout_ms=20.0, tokens_per_batch=400.0, depth=0, wait_p99=None,
           compute_p99=20.0) -> dict:
    """One level of an online load test, as its CSV row."""
    row = {"max_batch_size": max_batch_size, "batch_timeout_ms": timeout_ms, "max_batch_tokens": 2048,
           "requests": 6000, "qps_offered": qps, "qps_achieved": achieved, "latency_ms_p50": p50,
           "latency_ms_p99": p99, "latency_ms_max": p99 * 1.2, "rejected": rejected, "timed_out": timed_out,
           "mean_batch_size": mean_batch, "mean_batch_padded_tokens": tokens_per_batch, "batches_by_size": by[0],
           "batches_by_tokens": by[1], "batches_by_timeout": by[2], "max_queue_depth": depth * 2,
           "queue_depth_at_end": depth, "wait_ms_p99": p99 / 2 if wait_p99 is None else wait_p99,
           "compute_ms_p99": compute_p99}
    assert set(LOADTEST_KEYS) <= set(row)
    return row


AT = "max batch size 16, batch timeout 20 ms, 100.0 requests/s offered"


def test_a_healthy_load_test_has_no_findings():
    assert diagnose_loadtest([online(), online(max_batch_size=8, mean_batch=7.5)]) == []


def test_batches_that_never_fill_say_the_timeout_does_the_work():
    finding = only(diagnose_loadtest([online(max_batch_size=32, qps=40.0, achieved=40.0, mean_batch=1.3,
                                             by=(0, 0, 100))]), "batches-never-fill")
    assert finding.evidence == ("max batch size 32, batch timeout 20 ms, 40.0 requests/s offered: 100 of 100 batches "
                                "sent by the timeout, mean batch 1.3 of 32 (a window gathers ~0.8)")
    assert "lower --batch-timeout-ms" in finding.action
    # most batches leave full: not this finding
    assert diagnose_loadtest([online(max_batch_size=32, qps=40.0, achieved=40.0, mean_batch=1.3, by=(10, 0, 5))]) == []


def test_batches_capped_by_the_token_budget_say_so_and_are_not_said_to_never_fill():
    finding = only(diagnose_loadtest([online(max_batch_size=64, mean_batch=20.0, by=(0, 80, 20),
                                             tokens_per_batch=800.0)]), "batches-token-capped")
    assert finding.evidence.startswith("max batch size 64, batch timeout 20 ms, 100.0 requests/s offered: 800 padded "
                                       "tokens per batch on average of --max-batch-tokens 2,048 (80 of 100 sent")
    topped_up = diagnose_loadtest([online(max_batch_size=64, mean_batch=20.0, by=(0, 0, 100), tokens_per_batch=1800.0)])
    assert [f.code for f in topped_up] == ["batches-token-capped"]


def test_achieved_below_offered_means_the_queue_grows_not_that_batches_never_fill():
    findings = diagnose_loadtest([online(qps=150.0, achieved=126.0, max_batch_size=64, mean_batch=27.0,
                                         by=(0, 0, 56), depth=400)])
    assert [f.code for f in findings] == ["queue-grows"]
    assert findings[0].evidence == ("max batch size 64, batch timeout 20 ms, 150.0 requests/s offered: 126.0 answered "
                                    "per s (84%), queue 400 deep at the last arrival (peak 800), p99 45 ms")
    full = only(diagnose_loadtest([online(qps=200.0, achieved=120.0, mean_batch=16.0)]), "queue-grows")
    assert "batches are full, so a larger --max-batch-size" in full.action


def test_rejections_and_timeouts_are_counted():
    findings = diagnose_loadtest([online(rejected=60, timed_out=12, p99=55.0)])
    assert [f.code for f in findings] == ["rejections", "timeouts"]
    assert findings[0].evidence == f"{AT}: 60 of 6,000 requests rejected (1.0%)"
    assert findings[1].evidence == f"{AT}: 12 of 6,000 requests timed out, p99 55 ms, max 66 ms"


def test_online_p99_far_above_p50_says_whether_it_is_queueing_or_compute():
    queueing = only(diagnose_loadtest([online(p50=10.0, p99=80.0, wait_p99=70.0)]), "latency-tail")
    assert queueing.evidence == (f"{AT}: p99 80 ms = 8.0× p50 10 ms (queue wait p99 70 ms, batch compute p99 20 ms)")
    assert queueing.action.startswith("mostly waiting in the queue")
    compute = only(diagnose_loadtest([online(p50=10.0, p99=80.0, wait_p99=5.0, compute_p99=70.0)]), "latency-tail")
    assert compute.action.startswith("long batches")


def test_a_load_test_row_must_have_every_key():
    with pytest.raises(ValueError, match="mean_batch_size"):
        diagnose_loadtest([{k: v for k, v in online().items() if k != "mean_batch_size"}])
