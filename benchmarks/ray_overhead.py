"""What `--engine ray` costs against a local run, and how it scales, on one machine.

Runs `lengthwise run` end to end (the command's wall time: listing, model load, reading,
tokenizing, forward, writing) over the same shards, once locally and once per Ray layout on a
local Ray cluster started by this script, with the same settings otherwise. The memory plan is
probed and cached first, untimed. Results go to a JSON file and a table on stdout.

    .venv/bin/python benchmarks/ray_overhead.py --json benchmarks/results/ray_overhead_tweets.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEFAULT_INPUT = str(ROOT.parent / "shared" / "data" / "tweets")
LAYOUTS = {  # name → extra flags, torch threads of the local run
    "local-2-threads": ([], "2"),
    "ray-1-actor-x-2-threads": (["--engine", "ray", "--workers", "1", "--threads-per-worker", "2"], None),
    "ray-2-actors-x-1-thread": (["--engine", "ray", "--workers", "2", "--threads-per-worker", "1"], None),
    "ray-1-actor-x-1-thread": (["--engine", "ray", "--workers", "1", "--threads-per-worker", "1"], None),
    "local-1-thread": ([], "1"),
}


def run(args: list[str], env: dict) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as scratch:
        summary_path = Path(scratch) / "summary.json"
        started = time.perf_counter()
        completed = subprocess.run([str(BIN / "lengthwise"), "run", *args, "--output", f"{scratch}/out",
                                    "--summary-json", str(summary_path), "--no-progress", "--quiet"],
                                   env=env, capture_output=True, text=True)
        wall_s = time.perf_counter() - started
        if completed.returncode != 0:
            raise SystemExit(f"lengthwise {' '.join(args)} failed:\n{completed.stderr}")
        return wall_s, json.loads(summary_path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", default=DEFAULT_INPUT)
    parser.add_argument("--max-length", default="128")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--dtype", default="float32", help="the same for every layout")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names of LAYOUTS to run")
    options = parser.parse_args()
    options.dtype_flag = ["--dtype", options.dtype]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--input", options.input, "--max-length", options.max_length, *options.dtype_flag]
    # the memory plan and the dtype decision are probed and cached first, untimed, as a nightly run finds them
    subprocess.run([str(BIN / "lengthwise"), "plan", "--max-length", options.max_length, *options.dtype_flag], env=env,
                   check=True, capture_output=True)
    subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True)
    subprocess.run([str(BIN / "ray"), "start", "--head", "--num-cpus=2", "--num-gpus=0", "--include-dashboard=false",
                    "--disable-usage-stats"], env=env, capture_output=True, check=True)
    results = []
    try:
        for name in options.layouts.split(","):
            flags, threads = LAYOUTS[name]
            layout_env = {**env, **({"OMP_NUM_THREADS": threads} if threads else {})}
            extra = ["--ray-address", "auto"] if "--engine" in flags else []
            wall_s, summary = run(common + flags + extra, layout_env)
            results.append({"layout": name, "wall_s": round(wall_s, 2), "rows": summary["rows"],
                            "rows_per_s": round(summary["rows"] / wall_s, 1),
                            "padding_efficiency": round(summary["padding_efficiency"], 4),
                            "actors": summary.get("workers", [])})
            print(f"{name:24s} {summary['rows']:>7,} rows in {wall_s:8.1f}s = {summary['rows'] / wall_s:7.1f} rows/s",
                  flush=True)
    finally:
        subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True)
    import torch

    report = {"input": options.input, "max_length": options.max_length, "dtype": options.dtype, "cpu": platform.processor() or
              platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
              "results": results}
    if options.json:
        Path(options.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
