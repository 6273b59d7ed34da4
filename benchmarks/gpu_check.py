"""The GPU check: one script, one JSON, about four minutes on a GPU, built so that one lent
device run cannot be wasted (and run on a CPU in the test suite).

On the device machine (its `python3` holds torch, transformers, sentence-transformers, pyarrow,
click, fsspec, tqdm and psutil; nothing can be installed there, so `./run.sh` cannot run), from
the checkout with `gpu_assets/` carried (built here by `benchmarks/make_gpu_assets.py`):

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/gpu_check.py --require-cuda \\
        --model gpu_assets/minilm --rows gpu_assets/rows.parquet --json $OUT/gpu_check.json

Steps, in this order, each under its own deadline and all under `--budget-s` (the JSON is
rewritten after every step, with the verdict so far; a step past its deadline or failing keeps
its error and the others still run):
1. environment: versions, device (and what `--device` asked for), dtype `auto` picks, attention
   implementation, allocator, model dimensions, a measured matmul peak in the run's dtype;
2. correctness: lengthwise against `SentenceTransformer.encode` in float32 and the run's dtype
   (min cosine, finite) and the SDPA kernel of a batch with padding and of one without;
3. memory plan: a fresh probe, predicted vs measured peak per bucket, whether all fit the budget;
4. induced OOM: huge batches under a memory cap (CUDA) or a token cap (CPU): no row lost;
5. throughput: `run` eager at each token level and `auto`, cold, steady and on the device, with
   padded tokens/s, MFU and ratios to ST's warm encode (TOKENIZERS_PARALLELISM=true) in the same dtype;
   the fastest level again with the other forward (`--unpad`): padded against unpadded;
6. compile: `run --compile on` at the best level: compile seconds and speed-up over eager.
`definitions` says what each figure is; `verdict` whether the run passed. Exit 0: passed; 1: a
check failed or a step did not finish; 2: nothing could run (bad arguments, unreadable rows,
`--require-cuda` without CUDA: within seconds, the JSON naming the error).

Heavy imports (torch, the pipeline) happen in `main()`: every spawned tokenizer worker imports
this module again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_measure import encode_level, matmul_peak, min_cosine, read_embeddings, repeat_rows, sdpa_kernels, \
    sentence_transformer, write_rows  # noqa: E402 - beside this script, no torch at import
from gpu_report import DEFINITIONS, rates, ratio, step_deadline_s, utilization, verdict  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GPU_TOKEN_LEVELS = "65536,262144"
CPU_TOKEN_LEVELS = "512"
BUDGET_S = 240  # the whole check: a 15-minute lease holds it, a machine start and a rerun
STEP_S = {"environment": 30, "correctness": 40, "memory_plan": 40, "induced_oom": 30, "throughput": 80,
          "compile": 60}  # each step's own deadline; the budget's rest caps it
EXIT_FAILED, EXIT_CANNOT_RUN = 1, 2


class StepDeadline(BaseException):
    """A step ran past its deadline (raised in it by SIGALRM). Not an Exception, so that no
    `except Exception` inside the pipeline (a shard's failure, say) takes it for its own."""


@contextlib.contextmanager
def deadline(seconds: float):
    """Raise StepDeadline in the main thread once `seconds` have passed."""
    def expire(signum, frame):
        raise StepDeadline(f"past its {seconds:.0f} s deadline")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Check:
    """What every step shares: arguments, device, the loaded model, the scratch folder, the clock."""

    def __init__(self, args, device, scratch: Path, budget_s: float):
        self.args, self.device, self.scratch, self.budget_s = args, device, scratch, budget_s
        self.started = time.monotonic()
        self.step_ends = float("inf")
        self.loaded = None
        self.dims = None
        self.peak_flops = None
        self.dtype = "float32"  # what lengthwise runs in here; the environment step sets it

    def left_s(self) -> float:
        """Seconds left to the current step's deadline."""
        return self.step_ends - time.monotonic()

    def config(self, **overrides):
        from pipeline.offline.config import RunConfig

        base = dict(input=(), output="", model=self.args.model, device=str(self.device), dtype=self.dtype,
                    progress=False, compile="off")
        return RunConfig.of(**{**base, **overrides})


def environment(check: Check) -> dict:
    import platform

    import sentence_transformers
    import torch
    import transformers

    from pipeline.core.device import allocator_config, dtype_name
    from pipeline.runtime.model import load_model

    device = check.device
    settings = check.config(dtype="auto")
    check.loaded = load_model(settings.model, settings.batch)
    check.dtype = dtype_name(check.loaded.choice.dtype)
    config = check.loaded.model.config
    check.dims = {name: getattr(config, name, None) for name in ("hidden_size", "intermediate_size",
                                                                 "num_hidden_layers")}
    peak = matmul_peak(device, check.dtype)
    check.peak_flops = peak["flops"]
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "device_requested": check.args.device,
            "transformers": transformers.__version__, "sentence_transformers": sentence_transformers.__version__,
            "device": str(device), "dtype_auto": check.dtype, "dtype_reason": check.loaded.choice.dtype_reason,
            "attention_implementation": getattr(config, "_attn_implementation", None),
            "prepared_attention_mask": bool(getattr(getattr(check.loaded.model, "encoder", check.loaded.model),
                                                    "takes_prepared_mask", False)),
            "allocator": allocator_config(), "unpad": check.loaded.unpad,
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "model_dims": check.dims, "matmul_peak": peak}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(gpu=properties.name, compute_capability=f"{properties.major}.{properties.minor}",
                    gpu_memory_bytes=properties.total_memory)
    elif check.args.device == "auto":
        info["warning"] = "--device auto found no CUDA device: this is a CPU run, not a GPU check"
        print(f"  WARNING {info['warning']}", flush=True)
    print(f"  {info.get('gpu', info['cpu'])}: dtype auto {info['dtype_auto']} ({info['dtype_reason']}), attention "
          f"{info['attention_implementation']}, allocator {info['allocator'] or '-'}, matmul peak "
          f"{peak['tflops']} TFLOP/s ({peak['dtype']})", flush=True)
    return info


