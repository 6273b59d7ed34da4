"""The padded against the unpadded forward on the CPU: `lengthwise run` on real rows, the same
rows both ways, in interleaved rounds (best of the rounds), at each thread count; rows/s of the
whole run and of the forward alone, and the largest difference between the two outputs.

    .venv/bin/python benchmarks/unpad_cpu.py --data ../shared/data/tweets --rows 2000 --max-length 128 \\
        --threads 1,2 --json benchmarks/results/unpad-cpu-tweets.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from writer import cpu_model  # beside this script


def first_rows(folder: Path, rows: int, out: Path) -> Path:
    """The first `rows` rows (id, text) of the data set's shards, as one shard under `out`."""
    import pyarrow as pa

    tables, count = [], 0
    for path in sorted(folder.glob("*.parquet")):
        table = pq.read_table(path, columns=["id", "text"])
        tables.append(table.slice(0, rows - count))
        count += tables[-1].num_rows
        if count >= rows:
            break
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.concat_tables(tables), out / "part-00000.parquet")
    return out


def embeddings(output: Path) -> np.ndarray:
    table = pq.read_table(output, columns=["embedding"])
    return np.stack(table["embedding"].to_numpy(zero_copy_only=False))


def main() -> None:
    from pipeline.offline.config import RunConfig
    from pipeline.engines.local import run_job

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        inputs = first_rows(args.data, args.rows, scratch / "in")
        for threads in [int(t) for t in args.threads.split(",")]:
            def run(unpad: str, output: Path):
                return run_job(RunConfig.of(input=(str(inputs),), output=str(output), device="cpu", dtype="float32",
                                            compile="off", unpad=unpad, torch_threads=threads, tokenize_workers=0,
                                            max_length=args.max_length, progress=False,
                                            plan_cache=str(scratch / "plans")))

            run("off", scratch / f"warm-up-{threads}")  # the memory plan probed and cached, untimed
            best: dict = {}
            for round_ in range(args.rounds):
                for unpad in ("off", "on"):
                    output = scratch / f"out-{threads}-{unpad}-{round_}"
                    started = time.perf_counter()
                    summary = run(unpad, output)
                    wall_s = time.perf_counter() - started
                    forward_s = summary.stage_s["forward"]
                    figures = {"wall_s": round(wall_s, 2), "forward_s": round(forward_s, 2),
                               "rows_per_s": round(summary.rows / wall_s, 1),
                               "forward_rows_per_s": round(summary.rows / forward_s, 1),
                               "padding_efficiency": round(summary.padding_efficiency, 4), "unpad": summary.unpad}
                    if unpad not in best or figures["forward_s"] < best[unpad]["forward_s"]:
                        best[unpad] = {**figures, "output": output}
            difference = float(np.abs(embeddings(best["on"].pop("output")) - embeddings(best["off"].pop("output")))
                               .max())
            row = {"threads": threads, "padded": best["off"], "unpadded": best["on"],
                   "forward_speedup": round(best["off"]["forward_s"] / best["on"]["forward_s"], 3),
                   "wall_speedup": round(best["off"]["wall_s"] / best["on"]["wall_s"], 3),
                   "max_abs_difference": difference}
            results.append(row)
            print(f"{threads} thread(s): padded {best['off']['rows_per_s']} rows/s "
                  f"(forward {best['off']['forward_rows_per_s']}), unpadded {best['on']['rows_per_s']} "
                  f"(forward {best['on']['forward_rows_per_s']}): forward {row['forward_speedup']}x, "
                  f"max |difference| {difference:.2e}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"data": str(args.data), "rows": args.rows, "max_length": args.max_length,
                                         "cpu": cpu_model(), "results": results},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
