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


def gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpu_report_module():
    spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "benchmarks" / "gpu_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_check_reports_cold_steady_and_device_rates():
    rates = gpu_report_module().rates
    assert rates(rows=1000, real_tokens=50_000, padded_tokens=64_000, wall_s=4.0, setup_s=2.0, device_s=0.5) == {
        "cold_rows_per_s": 250.0, "steady_rows_per_s": 500.0, "device_rows_per_s": 2000.0,
        "device_padded_tokens_per_s": 128000.0, "real_tokens_per_s": 12500.0, "device_share": 0.125}
    assert rates(rows=10, real_tokens=10, padded_tokens=10, wall_s=1.0, setup_s=0.0, device_s=0.0)[
        "device_rows_per_s"] is None


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
    assert report.utilization(6400, 100, 6400, 1.0, per_token * 6400 * 4, dims) == 0.25
    assert report.utilization(3200, 100, 6400, 1.0, per_token * 6400 * 4, dims) == 0.125  # useful: real tokens
    assert report.utilization(6400, 100, 6400, 1.0, None, dims) is None


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
            "memory_plan": {"plan_within_budget": True},
            "induced_oom": {"lost_rows": 0, "oom_splits": 3}}


def test_the_verdict_passes_only_when_every_check_holds():
    verdict = gpu_report_module().verdict
    assert verdict(passing_report()) == {
        "passed": True, "gpu_run": True, "failed_steps": [],
        "checks": {"cosine": {"ok": True, "value": 0.9995, "needs": "min cosine vs ST in bfloat16 >= 0.999"},
                   "finite": {"ok": True, "value": [True, True], "needs": "every output finite"},
                   "lossless_oom": {"ok": True, "value": {"lost_rows": 0, "oom_splits": 3},
                                    "needs": "splits happened and no row was lost"},
                   "plan_within_budget": {"ok": True, "value": True,
                                          "needs": "every probed peak within the available bytes"}}}
    low = passing_report()
    low["correctness"]["bfloat16"]["min_cosine_vs_st"] = 0.998
    assert not verdict(low)["passed"] and verdict(low)["checks"]["cosine"]["ok"] is False
    lost = passing_report()
    lost["induced_oom"] = {"lost_rows": 2, "oom_splits": 3}
    assert verdict(lost)["checks"]["lossless_oom"]["ok"] is False
    timed_out = passing_report()
    timed_out["throughput"] = {"error": "StepDeadline: past its 80 s deadline"}
    assert verdict(timed_out)["failed_steps"] == ["throughput"] and not verdict(timed_out)["passed"]
    assert verdict({"error": "--require-cuda: no GPU"})["passed"] is False
    assert verdict(passing_report("cpu"))["gpu_run"] is False


def test_repeated_rows_keep_unique_ids_and_their_texts():
    table = pa.table({"id": [1, 2], "text": ["a", "b"]})
    repeated = gpu_check_module().repeat_rows(table, 3)
    assert repeated["id"].to_pylist() == ["1#0", "2#0", "1#1", "2#1", "1#2", "2#2"]
    assert repeated["text"].to_pylist() == ["a", "b"] * 3


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