def correctness(check: Check, table) -> dict:
    """lengthwise against sentence-transformers' own `encode` of the same rows, in float32 and
    in the dtype lengthwise runs in, on the same device; then the SDPA kernel that ran."""
    import numpy as np
    import torch

    from pipeline.engines.local import run_job

    texts = table["text"].to_pylist()
    inputs = write_rows(table, check.scratch / "correctness-in")
    results = {"rows": table.num_rows, "dtype": check.dtype}
    reference = None
    for dtype in dict.fromkeys(("float32", check.dtype)):
        model = sentence_transformer(check.args.model, check.device, getattr(torch, dtype))
        theirs = model.encode(texts, batch_size=32, convert_to_numpy=True).astype(np.float32)
        reference = theirs if reference is None else reference
        del model
        output = check.scratch / f"correctness-{dtype}"
        run_job(check.config(input=(inputs,), output=str(output), dtype=dtype, tokenize_workers=0, probe=False))
        ours, _ = read_embeddings(output)
        results[dtype] = {"min_cosine_vs_st": min_cosine(ours, theirs),
                          "min_cosine_vs_st_float32": min_cosine(ours, reference),
                          "all_finite": bool(np.isfinite(ours).all())}
        print(f"  {dtype}: min cosine vs ST {results[dtype]['min_cosine_vs_st']:.6f} (vs ST float32 "
              f"{results[dtype]['min_cosine_vs_st_float32']:.6f}), all finite {results[dtype]['all_finite']}",
              flush=True)
    results["sdpa"] = sdpa_kernels(check.loaded.job, check.loaded.model, check.device)
    return results


