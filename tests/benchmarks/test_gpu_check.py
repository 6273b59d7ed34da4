"""benchmarks/gpu_check.py runs its CPU path end to end, so it is ready when a GPU is at hand;
its fairness arithmetic is checked on its own."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[2]


def benchmark_module(name: str):
    """benchmarks/NAME.py, imported (the folder is no package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpu_check_module():
    return benchmark_module("gpu_check")


def gpu_measure_module():
    gpu_check_module()  # which puts benchmarks/ on the path and imports gpu_measure beside it
    return sys.modules["gpu_measure"]


def gpu_report_module():
    return benchmark_module("gpu_report")


def test_the_check_reports_cold_past_setup_steady_and_device_rates():
    rates = gpu_report_module().rates
    assert rates(rows=1000, real_tokens=50_000, padded_tokens=64_000, wall_s=4.0, setup_s=2.0, device_s=0.5,
                 span_rows=900, span_s=0.9) == {
        "cold_rows_per_s": 250.0, "past_setup_rows_per_s": 500.0, "steady_rows_per_s": 1000.0,
        "device_rows_per_s": 2000.0, "device_padded_tokens_per_s": 128000.0, "real_tokens_per_s": 12500.0,
        "device_share": 0.125}
    assert rates(rows=10, real_tokens=10, padded_tokens=10, wall_s=1.0, setup_s=0.0, device_s=0.0, span_rows=0,
                 span_s=0.0)["device_rows_per_s"] is None


def test_the_steady_rate_runs_from_the_first_batch_to_the_last():
    steady_span = gpu_report_module().steady_span
    # the first batch's result at 10.0 s (its 64 rows are before the span), the last's at 12.5 s
    assert steady_span([(10.0, 64), (11.0, 64), (12.5, 32)]) == (96, 2.5)
    assert steady_span([(10.0, 64)]) == (0, 0.0)


def test_throughput_windows_cut_the_rows_at_least_five_times():
    window_rows = gpu_report_module().throughput_window_rows
    assert window_rows(80_000, 5, 65_536) == 16_000  # 80k rows were two 65,536-row windows: mostly fill and drain
    assert window_rows(120, 5, 65_536) == 24
    assert window_rows(1_000_000, 5, 65_536) == 65_536
    assert window_rows(3, 5, 65_536) == 1


def test_sentence_transformers_padded_tokens_follow_its_sorted_batches():
    # sorted longest first: [9, 5] [4, 3] [1] → 2·9 + 2·4 + 1·1
    assert gpu_report_module().encode_padded_tokens([3, 9, 1, 5, 4], batch_size=2) == 27
    assert gpu_report_module().encode_padded_tokens([7], batch_size=32) == 7


def test_mfu_counts_projection_and_attention_flops_against_the_measured_peak():
    report = gpu_report_module()
    # MiniLM-L6: h 384, i 1536, 6 layers, at a mean padded length of 64
    assert report.flops_per_token(384, 1536, 6, 64) == 6 * (2 * (4 * 384**2 + 2 * 384 * 1536) + 4 * 64 * 384)
    dims = {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6}
    per_token = report.flops_per_token(384, 1536, 6, 64)
    assert report.utilization(6400, 64, 1.0, per_token * 6400 * 4, dims) == 0.25
    assert report.utilization(6400, 64, 1.0, None, dims) is None
    assert report.utilization(1, 64, 1.0, per_token * 1e9, dims) == 1e-9  # a tiny model's MFU is not rounded to 0


def test_an_unpadded_levels_mfu_counts_the_real_tokens_it_computed():
    report = gpu_report_module()
    dims = {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6}
    peak = report.flops_per_token(384, 1536, 6, 64) * 6400 * 4  # 100 rows padded to 64: MFU 0.25
    padded = report.level_mfu(100, 3200, 6400, 1.0, peak, dims, unpadded=False)
    unpadded = report.level_mfu(100, 3200, 6400, 1.0, peak, dims, unpadded=True)
    real = report.utilization(3200, 32, 1.0, peak, dims)  # 3,200 real tokens, attention at their mean length 32
    assert padded == {"mfu": 0.25, "mfu_tokens": "padded", "real_token_mfu": real}
    assert unpadded == {"mfu": real, "mfu_tokens": "real", "real_token_mfu": real} and real < 0.125


@pytest.mark.parametrize("names, kind", [
    (["aten::_scaled_dot_product_flash_attention_for_cpu", "aten::linear"], "flash_cpu"),
    (["aten::_scaled_dot_product_flash_attention", "void pytorch_flash::flash_fwd_kernel<...>"], "flash"),
    (["aten::_scaled_dot_product_efficient_attention", "fmha_cutlassF_bf16_aligned_64x64"], "efficient"),
    (["aten::_scaled_dot_product_cudnn_attention"], "cudnn"),
    (["aten::_scaled_dot_product_attention_math", "aten::softmax"], "math"),
    (["aten::matmul", "aten::softmax"], "none seen"),
])
def test_the_sdpa_kernel_is_read_off_profiler_names(names, kind):
    assert gpu_report_module().sdpa_kernel(names) == kind


def test_a_step_never_runs_past_what_is_left_of_the_budget():
    deadline = gpu_report_module().step_deadline_s
    assert deadline(own_s=40, budget_s=240, elapsed_s=10) == 40
    assert deadline(own_s=80, budget_s=240, elapsed_s=200) == 40
    assert deadline(own_s=80, budget_s=240, elapsed_s=250) == 0


def passing_report(device="cuda:0"):
    return {"environment": {"device": device},
            "correctness": {"dtype": "bfloat16", "float32": {"min_cosine_vs_st": 0.99999, "all_finite": True},
                            "bfloat16": {"min_cosine_vs_st": 0.9995, "all_finite": True}},
            "throughput": {"lengthwise": [{"name": "auto", "deduplicated_rows": 0},
                                          {"name": "auto-unpad-off", "deduplicated_rows": 0}], "skipped_for_time": []},
            "memory_plan": {"plan_within_budget": True},
            "induced_oom": {"lost_rows": 0, "oom_splits": 3},
            "compile": {"rows_written": 10, "deduplicated_rows": 0, "device_speedup_over_eager": 1.3, "compile_s": 41}}


def test_the_verdict_passes_only_when_every_check_holds():
    verdict = gpu_report_module().verdict
    assert verdict(passing_report()) == {
        "passed": True, "gpu_run": True, "failed_steps": [], "skipped_for_time": [],
        "compile": "1.3x eager on the device, compiled in 41 s",
        "checks": {"cosine": {"ok": True, "value": 0.9995, "needs": "min cosine vs ST in bfloat16 >= 0.999"},
                   "finite": {"ok": True, "value": [True, True], "needs": "every output finite"},
                   "lossless_oom": {"ok": True, "value": {"lost_rows": 0, "oom_splits": 3},
                                    "needs": "splits happened and no row was lost"},
                   "plan_within_budget": {"ok": True, "value": True,
                                          "needs": "every probed peak within the available bytes"},
                   "every_row_computed": {"ok": True, "value": 0,
                                          "needs": "0 deduplicated rows in every throughput level"}}}
    low = passing_report()
    low["correctness"]["bfloat16"]["min_cosine_vs_st"] = 0.998
    assert not verdict(low)["passed"] and verdict(low)["checks"]["cosine"]["ok"] is False
    lost = passing_report()
    lost["induced_oom"] = {"lost_rows": 2, "oom_splits": 3}
    assert verdict(lost)["checks"]["lossless_oom"]["ok"] is False
    copied = passing_report()
    copied["throughput"]["lengthwise"][1]["deduplicated_rows"] = 26_000  # the rows ST computes and lengthwise copied
    assert verdict(copied)["checks"]["every_row_computed"] == {
        "ok": False, "value": 26_000, "needs": "0 deduplicated rows in every throughput level"}
    broken = passing_report()
    broken["throughput"]["error"] = "KeyError: 'write'"
    assert verdict(broken)["failed_steps"] == ["throughput"] and not verdict(broken)["passed"]
    assert verdict({"error": "--require-cuda: no GPU"})["passed"] is False
    assert verdict(passing_report("cpu"))["gpu_run"] is False


def test_what_time_cut_short_is_listed_apart_from_failures():
    """A level not started or a step cut by its deadline is no failure: a run whose checks all
    passed exits 0; a slow or failed compile stands beside `passed`, not in it."""
    verdict = gpu_report_module().verdict
    short = passing_report()
    short["throughput"].update(timed_out="past its 80 s deadline", skipped_for_time=["262144"])
    short["compile"] = {"not_run": "no time left in --budget-s"}
    assert verdict(short)["passed"] and verdict(short)["failed_steps"] == []
    assert verdict(short)["skipped_for_time"] == ["throughput", "throughput: 262144", "compile"]
    assert verdict(short)["compile"] == "not run: no time left in --budget-s"
    slow_compile = passing_report()
    slow_compile["compile"] = {"eager_level": "auto", "timed_out": "past its 20 s deadline"}
    assert verdict(slow_compile)["passed"] and verdict(slow_compile)["compile"] == "timed out: past its 20 s deadline"
    failed_compile = passing_report()
    failed_compile["compile"] = {"error": "BackendCompilerFailed: no g++"}
    assert verdict(failed_compile)["passed"] and verdict(failed_compile)["compile"].startswith("error: Backend")
    no_plan = passing_report()
    no_plan["memory_plan"] = {"not_run": "no time left in --budget-s"}  # a check that did not run did not pass
    assert not verdict(no_plan)["passed"] and verdict(no_plan)["failed_steps"] == []
    assert verdict(no_plan)["checks"]["plan_within_budget"] == {
        "ok": False, "value": "not run: no time left in --budget-s",
        "needs": "every probed peak within the available bytes"}
    assert verdict(no_plan)["skipped_for_time"] == ["memory_plan"]


def test_throughput_rows_are_distinct_texts_of_the_same_tokens(minilm_path, sample_table):
    from transformers import AutoTokenizer

    table = pa.table({"id": [1, 2, 3, 4], "text": ["a b c", "just", "a b c", None]})
    distinct, dropped = gpu_measure_module().distinct_rows(table, 3)
    assert distinct["id"].to_pylist() == ["1#0", "2#0", "1#1", "1#2"]  # "just" rotates to itself; dupes, nulls go
    assert distinct["text"].to_pylist() == ["a b c", "just", "b c a", "c a b"] and dropped == 8
    rows = sample_table.slice(0, 60)
    distinct, dropped = gpu_measure_module().distinct_rows(rows, 2)
    texts = distinct["text"].to_pylist()
    assert len(set(texts)) == len(texts) == 120 and dropped == 0
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    assert lengths[60:] == lengths[:60]  # the same work for every copy, other texts


def test_the_weights_stored_dtype_is_read_off_the_safetensors_header(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"encoder.weight": np.zeros((4, 4), np.float16), "encoder.bias": np.zeros(4, np.float16),
               "position_ids": np.arange(4)}, str(tmp_path / "model.safetensors"))
    assert gpu_measure_module().stored_weight_dtypes(str(tmp_path)) == {"float16": 2, "int64": 1}
    assert gpu_measure_module().stored_weight_dtypes(str(tmp_path / "absent")) is None