@pytest.mark.slow
def test_the_gpu_check_runs_on_cpu_and_fills_every_block(tmp_path, sample_table, tiny_encoder_path):
    rows = tmp_path / "rows.parquet"
    pq.write_table(sample_table.slice(0, 60), rows)
    completed = run_check(tmp_path, "--model", tiny_encoder_path, "--rows", str(rows), "--device", "auto",
                          "--token-levels", "512", "--correctness-rows", "16", "--memory-budget", "64MiB",
                          "--repeat", "2", "--budget-s", "900", "--deadline-scale", "5")  # 2 shared cores
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert completed.returncode == 0, (report["verdict"], report.get("step_s"), completed.stdout[-3000:])
    assert [name for name in ("environment", "correctness", "memory_plan", "induced_oom", "throughput", "compile")
            if name not in report or "error" in report[name]] == []
    environment = report["environment"]
    assert environment["device"] == "cpu" and environment["device_requested"] == "auto"
    assert "not a GPU check" in environment["warning"] and environment["matmul_peak"]["tflops"] > 0
    correctness = report["correctness"]
    assert correctness["rows"] == 16 and correctness["dtype"] == environment["dtype_auto"]
    assert correctness["float32"]["min_cosine_vs_st"] >= 0.9999 and correctness["float32"]["all_finite"]
    assert correctness["sdpa"]["padded"]["kernel"] in ("flash_cpu", "math")
    assert correctness["sdpa"]["unpadded"]["kernel"] in ("flash_cpu", "math")
    plan = report["memory_plan"]
    assert plan["plan"]["available_bytes"] == 64 * 2**20 and plan["buckets"] and plan["plan_within_budget"]
    assert plan["probe_peak_bytes"] == max(b["measured_peak_bytes"] for b in plan["buckets"])
    oom = report["induced_oom"]
    assert oom["cap_tokens"] == 256 and oom["oom_splits"] > 0 and oom["lowered_batch_rows"]
    assert oom["rows_in"] == oom["rows_written"] == 60 and oom["lost_rows"] == 0 and oom["error_rows"] == 0
    throughput = report["throughput"]
    assert throughput["tokenizers_parallelism"] == "true" and throughput["skipped_for_time"] == []
    levels = throughput["lengthwise"]
    assert [level["max_batch_tokens"] for level in levels] == [512, "auto"]
    for level in levels:
        assert level["rows_written"] == 120 and level["compile"] == "eager: --compile off"
        assert 0 < level["cold_rows_per_s"] < level["steady_rows_per_s"] and level["device_rows_per_s"] > 0
        assert 0 < level["useful_mfu"] <= level["mfu"] and level["device_padded_tokens_per_s"] > 0
        assert level["writer_rows_per_s"] > 0  # the rate that decides whether one writer keeps up
        assert set(level["ratio_to_st"]) == {"st_batch_size", "cold_rows", "steady_rows", "device_rows",
                                             "device_padded_tokens"} and level["ratio_to_st"]["steady_rows"] > 0
    comparison = throughput["unpad_comparison"]  # auto runs padded on a CPU, so the other forward is unpadded
    assert environment["unpad"].startswith("padded: --unpad auto on a CPU") and comparison["unpadded_ran"]
    assert comparison["unpadded"]["unpad"].startswith("unpadded: BertModel on packed tokens")
    assert comparison["padded"]["rows_written"] == comparison["unpadded"]["rows_written"] == 120
    assert comparison["device_speedup_unpadded"] > 0
    assert [st["batch_size"] for st in throughput["sentence_transformers"]] == [256, 32]
    assert all(st["padded_tokens_per_s"] > 0 for st in throughput["sentence_transformers"])
    assert "unavailable" in throughput["sentence_transformers_flash_attention_2"]  # no flash-attn here
    compiled = report["compile"]
    assert compiled["compile"].startswith("compiled") and compiled["rows_written"] == 120
    assert compiled["compile_s"] > 0 and compiled["device_speedup_over_eager"] > 0
    assert compiled["unpad"] == "padded: the forward runs compiled"  # a compiled forward never runs unpadded
    assert report["verdict"]["passed"] and not report["verdict"]["gpu_run"]
    assert report["verdict"]["checks"]["lossless_oom"]["ok"] and set(report["definitions"]) >= {
        "cold_rows_per_s", "steady_rows_per_s", "mfu", "sdpa_kernel", "lossless_oom"}
    assert set(report["step_s"]) == {"environment", "correctness", "memory_plan", "induced_oom", "throughput",
                                     "compile"}
    for printed in ("min cosine vs ST", "rows/s cold", "on the device", "rows/s (warm)", "buckets probed",
                    "SDPA kernel", "verdict: passed"):
        assert printed in completed.stdout, completed.stdout
