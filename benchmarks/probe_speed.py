"""How long a fresh memory probe takes, and whether every bucket's batch fits the budget.

Runs `lengthwise plan --no-plan-cache` (the probe, nothing cached) at several budgets with the
token budget off (`--max-batch-tokens` 2^30: batches sized by memory alone, the most expensive
case), and records the wall time, the probe's own seconds and each bucket's measured peak.
Then, in a fresh process, every bucket's planned batch (its length × its rows) runs once and
its real peak is measured above the process's resident set before its first forward, as the
probe counts, so buckets the probe covered or interpolated are checked too.

    .venv/bin/python benchmarks/probe_speed.py --json benchmarks/results/probe_speed_cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="512MiB,2GiB,8GiB")
    parser.add_argument("--max-length", default="256")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--check-plan", action="store_true", help=argparse.SUPPRESS)  # the checking process
    args = parser.parse_args()
    if args.check_plan:
        return check_plan(json.loads(sys.stdin.read()), args.dtype)
    from pipeline.core.units import parse_bytes

    results = []
    for budget in args.budgets.split(","):
        started = time.perf_counter()
        completed = subprocess.run([str(BIN / "lengthwise"), "plan", "--no-plan-cache", "--memory-budget", budget,
                                    "--max-batch-tokens", str(2**30), "--max-length", args.max_length, "--dtype",
                                    args.dtype, "--json", "--quiet"], capture_output=True, text=True, check=True)
        wall_s = time.perf_counter() - started
        plan = json.loads(completed.stdout)
        checked = subprocess.run([sys.executable, __file__, "--check-plan", "--dtype", args.dtype],
                                 input=completed.stdout, capture_output=True, text=True, check=True)
        real_peaks = json.loads(checked.stdout)
        buckets = [{**{k: b[k] for k in ("length", "formula_rows", "probed_rows", "measured_peak_bytes", "check")},
                    "real_peak_bytes": peak} for b, peak in zip(plan["buckets"], real_peaks)]
        within = all(b["real_peak_bytes"] <= parse_bytes(budget) for b in buckets)
        results.append({"budget": budget, "wall_s": round(wall_s, 1), "probe_s": plan["probe_s"],
                        "buckets_run_at_full_size": sum(b["check"] == "measured" for b in buckets),
                        "every_bucket_within_budget": within,
                        "largest_real_peak_share": round(max(b["real_peak_bytes"] for b in buckets)
                                                         / parse_bytes(budget), 3),
                        "buckets": buckets})
        rows = ", ".join(f"{b['length']}:{b['probed_rows']}" for b in plan["buckets"])
        print(f"{budget:>7}: plan in {wall_s:5.1f}s (probe {plan['probe_s']}s), every bucket's real peak within "
              f"budget: {within}; rows per length {rows}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"max_length": args.max_length, "dtype": args.dtype, "results": results},
                                        indent=2) + "\n")


def check_plan(plan: dict, dtype: str) -> None:
    """Print the real peak of every bucket's planned batch, run once each in this fresh process,
    each counted from before the first forward (one-off buffers included)."""
    import torch

    from pipeline.core.settings import BatchSettings, ModelSettings
    from pipeline.core.device import resident_bytes
    from pipeline.runtime.model import load_model
    from pipeline.core.probe import forward_peak_bytes

    loaded = load_model(ModelSettings(device="cpu", dtype=dtype), BatchSettings())
    device, since = torch.device("cpu"), resident_bytes()
    print(json.dumps([forward_peak_bytes(loaded.job, loaded.model, device, b["probed_rows"], b["length"], since)
                      for b in plan["buckets"]]))


if __name__ == "__main__":
    main()
