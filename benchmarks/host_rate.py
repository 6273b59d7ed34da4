"""Host rate: the rows/s the pipeline moves when the device costs nothing, against the bare
minimum of the same work on the same cores.

On a GPU the host binds first (docs/performance.md, "The host feeds the device"), so this
measures the host alone, on any CPU:

- **pipeline**: the real `lengthwise run` (`pipeline.api.run`: listing, reading, windows,
  dedupe, the tokenizer pool, buckets, collate, the device loop, the writer, commits), with the
  device step replaced by one that returns zeros of the job's output shape. That replacement is a
  harness of this file alone: no flag reaches it. As on a GPU host, the batches are built by a feeder
  process (offline/feeder.py) and the pool is sized for a device step that needs no core: every usable
  core (`--tokenize-workers`). `--in-process-producer` also measures the run with its batches built in
  its own process, as a CPU run builds them, reported apart.
- **bare**: pyarrow reads each shard's text column, the fast tokenizer's own `encode_batch`
  (Rust, on every core) tokenizes it, and a zstd Parquet write stores the id and a float32
  column of the job's output width.

Both run on the same rows (distinct texts: two random tweets of ../shared/data/tweets joined,
civil-comment-like, ~54 tokens), each in a fresh process, interleaved over --repeats. The
figures: rows/s from the first row read to the last commit (the pipeline's setup, model load and
pool start, is not counted; the bare side's tokenizer load is not either), and CPU µs per row over
the same span of the main process (each of its threads), of the feeder process, of each pool worker, of the
output encoder process and of the shard reader process, sampled from /proc. The report's rates are the best
repeat's; its main-process µs a row is the median over the repeats (a VM moves it ±0.5 between runs of
the same code).

    .venv/bin/python benchmarks/host_rate.py --rows 128000 --json benchmarks/results/host_rate.json
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
TWEETS = HERE.parent.parent / "shared" / "data" / "tweets"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def make_rows(rows: int, folder: Path, shards: int, seed: int = 0) -> None:
    """`rows` distinct texts, each two random tweets joined, in `shards` Parquet shards (id, text)."""
    files = sorted(glob.glob(str(TWEETS / "*.parquet")))
    if not files:
        sys.exit(f"host_rate: no tweets at {TWEETS} (../shared/data/tweets beside the checkout)")
    tweets = np.array(pa.concat_arrays([pq.read_table(f, columns=["text"])["text"].combine_chunks()
                                        for f in files]).to_pylist(), dtype=object)
    rng = np.random.default_rng(seed)
    texts: list[str] = []
    seen: set[str] = set()
    while len(texts) < rows:
        pairs = rng.integers(0, len(tweets), size=(rows, 2))
        for first, second in pairs:
            text = f"{tweets[first]} {tweets[second]}"
            if text not in seen:
                seen.add(text)
                texts.append(text)
                if len(texts) == rows:
                    break
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, rows, shards + 1).astype(int)
    for shard, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        pq.write_table(pa.table({"id": pa.array([f"row-{i:09d}" for i in range(start, end)]),
                                 "text": pa.array(texts[start:end])}), folder / f"part-{shard:05d}.parquet")


class CpuSampler:
    """CPU seconds of this process's threads (by Python name) and of the processes below it (children and
    theirs: the feeder's pool workers and readers), read from /proc every `interval_s`: threads and processes
    that end before the run does keep the last value seen."""

    def __init__(self, interval_s: float = 0.25):
        self.interval_s, self.threads, self.children = interval_s, {}, {}
        self.baseline: tuple[dict, dict] = ({}, {})  # the counters when the measured part began
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="host-rate-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        names = {thread.native_id: thread.name for thread in threading.enumerate()}
        for task in glob.glob("/proc/self/task/*/stat"):
            tid = int(task.split("/")[-2])
            seconds = cpu_seconds(task)
            if seconds is not None and tid != self._thread.native_id:  # by id: the last sample runs after it ended
                self.threads[(tid, names.get(tid, f"thread {tid}"))] = seconds
        parents = ["self"]
        while parents:  # this process's children (of any of its threads), then theirs
            children = []
            for listing in (path for parent in parents for path in glob.glob(f"/proc/{parent}/task/*/children")):
                with contextlib.suppress(OSError):
                    children += Path(listing).read_text().split()
            for child in children:
                seconds = cpu_seconds(f"/proc/{child}/stat")
                with contextlib.suppress(OSError):
                    command = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
                    if seconds is not None:
                        self.children[(int(child), command)] = seconds
            parents = children

    def start_measuring(self) -> None:
        """From here on is measured: the CPU spent before (imports, model load, workers starting) is not."""
        self.sample()
        self.baseline = (dict(self.threads), dict(self.children))

    def figures(self, rows: int) -> dict:
        """CPU µs per row since `start_measuring`: per thread (summed by name; threads Python did not
        start, such as Arrow's, Rust's and torch's, together), the whole main process, and each child."""
        by_name: dict[str, float] = {}
        for key, seconds in self.threads.items():
            name = key[1] if not key[1].startswith("thread ") else "native threads"
            by_name[name] = by_name.get(name, 0.0) + seconds - self.baseline[0].get(key, 0.0)
        per_row = {name: round(seconds * 1e6 / rows, 2) for name, seconds in sorted(by_name.items(),
                                                                                    key=lambda item: -item[1])}
        workers = [round((seconds - self.baseline[1].get(key, 0.0)) * 1e6 / rows, 2)
                   for key, seconds in sorted(self.children.items())
                   if "multiprocessing" in key[1] and "resource_tracker" not in key[1]]
        def helper_us_per_row(module: str) -> float:
            return round(sum(seconds - self.baseline[1].get(key, 0.0) for key, seconds in self.children.items()
                             if module in key[1]) * 1e6 / rows, 2)

        return {"main_process_us_per_row": round(sum(by_name.values()) * 1e6 / rows, 2),
                "main_thread_us_per_row": per_row.get("MainThread", 0.0),
                "thread_us_per_row": per_row, "pool_worker_us_per_row": workers,
                "encoder_process_us_per_row": helper_us_per_row("pipeline.offline.encoder"),
                "reader_process_us_per_row": helper_us_per_row("pipeline.offline.reader"),
                "feeder_process_us_per_row": helper_us_per_row("pipeline.offline.feeder")}


def cpu_seconds(stat_path: str) -> float | None:
    try:
        fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def output_shapes(loaded) -> dict:
    """The job's per-row output shapes and dtypes, from one real forward of two short rows."""
    import torch

    ids = torch.tensor([[101, 2023, 102], [101, 2003, 102]])
    with torch.inference_mode():
        outputs = loaded.job.forward(loaded.model, ids, torch.ones_like(ids), False)
    return {name: (tuple(values.shape[1:]), values.dtype) for name, values in outputs.items()}


ZERO_ROWS = 4096  # the benchmark's --max-batch-rows


class ZeroForwardJob:
    """The job with its device step replaced: `forward` returns zeros of the real outputs' shapes,
    so that every other stage runs as it does and the device costs nothing."""

    def __init__(self, job, shapes: dict):
        self._job, self._shapes, self._zeros = job, shapes, {}

    def forward(self, model, input_ids, attention_mask, padded=True, packing=None):
        """Zeros of the batch's rows, sliced from one buffer: as outputs a device copied into
        host memory by DMA, they cost the host no CPU to make."""
        import torch

        rows = input_ids.shape[0]
        for name, (shape, dtype) in self._shapes.items():
            if name not in self._zeros or len(self._zeros[name]) < rows:  # made once: batches grow as rows shorten
                self._zeros[name] = torch.zeros((max(rows, ZERO_ROWS), *shape), dtype=dtype)
        return {name: self._zeros[name][:rows] for name in self._shapes}

    def __getattr__(self, name):
        return getattr(self._job, name)


def with_zero_forward(sampler: CpuSampler) -> None:
    """Make the shard runner's setup open runtimes whose job forward is `ZeroForwardJob`'s; the CPU
    `sampler` measures from the end of the run's setup (the model loaded, the pool and the
    encoder process up), where the rows/s start too."""
    import dataclasses

    import pipeline.engines.runner_setup as runner_setup
    import pipeline.offline.runner as runner

    real_open_models, real_breakdown = runner_setup.open_chosen_models, runner.SetupClock.breakdown

    def open_chosen_models(*args, **kwargs):
        opened = real_open_models(*args, **kwargs)
        runtime = opened.runtime
        runtime.loaded = dataclasses.replace(runtime.loaded,
                                             job=ZeroForwardJob(runtime.loaded.job, output_shapes(runtime.loaded)))
        return opened

    def breakdown(clock, setup_s: float) -> dict:  # the run's setup ends here (`ShardRunner.run`)
        sampler.start_measuring()
        return real_breakdown(clock, setup_s)

    runner_setup.open_chosen_models = open_chosen_models
    runner.SetupClock.breakdown = breakdown


def model_folder() -> str:
    from pipeline.runtime.choice import default_model_path

    return default_model_path()


def measure_pipeline(inputs: Path, rows: int, max_length: int, workers: int, feeder_process: bool = True) -> dict:
    """The run's figures; `feeder_process`: its batches built by a feeder process, as on a GPU host (else in its
    own process, as on a CPU)."""
    from pipeline import api
    from pipeline.offline import feeder

    with tempfile.TemporaryDirectory(prefix="host-rate-") as scratch, CpuSampler() as sampler:
        with_zero_forward(sampler)
        feeder.uses_feeder_process = lambda device_type: feeder_process
        started = time.perf_counter()
        summary = api.run(str(inputs), f"{scratch}/out", "embed", model=model_folder(), max_length=max_length,
                          dtype="float32", compile="off", unpad="off", probe=False, max_batch_tokens=65536,
                          max_batch_rows=4096, tokenize_workers=workers, plan_cache=f"{scratch}/plans",
                          progress=False, quiet=True)
        wall_s = time.perf_counter() - started
    setup_s = summary["stage_s"]["setup"]
    assert summary["rows"] == rows, summary["rows"]
    return {"rows_per_s": round(rows / (wall_s - setup_s)), "wall_s": round(wall_s, 2), "setup_s": round(setup_s, 2),
            "stage_s": summary["stage_s"], "deduplicated_rows": summary["deduplicated_rows"],
            "tokenize_workers": workers, **sampler.figures(rows)}


def measure_bare(inputs: Path, rows: int, max_length: int, width: int) -> dict:
    """pyarrow read → the tokenizer's own encode_batch on every core → a zstd write, shard by shard."""
    from tokenizers import Tokenizer

    os.environ.pop("TOKENIZERS_PARALLELISM", None)
    tokenizer = Tokenizer.from_file(str(Path(model_folder()) / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_length)
    tokens = 0
    with tempfile.TemporaryDirectory(prefix="host-rate-bare-") as scratch, CpuSampler() as sampler:
        sampler.start_measuring()
        started = time.perf_counter()
        for shard in sorted(inputs.glob("*.parquet")):
            table = pq.read_table(shard, columns=["id", "text"])
            encodings = tokenizer.encode_batch(table["text"].to_pylist())
            tokens += sum(len(encoding.ids) for encoding in encodings)
            values = np.zeros((table.num_rows, width), np.float32)
            pq.write_table(pa.table({"id": table["id"],
                                     "embedding": pa.FixedSizeListArray.from_arrays(pa.array(values.ravel()), width)}),
                           f"{scratch}/{shard.name}", compression="zstd")
        wall_s = time.perf_counter() - started
    return {"rows_per_s": round(rows / wall_s), "wall_s": round(wall_s, 2), "mean_tokens": round(tokens / rows, 1),
            "process_us_per_row": sampler.figures(rows)["main_process_us_per_row"]}


def run_child(mode: str, args) -> dict:
    """One measurement in a fresh process (so neither side inherits the other's threads or caches)."""
    command = [sys.executable, __file__, "--child", mode, "--inputs", str(args.inputs), "--rows", str(args.rows),
               "--max-length", str(args.max_length), "--tokenize-workers", str(args.tokenize_workers)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        sys.exit(f"host_rate: the {mode} measurement failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=128_000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--tokenize-workers", type=int, default=None, help="Default: every usable core.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--in-process-producer", action="store_true",
                        help="Also measure the run with its batches built in its own process (as a CPU run builds "
                             "them) and report it apart.")
    parser.add_argument("--child", choices=["pipeline", "bare", "in-process-producer"], help=argparse.SUPPRESS)
    parser.add_argument("--inputs", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    from pipeline.core.settings import usable_cores
    from writer import cpu_model

    if args.tokenize_workers is None:
        args.tokenize_workers = usable_cores()
    if args.child:
        figures = (measure_pipeline(args.inputs, args.rows, args.max_length, args.tokenize_workers,
                                    args.child == "pipeline")
                   if args.child != "bare" else measure_bare(args.inputs, args.rows, args.max_length, 384))
        print(json.dumps(figures))
        return
    with tempfile.TemporaryDirectory(prefix="host-rate-rows-") as scratch:
        args.inputs = Path(scratch) / "in"
        make_rows(args.rows, args.inputs, args.shards)
        modes = ("bare", "pipeline", *(["in-process-producer"] if args.in_process_producer else []))
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for repeat in range(args.repeats):
            for mode in modes:
                runs[mode].append(run_child(mode, args))
                print(f"repeat {repeat + 1} {mode:8s} {runs[mode][-1]['rows_per_s']:>8,} rows/s", flush=True)
    best = {mode: max(results, key=lambda r: r["rows_per_s"]) for mode, results in runs.items()}
    report = {"rows": args.rows, "shards": args.shards, "max_length": args.max_length, "cpu": cpu_model(),
              "cores": usable_cores(), "load_average": os.getloadavg(), "repeats": args.repeats,
              "rows_per_s": best["pipeline"]["rows_per_s"], "bare_rows_per_s": best["bare"]["rows_per_s"],
              "share_of_bare": round(best["pipeline"]["rows_per_s"] / best["bare"]["rows_per_s"], 3),
              "main_process_us_per_row": statistics.median(run["main_process_us_per_row"] for run in runs["pipeline"]),
              "pipeline": best["pipeline"], "bare": best["bare"], "all_runs": runs}
    if args.in_process_producer:  # a CPU run's way, beside the GPU host's
        report["in_process_producer"] = {
            "main_process_us_per_row": statistics.median(run["main_process_us_per_row"]
                                                         for run in runs["in-process-producer"]),
            "best": best["in-process-producer"]}
    print(json.dumps({key: report[key] for key in ("rows_per_s", "bare_rows_per_s", "share_of_bare",
                                                   "main_process_us_per_row")}, indent=1))
    print(json.dumps(best["pipeline"]["thread_us_per_row"], indent=1))
    if args.in_process_producer:
        print(json.dumps({"in_process_producer": report["in_process_producer"]["main_process_us_per_row"],
                          **best["in-process-producer"]["thread_us_per_row"]}, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