def test_a_step_past_its_deadline_keeps_the_levels_that_finished(tmp_path):
    """Each level is in the JSON as it ends; a deadline then keeps them, marks the step timed
    out (not failed), and the file is always whole (written aside and renamed)."""
    gpu_check = gpu_check_module()
    path = tmp_path / "gpu_check.json"
    args = gpu_check.parse_args(["--model", "m", "--rows", "r.parquet", "--json", str(path)])
    check = gpu_check.Check(args, None, tmp_path, budget_s=60, report=passing_report())
    seen_on_disk = []

    def two_levels_then_stuck(block):
        block.update(lengthwise=[], skipped_for_time=[])
        for name in ("auto", "auto-unpad-off"):
            block["lengthwise"].append({"name": name, "deduplicated_rows": 0})
            check.save()
            seen_on_disk.append([level["name"] for level in json.loads(path.read_text())["throughput"]["lengthwise"]])
        time.sleep(10)  # the next level outlasts the deadline

    started = time.monotonic()
    gpu_check.run_step(check, "throughput", two_levels_then_stuck, seconds=0.5)
    assert time.monotonic() - started < 3
    assert seen_on_disk == [["auto"], ["auto", "auto-unpad-off"]]
    report = json.loads(path.read_text())
    assert [level["name"] for level in report["throughput"]["lengthwise"]] == ["auto", "auto-unpad-off"]
    assert report["throughput"]["timed_out"] == "past its 0.5 s deadline" and "error" not in report["throughput"]
    assert report["verdict"]["passed"] and report["verdict"]["failed_steps"] == []
    assert report["verdict"]["skipped_for_time"] == ["throughput"]
    assert [p.name for p in tmp_path.iterdir()] == ["gpu_check.json"]  # no partial file left


