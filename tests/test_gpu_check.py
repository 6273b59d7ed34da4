"""benchmarks/gpu_check.py runs its CPU path end to end, so it is ready when a GPU is at hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_check_runs_on_cpu_and_reports_every_step(tmp_path, sample_table, tiny_encoder_path):
    rows = tmp_path / "rows.parquet"
    pq.write_table(sample_table.slice(0, 60), rows)
    report_path = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--model", tiny_encoder_path, "--rows",
                                str(rows), "--json", str(report_path), "--device", "cpu", "--token-levels", "512",
                                "--correctness-rows", "16", "--memory-budget", "64MiB"],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr
    report = json.loads(report_path.read_text())
    assert not [name for name, step in report.items() if isinstance(step, dict) and "error" in step], report
    assert report["environment"]["device"] == "cpu" and report["environment"]["attention_implementation"]
    correctness = report["correctness"]
    assert correctness["rows"] == 16
    assert correctness["float32"]["min_cosine"] >= 0.9999 and correctness["float32"]["all_finite"]
    assert correctness["bfloat16"]["min_cosine"] >= 0.99 and correctness["bfloat16"]["all_finite"]
    levels = report["throughput"]["lengthwise"]
    assert [level["max_batch_tokens"] for level in levels] == [512, "auto"]
    assert all(level["rows_written"] == 60 and level["rows_per_s"] > 0 for level in levels)
    assert [st["batch_size"] for st in report["throughput"]["sentence_transformers"]] == [32, 256]
    plan = report["memory_plan"]["plan"]
    assert plan["available_bytes"] == 64 * 2**20 and plan["buckets"]
    assert all(bucket["measured_peak_bytes"] <= plan["available_bytes"] for bucket in plan["buckets"])
    assert report["induced_oom"] == {"skipped": "needs CUDA (torch.cuda.set_per_process_memory_fraction)"}
