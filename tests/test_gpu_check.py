"""benchmarks/gpu_check.py runs its CPU path end to end, so it is ready when a GPU is at hand;
its fairness arithmetic is checked on its own."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]


def gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_check_reports_rows_per_second_end_to_end_and_on_the_device_part():
    rates = gpu_check_module().rates
    assert rates(rows=1000, real_tokens=50_000, wall_s=4.0, device_s=0.5) == {
        "rows_per_s": 250.0, "tokens_per_s": 12500, "device_rows_per_s": 2000.0, "device_share": 0.125}
    assert rates(rows=10, real_tokens=10, wall_s=1.0, device_s=0.0)["device_rows_per_s"] is None


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


@pytest.mark.slow
def test_the_gpu_check_runs_on_cpu_and_reports_every_step(tmp_path, sample_table, tiny_encoder_path):
    rows = tmp_path / "rows.parquet"
    pq.write_table(sample_table.slice(0, 60), rows)
    report_path = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--model", tiny_encoder_path, "--rows",
                                str(rows), "--json", str(report_path), "--device", "cpu", "--token-levels", "512",
                                "--correctness-rows", "16", "--memory-budget", "64MiB", "--repeat", "2"],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr
    report = json.loads(report_path.read_text())
    assert not [name for name, step in report.items() if isinstance(step, dict) and "error" in step], report
    assert report["environment"]["device"] == "cpu" and report["environment"]["attention_implementation"]
    correctness = report["correctness"]
    assert correctness["rows"] == 16 and correctness["dtype"] == report["environment"]["dtype_auto"]
    assert correctness["float32"]["min_cosine_vs_st"] >= 0.9999 and correctness["float32"]["all_finite"]
    levels = report["throughput"]["lengthwise"]
    assert [level["max_batch_tokens"] for level in levels] == [512, "auto"]
    assert all(level["rows_written"] == 120 and level["rows_per_s"] > 0 and level["device_rows_per_s"] > 0
               for level in levels)
    assert [st["batch_size"] for st in report["throughput"]["sentence_transformers"]] == [32, 256]
    assert "unavailable" in report["throughput"]["sentence_transformers_flash_attention_2"]  # no flash-attn here
    plan = report["memory_plan"]["plan"]
    assert plan["available_bytes"] == 64 * 2**20 and plan["buckets"]
    assert report["memory_plan"]["probe_peak_bytes"] == max(b["measured_peak_bytes"] for b in plan["buckets"])
    assert all(bucket["measured_peak_bytes"] <= plan["available_bytes"] for bucket in plan["buckets"])
    assert report["induced_oom"] == {"skipped": "needs CUDA (torch.cuda.set_per_process_memory_fraction)"}
    for printed in ("min cosine vs ST", "rows/s end to end", "rows/s on the device", "rows/s (warm)",
                    "buckets probed"):
        assert printed in completed.stdout, completed.stdout
