"""Chaos soak: a real job killed again and again at random moments, restarted the way a scheduler
restarts it, then checked against an uninterrupted run.

Each "night" runs `lengthwise run` over many small shards into a fresh output. A seeded chaos loop
waits a random moment (from the start, model loading included, to a little past the wall time of
an uninterrupted run on the same engine), then SIGKILLs one of:

- `driver`: the lengthwise process;
- `worker`: one of its tokenizer processes (local) or one Ray actor (`--engine ray`);
- `group`: the whole process group (the driver and its tokenizer processes at once, as a pod's
  OOM kill or `kill -9 -PGID` does).

After each attempt ends it waits for the attempt's processes to go, then reruns the same command,
until one exits 0. Then it checks the night: every input row once in its shard's output, in input
order (ids), each value within the documented tolerance of the clean run (`atol 2e-5`:
docs/operations.md "What equal to a full run means"), `lengthwise verify` passes, and nothing is
left behind (no temporary file, no lock file, no process of any attempt, no Ray actor). Nights
follow one another until `--kills` kills are done.

    .venv/bin/python benchmarks/chaos.py --kills 50 --json benchmarks/results/chaos.json
    .venv/bin/python benchmarks/chaos.py --kills 20 --engine ray --json benchmarks/results/chaos_ray.json

The short version runs in the suite (tests/cli/test_chaos.py) with the test model.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

BIN = Path(sys.executable).parent
TOLERANCE = 2e-5  # tests/conftest.py::assert_equal_outputs, docs/operations.md
KINDS = ("driver", "worker", "group")
USAGE_ERROR = 2


@dataclass
class Night:
    """One output, from its first attempt to the attempt that exited 0, and what the check found."""

    kills: dict = field(default_factory=lambda: {kind: 0 for kind in KINDS})
    attempts: int = 0
    exit_codes: list = field(default_factory=list)  # of the attempts that ended on their own
    shards_done_by_attempt: list = field(default_factory=list)  # shards committed when each attempt ended
    wall_s: float = 0.0
    lost_rows: int = 0
    duplicated_rows: int = 0
    rows_out_of_order: int = 0
    rows_differing: int = 0  # from the clean run at all (a restart changes which rows share a batch)
    max_abs_difference: float = 0.0
    over_tolerance: int = 0
    verify_exit: int | None = None
    temporaries_left: list = field(default_factory=list)
    locks_left: list = field(default_factory=list)
    processes_left: list = field(default_factory=list)


def make_rows(folder: Path, rows: int, shards: int, seed: int) -> None:
    """`rows` short texts with distinct ids in `shards` Parquet shards: the packaged sample's texts,
    sampled with a seed (distinct ids; some texts repeat, as in real data)."""
    from pipeline.sample_data import SAMPLE_DIR

    texts = pa.concat_arrays([pq.read_table(p, columns=["text"])["text"].combine_chunks()
                              for p in sorted(Path(SAMPLE_DIR).glob("*.parquet"))]).to_pylist()
    picked = random.Random(seed).choices(texts, k=rows)
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, rows, shards + 1).astype(int)
    for shard, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        pq.write_table(pa.table({"id": [f"row-{i:07d}" for i in range(start, end)], "text": picked[start:end]}),
                       folder / f"part-{shard:05d}.parquet")


def run_command(inputs: Path, output: Path, model: str, engine: str, extra: list[str]) -> list[str]:
    command = [str(BIN / "lengthwise"), "run", "--input", str(inputs), "--output", str(output), "--model", model,
               "--max-length", "64", "--dtype", "float32", "--no-progress", "--no-probe", "--window-rows", "128",
               *extra]
    if engine == "ray":
        command += ["--engine", "ray", "--ray-address", "auto", "--workers", "2", "--threads-per-worker", "1"]
    return command


def read_output(folder: Path) -> dict[str, pa.Table]:
    return {p.name: pq.read_table(p) for p in sorted(folder.glob("*.parquet"))}


def ray_actors() -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if any("ray::ShardWorker" in part for part in (p.info["cmdline"] or []))]


def processes_of(group: int) -> list[int]:
    """The live (not zombie) processes of process group `group`."""
    found = []
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == group and process.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(process.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def wait_until_gone(pids_of, timeout_s: float) -> list[int]:
    """Wait for `pids_of()` to come back empty; what is still there after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (left := pids_of()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def victim(kind: str, process: subprocess.Popen, engine: str) -> int | None:
    """The pid (for `group`: the process group) to SIGKILL, or None if there is none yet."""
    if kind in ("driver", "group"):
        return process.pid
    if engine == "ray":
        actors = ray_actors()
        return random.choice(actors) if actors else None
    try:
        children = [c.pid for c in psutil.Process(process.pid).children(recursive=True)]
    except psutil.Error:
        return None
    return random.choice(children) if children else None


def soak_night(command: list[str], output: Path, expected: dict[str, pa.Table], kills_left: int,
               horizon_s: float, rng: random.Random, engine: str) -> Night:
    """Attempts of `command`, each killed at a random moment while kills are left, until one exits 0."""
    night, started = Night(), time.perf_counter()
    while True:
        night.attempts += 1
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        killed = False
        if kills_left > 0:
            kind = rng.choice(KINDS)
            try:
                process.wait(timeout=rng.uniform(0.0, horizon_s))
            except subprocess.TimeoutExpired:
                target = victim(kind, process, engine)
                if target is not None:
                    (os.killpg if kind == "group" else os.kill)(target, signal.SIGKILL)
                    night.kills[kind] += 1
                    kills_left -= 1
                    killed = True
        _, stderr = process.communicate(timeout=900)
        if not killed:
            night.exit_codes.append(process.returncode)
        markers = output / ".lengthwise" / "shards"
        night.shards_done_by_attempt.append(sum('"done"' in p.read_text() for p in markers.glob("*.json"))
                                            if markers.exists() else 0)
        night.processes_left += wait_until_gone(lambda: processes_of(process.pid), 30)
        if process.returncode == USAGE_ERROR:
            raise SystemExit(f"chaos: the job refused its command (exit 2):\n{stderr[-3000:]}")
        if process.returncode == 0 and not killed:
            break
    night.wall_s = round(time.perf_counter() - started, 2)
    if engine == "ray":
        night.processes_left += wait_until_gone(ray_actors, 60)
    check_night(night, output, expected)
    return night


def check_night(night: Night, output: Path, expected: dict[str, pa.Table]) -> None:
    """Every row once, in order, within the tolerance of the clean run; verify; nothing left behind."""
    got = read_output(output)
    for name, reference in expected.items():
        ids = reference["id"].to_pylist()
        table = got.get(name)
        ours = table["id"].to_pylist() if table is not None else []
        night.lost_rows += len(set(ids) - set(ours))
        night.duplicated_rows += len(ours) - len(set(ours))
        if ours != ids:
            night.rows_out_of_order += sum(a != b for a, b in zip(ours, ids))
            continue
        if "embedding" in reference.column_names:
            valid = np.array([v is not None for v in reference["embedding"].to_pylist()])
            a = np.array([v for v, ok in zip(reference["embedding"].to_pylist(), valid) if ok], dtype=np.float64)
            b = np.array([v for v, ok in zip(table["embedding"].to_pylist(), valid) if ok], dtype=np.float64)
            if len(a):
                difference = np.abs(a - b).max(axis=1)
                night.rows_differing += int((difference > 0).sum())
                night.over_tolerance += int((difference > TOLERANCE).sum())
                night.max_abs_difference = max(night.max_abs_difference, float(difference.max()))
    night.lost_rows += sum(reference.num_rows for name, reference in expected.items() if name not in got)
    verify = subprocess.run([str(BIN / "lengthwise"), "verify", "--output", str(output)], capture_output=True,
                            text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    night.verify_exit = verify.returncode
    night.temporaries_left = sorted(str(p.relative_to(output)) for p in output.rglob("*.tmp"))
    night.locks_left = sorted(p.name for p in (output / ".lengthwise").glob("lock*"))


def soak(kills: int, rows: int, shards: int, model: str, engine: str, seed: int, workdir: Path,
         extra: list[str]) -> dict:
    """Nights until `kills` kills are done; the totals and each night."""
    rng = random.Random(seed)
    make_rows(workdir / "in", rows, shards, seed)
    clean_started = time.perf_counter()
    clean = subprocess.run(run_command(workdir / "in", workdir / "clean", model, "local", extra), capture_output=True,
                           text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    clean_wall_s = time.perf_counter() - clean_started
    if clean.returncode != 0:
        raise SystemExit(f"chaos: the clean run failed (exit {clean.returncode}):\n{clean.stderr[-3000:]}")
    expected = read_output(workdir / "clean")
    horizon_s = clean_wall_s * 1.1
    if engine == "ray":  # kill moments span a Ray run, whose driver and actors start slower than a local run
        started = time.perf_counter()
        timed = subprocess.run(run_command(workdir / "in", workdir / "clean-ray", model, engine, extra),
                               capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if timed.returncode != 0:
            raise SystemExit(f"chaos: the clean Ray run failed (exit {timed.returncode}):\n{timed.stderr[-3000:]}")
        horizon_s = (time.perf_counter() - started) * 1.1
    nights: list[Night] = []
    while sum(sum(n.kills.values()) for n in nights) < kills:
        done = sum(sum(n.kills.values()) for n in nights)
        output = workdir / f"night-{len(nights)}"
        nights.append(soak_night(run_command(workdir / "in", output, model, engine, extra), output, expected,
                                 kills - done, horizon_s, rng, engine))
    totals = {name: sum(getattr(n, name) for n in nights)
              for name in ("attempts", "lost_rows", "duplicated_rows", "rows_out_of_order", "rows_differing",
                           "over_tolerance")}
    return {
        "engine": engine, "rows": rows, "shards": shards, "seed": seed, "model": model,
        "clean_wall_s": round(clean_wall_s, 2), "kill_horizon_s": round(horizon_s, 2), "nights": len(nights),
        "kills": {kind: sum(n.kills[kind] for n in nights) for kind in KINDS},
        "kills_total": sum(sum(n.kills.values()) for n in nights),
        "restarts": totals["attempts"] - len(nights), **totals,
        "max_abs_difference": max(n.max_abs_difference for n in nights),
        "verify_failures": sum(n.verify_exit != 0 for n in nights),
        "left_behind": {"temporaries": sum(len(n.temporaries_left) for n in nights),
                        "locks": sum(len(n.locks_left) for n in nights),
                        "processes": sum(len(n.processes_left) for n in nights)},
        "soak_wall_s": round(sum(n.wall_s for n in nights), 2),
        "per_night": [asdict(n) for n in nights],
    }


def start_ray_head() -> None:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)
    started = subprocess.run([str(BIN / "ray"), "start", "--head", "--num-cpus=2", "--num-gpus=0",
                              "--include-dashboard=false", "--disable-usage-stats"], env=env, capture_output=True,
                             text=True, timeout=180)
    if started.returncode != 0:
        raise SystemExit(f"chaos: ray start failed:\n{started.stdout}{started.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--shards", type=int, default=40)
    parser.add_argument("--model", default=None, help="a model folder (default: the packaged all-MiniLM-L6-v2)")
    parser.add_argument("--engine", choices=("local", "ray"), default="local")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args, extra = parser.parse_known_args()
    from pipeline.runtime.choice import default_model_path

    if args.engine == "ray":
        start_ray_head()
    try:
        with tempfile.TemporaryDirectory(prefix="lengthwise-chaos-") as workdir:
            report = soak(args.kills, args.rows, args.shards, args.model or default_model_path(), args.engine,
                          args.seed, Path(workdir), extra)
    finally:
        if args.engine == "ray":
            subprocess.run([str(BIN / "ray"), "stop", "--force"], capture_output=True, timeout=120)
    summary = {k: v for k, v in report.items() if k != "per_night"}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    loss = report["lost_rows"] + report["duplicated_rows"] + report["rows_out_of_order"] + report["over_tolerance"]
    sys.exit(1 if loss or report["verify_failures"] or any(report["left_behind"].values()) else 0)


if __name__ == "__main__":
    main()