def test_the_check_imports_no_torch_at_module_level():
    """Every spawned tokenizer worker imports the script again: torch there costs seconds and
    hundreds of MB each."""
    script = str(ROOT / "benchmarks" / "gpu_check.py")
    code = (f"import sys, importlib.util; spec = importlib.util.spec_from_file_location('g', {script!r}); "
            "spec.loader.exec_module(importlib.util.module_from_spec(spec)); print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def run_check(tmp_path, *arguments, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--json", str(tmp_path / "gpu_check.json"),
                           *arguments], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_require_cuda_on_a_cpu_exits_2_within_seconds_with_its_json(tmp_path):
    started = time.monotonic()
    completed = run_check(tmp_path, "--require-cuda", "--model", "unused", "--rows", "unused.parquet", timeout=30)
    assert completed.returncode == 2 and time.monotonic() - started < 30
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["error"].startswith("--require-cuda: torch ") and "sees no GPU" in report["error"]
    assert report["verdict"]["passed"] is False and report["verdict"]["gpu_run"] is False
    assert report["definitions"]["mfu"] and "--require-cuda" in completed.stderr


def test_a_bad_device_still_leaves_its_json(tmp_path):
    completed = run_check(tmp_path, "--device", "tpu", "--model", "unused", "--rows", "unused.parquet", timeout=60)
    assert completed.returncode == 2
    assert "set --device to auto, cpu or cuda" in json.loads((tmp_path / "gpu_check.json").read_text())["error"]