def memory_plan(check: Check) -> dict:
    """The memory plan probed afresh (no cache): predicted and measured peak per bucket, the
    largest measured one, and whether every one fits the available bytes."""
    import torch

    from pipeline.core.probe import memory_plan_for

    config = check.config(max_batch_tokens=None, max_batch_rows=16384, memory_budget=check.args.memory_budget,
                          use_plan_cache=False, plan_cache=str(check.scratch / "plans"))
    loaded = check.loaded
    started = time.perf_counter()
    plan = memory_plan_for(config.batch, config.model.job, loaded.choice.max_length, loaded.job, loaded.model,
                           loaded.choice.path, check.device)
    result = {"probe_s": round(time.perf_counter() - started, 2), "plan": json.loads(plan.to_json()) if plan else None}
    buckets = result["plan"]["buckets"] if plan else []
    measured = [bucket["measured_peak_bytes"] for bucket in buckets if bucket["measured_peak_bytes"]]
    result["probe_peak_bytes"] = max(measured, default=None)
    result["plan_within_budget"] = bool(measured) and max(measured) <= plan.available_bytes
    result["buckets"] = [{"length": b["length"], "rows": b["probed_rows"], "predicted_peak_bytes":
                          b["predicted_peak_bytes"], "measured_peak_bytes": b["measured_peak_bytes"],
                          "check": b["check"]} for b in buckets]
    if check.device.type == "cuda":  # after the probe: what it left, not a peak (each measurement resets those)
        result["reserved_after_probe_bytes"] = torch.cuda.memory_reserved(check.device)
    print(f"  {len(buckets)} buckets probed in {result['probe_s']}s, largest measured peak "
          f"{result['probe_peak_bytes']} of {plan.available_bytes if plan else '-'} bytes, within budget "
          f"{result['plan_within_budget']}", flush=True)
    return result


@contextlib.contextmanager
def forward_token_cap(cap_tokens: int):
    """On a CPU, where no memory cap exists: a forward of more than `cap_tokens` padded tokens
    raises torch.OutOfMemoryError, so the split, the lowered limits and the accounting run."""
    import torch

    import pipeline.core.forward as shared_forward

    original = shared_forward.forward_splitting_on_oom

    def capped(forward, input_ids, attention_mask, device, max_rows=None):
        def forward_under_cap(ids, mask):
            if ids.numel() > cap_tokens:
                raise torch.OutOfMemoryError(f"induced: {ids.numel()} tokens over the {cap_tokens}-token cap")
            return forward(ids, mask)
        return original(forward_under_cap, input_ids, attention_mask, device, max_rows)

    shared_forward.forward_splitting_on_oom = capped
    try:
        yield
    finally:
        shared_forward.forward_splitting_on_oom = original


def induced_oom(check: Check, inputs: str, rows: int) -> dict:
    """Huge batches under a cap: they must split, and every row must come out."""
    import gc

    import torch

    from pipeline.engines.local import run_job

    config = check.config(input=(inputs,), output=str(check.scratch / "oom"), probe=False, max_batch_tokens=1 << 20,
                          max_batch_rows=16384)
    if check.device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()  # what earlier steps left cached would count against the cap
        total = torch.cuda.get_device_properties(check.device).total_memory
        torch.cuda.set_per_process_memory_fraction(check.args.oom_cap / total, check.device)
        cap, release = {"cap_bytes": check.args.oom_cap}, contextlib.nullcontext()
    else:
        cap, release = {"cap_tokens": check.args.oom_cap_tokens}, forward_token_cap(check.args.oom_cap_tokens)
    try:
        with release:
            summary = run_job(config)
    finally:
        if check.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, check.device)
            torch.cuda.empty_cache()
    _, errors = read_embeddings(check.scratch / "oom")
    result = {**cap, "rows_in": rows, "rows_written": summary.rows, "oom_splits": summary.oom_splits,
              "lowered_batch_rows": summary.lowered_batch_rows,
              "error_rows": sum(error is not None for error in errors), "lost_rows": rows - summary.rows}
    print(f"  {result['oom_splits']} splits, {result['rows_written']} of {rows} rows written, "
          f"{result['error_rows']} error rows", flush=True)
    return result


