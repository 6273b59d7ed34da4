"""How long a fresh memory probe takes, and whether every bucket it measured stayed in budget.

Runs `lengthwise plan --no-plan-cache` (the probe, nothing cached) at several budgets with the
token budget off (`--max-batch-tokens` 2^30: batches sized by memory alone, the most expensive
case), and records the wall time, the probe's own seconds and each bucket's measured peak.

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
    args = parser.parse_args()
    from pipeline.memory import parse_bytes

    results = []
    for budget in args.budgets.split(","):
        started = time.perf_counter()
        completed = subprocess.run([str(BIN / "lengthwise"), "plan", "--no-plan-cache", "--memory-budget", budget,
                                    "--max-batch-tokens", str(2**30), "--max-length", args.max_length, "--dtype",
                                    args.dtype, "--json", "--quiet"], capture_output=True, text=True, check=True)
        wall_s = time.perf_counter() - started
        plan = json.loads(completed.stdout)
        within = all(b["measured_peak_bytes"] <= parse_bytes(budget) for b in plan["buckets"])
        results.append({"budget": budget, "wall_s": round(wall_s, 1), "probe_s": plan["probe_s"],
                        "all_peaks_within_budget": within,
                        "buckets": [{k: b[k] for k in ("length", "formula_rows", "probed_rows", "measured_peak_bytes")}
                                    for b in plan["buckets"]]})
        rows = ", ".join(f"{b['length']}:{b['probed_rows']}" for b in plan["buckets"])
        print(f"{budget:>7}: plan in {wall_s:5.1f}s (probe {plan['probe_s']}s), peaks within budget: {within}; "
              f"rows per length {rows}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"max_length": args.max_length, "dtype": args.dtype, "results": results},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