STEPS = ["environment", "correctness", "throughput", "memory_plan", "induced_oom", "compile"]


def rows_of_one_padded_length(table: pa.Table, tokenizer_path: str, rows: int, tokens: range) -> pa.Table:
    """The first `rows` rows of `tokens` tokens: a window of them is one batch (no row is under
    7/8 of the longest, which would close it). A dry run checks the plumbing, not the packing, and
    on 2 shared cores a tiny model's forward, 1.5 ms alone, takes up to 170 ms while other
    processes hold the cores."""
    from transformers import AutoTokenizer

    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(tokenizer_path)(table["text"].to_pylist())[
        "input_ids"]]
    return table.take([i for i, length in enumerate(lengths) if length in tokens][:rows])


@pytest.mark.slow
def test_the_gpu_check_runs_on_cpu_and_fills_every_block(tmp_path, sample_table, tiny_encoder_path, minilm_path):
    rows = tmp_path / "rows.parquet"
    pq.write_table(rows_of_one_padded_length(sample_table, minilm_path, 40, range(15, 18)), rows)
    completed = run_check(tmp_path, "--model", tiny_encoder_path, "--rows", str(rows), "--device", "auto",
                          "--token-levels", "512", "--correctness-rows", "16", "--memory-budget", "64MiB",
                          "--plan-memory-budget", "64MiB", "--repeat", "2", "--budget-s", "900",
                          "--deadline-scale", "5")  # 2 shared cores
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert completed.returncode == 0, (report["verdict"], report.get("step_s"), completed.stdout[-3000:])
    assert report["steps"] == list(report["step_s"]) == STEPS  # correctness, throughput, then the other checks
    assert [name for name in STEPS if set(report[name]) & {"error", "timed_out", "not_run", "skipped"}] == []
    assert report["before_clock"]["imports_s"] > 0 and report["budget_s"] == 900
    environment = report["environment"]
    assert environment["device"] == "cpu" and environment["device_requested"] == "auto"
    assert "not a GPU check" in environment["warning"] and environment["matmul_peak"]["tflops"] > 0
    assert environment["weights_stored_dtype"] == {"float32": 39}  # the tiny model as saved; gpu_assets: float16
    assert 1 <= environment["usable_cores"] <= environment["cores"] and "gxx" in environment
    correctness = report["correctness"]
    assert correctness["rows"] == 16 and correctness["dtype"] == environment["dtype_auto"]
    assert correctness["float32"]["min_cosine_vs_st"] >= 0.9999 and correctness["float32"]["all_finite"]
    assert correctness["sdpa"]["padded"]["kernel"] in ("flash_cpu", "math")
    assert correctness["sdpa"]["unpadded"]["kernel"] in ("flash_cpu", "math")
    plan = report["memory_plan"]
    assert plan["budget_bytes"] == plan["plan"]["available_bytes"] == 64 * 2**20
    assert plan["buckets"] and plan["plan_within_budget"]
    assert plan["probe_peak_bytes"] == max(b["measured_peak_bytes"] for b in plan["buckets"])
    oom = report["induced_oom"]
    assert oom["cap_tokens"] == 256 and oom["oom_splits"] > 0 and oom["lowered_batch_rows"]
    assert oom["rows_in"] == oom["rows_written"] == 40 and oom["lost_rows"] == 0 and oom["error_rows"] == 0
    assert report["throughput_rows"] == {"rows": 80, "duplicate_texts_dropped": 0, "window_rows": 16}
    throughput = report["throughput"]
    assert throughput["tokenizers_parallelism"] == "true" and throughput["skipped_for_time"] == []
    levels = throughput["lengthwise"]
    assert [level["name"] for level in levels] == ["auto", "auto-unpad-on", "512"]  # auto and its flip first
    for level in levels:
        assert level["rows_written"] == 80 and level["deduplicated_rows"] == 0 and level["windows"] == 5
        assert level["compile"] == "eager: --compile off" and level["batches"] == 5  # a batch a window
        assert 0 < level["cold_rows_per_s"] < level["past_setup_rows_per_s"] and level["steady_rows_per_s"] > 0
        assert 0 < level["steady_span_s"] < level["wall_s"] - level["setup_s"] and level["device_rows_per_s"] > 0
        assert 0 < level["real_token_mfu"] <= level["mfu"] and level["device_padded_tokens_per_s"] > 0
        assert level["writer_rows_per_s"] > 0  # the rate that decides whether one writer keeps up
        assert set(level["ratio_to_st"]) == {"st_batch_size", "cold_rows", "past_setup_rows", "steady_rows",
                                             "device_rows", "device_padded_tokens"}
        assert level["ratio_to_st"]["steady_rows"] > 0
    auto, unpadded, _ = levels
    assert environment["unpad"].startswith("padded: --unpad auto on a CPU") and auto["mfu_tokens"] == "padded"
    assert unpadded["unpad"].startswith("unpadded: BertModel on packed tokens") and unpadded["mfu_tokens"] == "real"
    assert unpadded["mfu"] == unpadded["real_token_mfu"]
    comparison = throughput["unpad_comparison"]  # auto runs padded on a CPU, so the other forward is unpadded
    assert comparison["padded"] == "auto" and comparison["unpadded"] == "auto-unpad-on" and comparison["unpadded_ran"]
    assert comparison["device_speedup_unpadded"] > 0
    assert [st["batch_size"] for st in throughput["sentence_transformers"]] == [256, 32]
    assert all(st["padded_tokens_per_s"] > 0 for st in throughput["sentence_transformers"])
    assert "unavailable" in throughput["sentence_transformers_flash_attention_2"]  # no flash-attn here
    compiled = report["compile"]
    assert compiled["compile"].startswith("compiled") and compiled["rows_written"] == 80
    assert compiled["compile_s"] > 0 and compiled["device_speedup_over_eager"] > 0
    assert compiled["eager_level"] in ("auto", "auto-unpad-on", "512") and compiled["deduplicated_rows"] == 0
    assert compiled["unpad"] == "padded: the forward runs compiled"  # a compiled forward never runs unpadded
    verdict = report["verdict"]
    assert verdict["passed"] and not verdict["gpu_run"] and verdict["skipped_for_time"] == []
    assert verdict["checks"]["lossless_oom"]["ok"] and verdict["checks"]["every_row_computed"]["value"] == 0
    assert verdict["compile"].startswith(f"{compiled['device_speedup_over_eager']}x eager")
    assert set(report["definitions"]) >= {"cold_rows_per_s", "steady_rows_per_s", "mfu", "real_token_mfu",
                                          "sdpa_kernel", "lossless_oom", "skipped_for_time"}
    assert [p.name for p in tmp_path.iterdir() if "gpu_check" in p.name] == ["gpu_check.json"]  # no partial left
    for printed in ("min cosine vs ST", "rows/s cold", "on the device", "rows/s (warm)", "buckets probed",
                    "SDPA kernel", "the 900 s budget starts now", "verdict: passed"):
        assert printed in completed.stdout, completed.stdout