def run_level(check: Check, inputs: str, rows: int, name: str, **settings) -> dict:
    """One `run` of the throughput rows: its rates, padding, MFU and the batches' memory peak."""
    import torch

    from pipeline.engines.local import run_job

    if check.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(check.device)
    started = time.perf_counter()
    summary = run_job(check.config(input=(inputs,), output=str(check.scratch / f"throughput-{name}"),
                                   memory_budget=check.args.memory_budget, **settings))
    wall_s = time.perf_counter() - started
    setup_s, device_s = summary.stage_s.get("setup", 0.0), summary.stage_s.get("forward", 0.0)
    level = {"max_batch_tokens": settings.get("max_batch_tokens") or "auto", "compile": summary.compile,
             "compile_s": summary.compile_s, "batch_setting": summary.batch_setting, "wall_s": round(wall_s, 2),
             "setup_s": setup_s, "device_s": round(device_s, 3),
             **rates(rows, summary.real_tokens, summary.padded_tokens, wall_s, setup_s, device_s),
             "mfu": utilization(summary.padded_tokens, rows, summary.padded_tokens, device_s, check.peak_flops,
                                check.dims),
             "useful_mfu": utilization(summary.real_tokens, rows, summary.padded_tokens, device_s, check.peak_flops,
                                       check.dims),
             "padding_efficiency": round(summary.padding_efficiency, 4), "batches": summary.batches,
             "unpad": summary.unpad,
             "dtype": summary.dtype, "stage_s": summary.stage_s, "oom_splits": summary.oom_splits,
             "rows_written": summary.rows,
             # the writer thread's rate on this host: above device_rows_per_s, one writer keeps up with the GPU
             "writer_rows_per_s": round(rows / summary.stage_s["write"]) if summary.stage_s.get("write") else None}
    if check.device.type == "cuda":
        level["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(check.device)
    print(f"  lengthwise {name}: {level['cold_rows_per_s']:,} rows/s cold, {level['steady_rows_per_s']:,} steady, "
          f"{level['device_rows_per_s']:,} on the device (MFU {level['mfu']}, padding efficiency "
          f"{level['padding_efficiency']})", flush=True)
    return level


def throughput(check: Check, inputs: str, texts: list, levels: list) -> dict:
    """ST's warm encode first (the peer), then `run` eager per token level and `auto`, each
    started only if the last one's wall still fits the deadline; ratios to ST's best."""
    import torch

    os.environ["TOKENIZERS_PARALLELISM"] = "true"  # ST tokenizes in this process: let it use the cores
    rows = len(texts)
    results = {"rows": rows, "dtype": check.dtype, "tokenizers_parallelism": os.environ["TOKENIZERS_PARALLELISM"],
               "lengthwise": [], "sentence_transformers": [], "skipped_for_time": []}
    model = sentence_transformer(check.args.model, check.device, getattr(torch, check.dtype))
    lengths = [len(ids) for ids in model.tokenizer(texts, truncation=True, max_length=model.max_seq_length)[
        "input_ids"]]
    results["sentence_transformers"].append(encode_level(model, texts, lengths, 256, check.device, dtype=check.dtype))
    last_s = 0.0
    for tokens in levels + [None]:
        if check.left_s() < 1.2 * last_s:
            results["skipped_for_time"].append(tokens or "auto")
            continue
        started = time.perf_counter()
        results["lengthwise"].append(run_level(check, inputs, rows, f"{tokens or 'auto'}", max_batch_tokens=tokens,
                                               max_batch_rows=None if tokens is None else 16384))
        last_s = time.perf_counter() - started
    results["unpad_comparison"] = other_forward(check, inputs, rows, results["lengthwise"], last_s)
    if check.left_s() > 3 * results["sentence_transformers"][0]["encode_s"]:
        results["sentence_transformers"].append(encode_level(model, texts, lengths, 32, check.device,
                                                             dtype=check.dtype))
    del model
    try:
        flash = sentence_transformer(check.args.model, check.device, getattr(torch, check.dtype), "flash_attention_2")
        results["sentence_transformers_flash_attention_2"] = encode_level(flash, texts, lengths, 256, check.device,
                                                                          attention="flash_attention_2")
    except Exception as error:  # noqa: BLE001 - not installed, or not on this device: recorded, not a failure
        results["sentence_transformers_flash_attention_2"] = {"unavailable": f"{type(error).__name__}: {error}"}
        print(f"  sentence-transformers with flash-attention 2: unavailable ({type(error).__name__})", flush=True)
    best = max(results["sentence_transformers"], key=lambda level: level["rows_per_s"])
    for level in results["lengthwise"]:
        level["ratio_to_st"] = {"st_batch_size": best["batch_size"],
                                "cold_rows": ratio(level["cold_rows_per_s"], best["rows_per_s"]),
                                "steady_rows": ratio(level["steady_rows_per_s"], best["rows_per_s"]),
                                "device_rows": ratio(level["device_rows_per_s"], best["rows_per_s"]),
                                "device_padded_tokens": ratio(level["device_padded_tokens_per_s"],
                                                              best["padded_tokens_per_s"])}
    return results


def other_forward(check: Check, inputs: str, rows: int, levels: list, last_s: float) -> dict:
    """The level fastest on the device again with the other forward (`--unpad off` where the
    levels ran unpadded, else `on`), if its wall still fits: the unpadded forward's speed-up."""
    ran = [level for level in levels if level.get("device_rows_per_s")]
    if not ran or check.left_s() < 1.2 * last_s:
        return {"skipped": "no time left in the step's deadline" if ran else "no throughput level ran"}
    level = max(ran, key=lambda level: level["device_rows_per_s"])
    tokens = level["max_batch_tokens"] if level["max_batch_tokens"] != "auto" else None
    flip = "off" if level["unpad"].startswith("unpadded") else "on"
    other = run_level(check, inputs, rows, f"{tokens or 'auto'}-unpad-{flip}", unpad=flip, max_batch_tokens=tokens,
                      max_batch_rows=None if tokens is None else 16384)
    padded, unpadded = (other, level) if flip == "off" else (level, other)
    result = {"max_batch_tokens": level["max_batch_tokens"], "padded": padded, "unpadded": unpadded,
              "unpadded_ran": unpadded["unpad"].startswith("unpadded"),
              "device_speedup_unpadded": ratio(unpadded["device_rows_per_s"], padded["device_rows_per_s"]),
              "steady_speedup_unpadded": ratio(unpadded["steady_rows_per_s"], padded["steady_rows_per_s"])}
    print(f"  {unpadded['unpad']}: {result['device_speedup_unpadded']}x padded on the device", flush=True)
    return result


def compiled(check: Check, inputs: str, rows: int, eager_levels: list) -> dict:
    """`run --compile on` at the eager level that ran fastest on the device: compile seconds,
    rates, and the speed-up over that eager level."""
    ran = [level for level in eager_levels if level.get("device_rows_per_s")]
    if not ran:
        return {"skipped": "no eager throughput level ran"}
    eager = max(ran, key=lambda level: level["device_rows_per_s"])
    tokens = eager["max_batch_tokens"] if eager["max_batch_tokens"] != "auto" else None
    level = run_level(check, inputs, rows, f"compiled-{tokens or 'auto'}", compile="on", max_batch_tokens=tokens,
                      max_batch_rows=None if tokens is None else 16384)
    level["device_speedup_over_eager"] = ratio(level["device_rows_per_s"], eager["device_rows_per_s"])
    level["steady_speedup_over_eager"] = ratio(level["steady_rows_per_s"], eager["steady_rows_per_s"])
    print(f"  compiled in {level['compile_s']} s: {level['device_speedup_over_eager']}x eager on the device",
          flush=True)
    return level


def parse_args(argv=None):
    from pipeline.core.units import parse_bytes

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder (benchmarks/make_gpu_assets.py builds one)")
    parser.add_argument("--rows", required=True, help="Parquet file with id and text")
    parser.add_argument("--json", required=True, type=Path, help="where the report goes")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--require-cuda", action="store_true", help="exit 2 at once (with the JSON) without CUDA")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for the whole check")
    parser.add_argument("--deadline-scale", type=float, default=1.0,
                        help="each step's deadline times this (a slow or shared CPU's dry run: 4)")
    parser.add_argument("--limit-rows", type=int, default=None, help="use only this many rows for throughput")
    parser.add_argument("--repeat", type=int, default=None,
                        help="the rows this many times over for throughput (default: 2 on a GPU, 1 on a CPU)")
    parser.add_argument("--correctness-rows", type=int, default=256)
    parser.add_argument("--token-levels", default=None,
                        help=f"default: {GPU_TOKEN_LEVELS} on a GPU, {CPU_TOKEN_LEVELS} on a CPU")
    parser.add_argument("--oom-cap", type=parse_bytes, default="2GiB", help="the memory cap of the induced OOM (CUDA)")
    parser.add_argument("--oom-cap-tokens", type=int, default=256, help="the token cap of the induced OOM (CPU)")
    parser.add_argument("--memory-budget", type=parse_bytes, default=None,
                        help="memory budget of the plan (default: the device's; on CPU give a small one, e.g. 64MiB)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "command": " ".join(sys.argv), "definitions": DEFINITIONS}

    def save() -> None:
        report["verdict"] = verdict(report)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")

    def cannot_run(message: str) -> int:
        report["error"] = message
        save()
        print(f"gpu_check: {message}", file=sys.stderr, flush=True)
        return EXIT_CANNOT_RUN

    import pipeline  # noqa: F401 - sets the allocator variable before torch starts CUDA
    import torch

    from pipeline.core.device import resolve_device
    from pipeline.core.errors import UsageError

    if args.require_cuda and not torch.cuda.is_available():
        return cannot_run(f"--require-cuda: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU; "
                          f"run on the device machine's python3, or drop --require-cuda for a CPU dry run")
    try:
        device = resolve_device(args.device)
    except UsageError as error:
        return cannot_run(str(error))
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(args.rows, columns=["id", "text"])
    except Exception as error:  # noqa: BLE001 - named in the JSON
        return cannot_run(f"--rows {args.rows}: {type(error).__name__}: {error}")
    on_gpu = device.type == "cuda"
    levels = [int(t) for t in (args.token_levels or (GPU_TOKEN_LEVELS if on_gpu else CPU_TOKEN_LEVELS)).split(",")]
    if args.limit_rows:
        table = table.slice(0, args.limit_rows)
    half = args.correctness_rows // 2
    sample = pa.concat_tables([table.slice(0, half), table.slice(max(half, table.num_rows - half))])
    repeated = repeat_rows(table, args.repeat or (2 if on_gpu else 1))
    save()

    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        os.environ["XDG_CACHE_HOME"] = str(scratch / "cache")  # a fresh plan cache: nothing from an earlier run
        check = Check(args, device, scratch, args.budget_s)
        inputs = lambda: write_rows(repeated, scratch / "in")  # noqa: E731
        steps = [("environment", lambda: environment(check)),
                 ("correctness", lambda: correctness(check, sample)),
                 ("memory_plan", lambda: memory_plan(check)),
                 ("induced_oom", lambda: induced_oom(check, write_rows(table, scratch / "oom-in"), table.num_rows)),
                 ("throughput", lambda: throughput(check, inputs(), repeated["text"].to_pylist(), levels)),
                 ("compile", lambda: compiled(check, inputs(), repeated.num_rows,
                                              report.get("throughput", {}).get("lengthwise", [])))]
        for name, step in steps:
            seconds = step_deadline_s(STEP_S[name] * args.deadline_scale, args.budget_s,
                                      time.monotonic() - check.started)
            print(f"{name} (deadline {seconds:.0f} s):", flush=True)
            started = time.perf_counter()
            if seconds < 1 or (name != "environment" and check.loaded is None):
                why = "no time left in --budget-s" if seconds < 1 else "the environment step did not load the model"
                report[name] = {"error": f"not run: {why}"}
            else:
                check.step_ends = time.monotonic() + seconds
                try:
                    with deadline(seconds):
                        report[name] = step()
                except (Exception, StepDeadline) as error:  # noqa: BLE001 - recorded, the other steps still run
                    report[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
                    print(f"  ERROR {report[name]['error']}", flush=True)
            report.setdefault("step_s", {})[name] = round(time.perf_counter() - started, 2)
            save()
            print(f"  ({report['step_s'][name]}s)", flush=True)
    passed = report["verdict"]["passed"]
    print(f"verdict: {'passed' if passed else 'FAILED'} {json.dumps(report['verdict']['checks'])}", flush=True)
    return 0 if passed else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
