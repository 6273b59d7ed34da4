"""The GPU check: one script, one JSON, about four minutes on a GPU, built so that one lent
device run cannot be wasted (and run on a CPU in the test suite).

On the device machine (its `python3` holds torch, transformers, sentence-transformers, pyarrow,
click, fsspec, tqdm and psutil; nothing can be installed there, so `./run.sh` cannot run), from
the checkout with `gpu_assets/` carried (built here by `benchmarks/make_gpu_assets.py`):

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/gpu_check.py --require-cuda \\
        --model gpu_assets/minilm --rows gpu_assets/rows.parquet --json $OUT/gpu_check.json

Imports and the device's start (CUDA context, cuBLAS) come first, before the clock of
`--budget-s` starts. Then the steps, in this order, each under its own deadline and all under
the budget; the JSON is written (atomically) as each level of a step ends, with the verdict so
far, so a deadline or a kill keeps what finished:
1. environment: versions, device (and what `--device` asked for), g++, usable cores, dtype `auto`
   picks, attention implementation, allocator, the weights' stored dtype, model dimensions, a
   measured matmul peak in the run's dtype;
2. correctness: lengthwise against `SentenceTransformer.encode` in float32 and the run's dtype
   (min cosine, finite) and the SDPA kernel of a batch with padding and of one without;
3. throughput, on distinct texts with `--no-dedupe` (0 deduplicated rows) in at least 5 windows:
   ST's warm encode (TOKENIZERS_PARALLELISM=true), then `run` eager at `auto` and again with the
   other forward (`--unpad`), then at each token level; cold, past setup, steady (first batch to
   last) and device rates, MFU on the tokens computed and on real tokens, ratios to ST;
4. memory plan: a fresh probe under `--plan-memory-budget` (4 GiB), predicted vs measured peak
   per bucket, whether all fit the budget;
5. induced OOM: huge batches under a memory cap (CUDA) or a token cap (CPU): no row lost;
6. compile: `run --compile on` at the best eager level: compile seconds and speed-up.
`definitions` says what each figure is; `verdict` whether the run passed: every check ok and no
step raised. Steps and levels skipped or cut for time are listed apart (`skipped_for_time`), and
compile's outcome stands beside `passed`, not in it. Exit 0: passed; 1: a check failed or a step
raised; 2: nothing could run (bad arguments, unreadable rows, `--require-cuda` without CUDA:
within seconds, the JSON naming the error).

Heavy imports (torch, the pipeline) happen in `main()`: every spawned tokenizer worker imports
this module again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_measure import batch_clock, compiler_version, distinct_rows, encode_level, forward_token_cap, \
    import_before_clock, matmul_peak, min_cosine, read_embeddings, sdpa_kernels, sentence_transformer, \
    stored_weight_dtypes, warm_up, write_rows  # noqa: E402 - beside this script, no torch at import
from gpu_report import DEFINITIONS, NOT_RUN_FOR_TIME, level_mfu, rates, ratio, steady_span, step_deadline_s, \
    throughput_window_rows, verdict, with_ratios_to_st  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GPU_TOKEN_LEVELS = "65536,262144"
CPU_TOKEN_LEVELS = "512"
BUDGET_S = 240  # the whole check, after imports and the device's start: a 15-minute lease holds it, a start, a rerun
STEP_S = {"environment": 30, "correctness": 40, "throughput": 80, "memory_plan": 40, "induced_oom": 30,
          "compile": 60}  # each step's own deadline, in the order they run; the budget's rest caps it
MIN_WINDOWS = 5  # windows per throughput level: fewer, and a "steady" rate is mostly one window's fill and drain
EXIT_FAILED, EXIT_CANNOT_RUN = 1, 2


class StepDeadline(BaseException):
    """A step ran past its deadline (raised in it by SIGALRM). Not an Exception, so that no
    `except Exception` inside the pipeline (a shard's failure, say) takes it for its own."""


@contextlib.contextmanager
def deadline(seconds: float):
    """Raise StepDeadline in the main thread once `seconds` have passed."""
    def expire(signum, frame):
        raise StepDeadline(f"past its {round(seconds, 1):g} s deadline")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def save_report(report: dict, path: Path) -> None:
    """The report with its verdict so far, written beside `path` and renamed over it: a kill
    mid-write leaves the previous report whole."""
    report["verdict"] = verdict(report)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(partial, path)


class Check:
    """What every step shares: arguments, device, the loaded model, the scratch folder, the clock
    (started when this is made, after imports and the device's start) and the report."""

    def __init__(self, args, device, scratch: Path, budget_s: float, report: dict):
        self.args, self.device, self.scratch, self.budget_s, self.report = args, device, scratch, budget_s, report
        self.started = time.monotonic()
        self.step_ends = float("inf")
        self.loaded = None
        self.dims = None
        self.peak_flops = None
        self.dtype = "float32"  # what lengthwise runs in here; the environment step sets it

    def left_s(self) -> float:
        """Seconds left to the current step's deadline."""
        return self.step_ends - time.monotonic()

    def save(self) -> None:
        save_report(self.report, self.args.json)

    def config(self, **overrides):
        from pipeline.offline.config import RunConfig

        base = dict(input=(), output="", model=self.args.model, device=str(self.device), dtype=self.dtype,
                    progress=False, compile="off")
        return RunConfig.of(**{**base, **overrides})


def run_step(check: Check, name: str, step, seconds: float) -> None:
    """`step(block)` under a deadline of `seconds`. The block is in the report from the start and
    the step saves it as each level ends, so a deadline keeps what finished (`timed_out`, not a
    failure) and an error keeps it beside the error."""
    block = check.report[name] = {}
    check.step_ends = time.monotonic() + seconds
    try:
        with deadline(seconds):
            step(block)
    except StepDeadline as error:
        block["timed_out"] = str(error)
        print(f"  TIMED OUT {error}; what finished is kept", flush=True)
    except Exception as error:  # noqa: BLE001 - recorded, the other steps still run
        block.update(error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
        print(f"  ERROR {block['error']}", flush=True)
    check.save()


def environment(check: Check, block: dict) -> None:
    import platform

    import sentence_transformers
    import torch
    import transformers

    from pipeline.core.device import allocator_config, dtype_name
    from pipeline.core.settings import usable_cores
    from pipeline.runtime.model import load_model

    device = check.device
    block.update(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                 cuda_available=torch.cuda.is_available(), device_requested=check.args.device,
                 transformers=transformers.__version__, sentence_transformers=sentence_transformers.__version__,
                 device=str(device), cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                 usable_cores=usable_cores(), gxx=compiler_version("g++"),
                 weights_stored_dtype=stored_weight_dtypes(check.args.model))
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        block.update(gpu=properties.name, compute_capability=f"{properties.major}.{properties.minor}",
                     gpu_memory_bytes=properties.total_memory)
    elif check.args.device == "auto":
        block["warning"] = "--device auto found no CUDA device: this is a CPU run, not a GPU check"
        print(f"  WARNING {block['warning']}", flush=True)
    settings = check.config(dtype="auto")
    check.loaded = load_model(settings.model, settings.batch, cache=settings.cache)
    check.dtype = dtype_name(check.loaded.choice.dtype)
    config = check.loaded.model.config
    check.dims = {name: getattr(config, name, None) for name in ("hidden_size", "intermediate_size",
                                                                 "num_hidden_layers")}
    block.update(dtype_auto=check.dtype, dtype_reason=check.loaded.choice.dtype_reason,
                 attention_implementation=getattr(config, "_attn_implementation", None),
                 prepared_attention_mask=bool(getattr(getattr(check.loaded.model, "encoder", check.loaded.model),
                                                      "takes_prepared_mask", False)),
                 allocator=allocator_config(), unpad=check.loaded.unpad, model_dims=check.dims)
    check.save()  # the model is loaded: the later steps run even if the matmul peak overruns
    peak = matmul_peak(device, check.dtype)
    check.peak_flops = peak["flops"]
    block["matmul_peak"] = peak
    print(f"  {block.get('gpu', block['cpu'])}: dtype auto {check.dtype} ({block['dtype_reason']}), attention "
          f"{block['attention_implementation']}, allocator {block['allocator'] or '-'}, weights stored "
          f"{block['weights_stored_dtype']}, g++ {block['gxx'] or 'absent'}, {block['usable_cores']} usable cores, "
          f"matmul peak {peak['tflops']} TFLOP/s ({peak['dtype']})", flush=True)


def correctness(check: Check, block: dict, table) -> None:
    """lengthwise against sentence-transformers' own `encode` of the same rows, in float32 and
    in the dtype lengthwise runs in, on the same device; then the SDPA kernel that ran."""
    import numpy as np
    import torch

    from pipeline.engines.local import run_job

    texts = table["text"].to_pylist()
    inputs = write_rows(table, check.scratch / "correctness-in")
    block.update(rows=table.num_rows, dtype=check.dtype)
    reference = None
    for dtype in dict.fromkeys(("float32", check.dtype)):
        model = sentence_transformer(check.args.model, check.device, getattr(torch, dtype))
        theirs = model.encode(texts, batch_size=32, convert_to_numpy=True).astype(np.float32)
        reference = theirs if reference is None else reference
        del model
        output = check.scratch / f"correctness-{dtype}"
        run_job(check.config(input=(inputs,), output=str(output), dtype=dtype, tokenize_workers=0, probe=False))
        ours, _ = read_embeddings(output)
        block[dtype] = {"min_cosine_vs_st": min_cosine(ours, theirs),
                        "min_cosine_vs_st_float32": min_cosine(ours, reference),
                        "all_finite": bool(np.isfinite(ours).all())}
        check.save()
        print(f"  {dtype}: min cosine vs ST {block[dtype]['min_cosine_vs_st']:.6f} (vs ST float32 "
              f"{block[dtype]['min_cosine_vs_st_float32']:.6f}), all finite {block[dtype]['all_finite']}",
              flush=True)
    block["sdpa"] = sdpa_kernels(check.loaded.job, check.loaded.model, check.device)


def run_level(check: Check, inputs: str, rows: int, name: str, window_rows: int, **settings) -> dict:
    """One `run` of the throughput rows, every row computed (`--no-dedupe`) in windows of
    `window_rows`: its rates, padding, MFU, and the batches' memory peak."""
    import torch

    from pipeline.engines.local import run_job

    if check.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(check.device)
    with batch_clock() as batch_ends:
        started = time.perf_counter()
        summary = run_job(check.config(input=(inputs,), output=str(check.scratch / f"throughput-{name}"),
                                       memory_budget=check.args.memory_budget, dedupe=False, window_rows=window_rows,
                                       **settings))
        wall_s = time.perf_counter() - started
    if len(batch_ends) != summary.batches:  # the steady rate would be wrong, or silently missing
        raise RuntimeError(f"the batch clock saw {len(batch_ends)} of {summary.batches} batches: does "
                           "pipeline.offline.runner still call run_on_device by that name? Fix gpu_measure.batch_clock")
    span_rows, span_s = steady_span(batch_ends)
    setup_s, device_s = summary.stage_s.get("setup", 0.0), summary.stage_s.get("forward", 0.0)
    level = {"name": name, "max_batch_tokens": settings.get("max_batch_tokens") or "auto",
             "compile": summary.compile, "compile_s": summary.compile_s, "batch_setting": summary.batch_setting,
             "window_rows": window_rows, "windows": math.ceil(rows / window_rows), "batches": summary.batches,
             "tokenize_workers": summary.settings.get("tokenize_workers"), "wall_s": round(wall_s, 2),
             "setup_s": setup_s, "setup_steps": summary.setup_steps, "device_s": round(device_s, 3),
             "steady_span_s": round(span_s, 3),
             **rates(rows, summary.real_tokens, summary.padded_tokens, wall_s, setup_s, device_s, span_rows, span_s),
             **level_mfu(rows, summary.real_tokens, summary.padded_tokens, device_s, check.peak_flops, check.dims,
                         summary.unpad.startswith("unpadded")),
             "padding_efficiency": round(summary.padding_efficiency, 4), "unpad": summary.unpad,
             "dtype": summary.dtype, "stage_s": summary.stage_s, "oom_splits": summary.oom_splits,
             "rows_written": summary.rows, "deduplicated_rows": summary.deduplicated_rows,
             # the writer thread's rate on this host: above device_rows_per_s, one writer keeps up with the GPU
             "writer_rows_per_s": round(rows / summary.stage_s["write"]) if summary.stage_s.get("write") else None}
    if check.device.type == "cuda":
        level["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(check.device)
    print(f"  lengthwise {name}: {level['cold_rows_per_s']:,} rows/s cold, {level['steady_rows_per_s']:,} steady "
          f"over {level['windows']} windows, {level['device_rows_per_s']:,} on the device (MFU {level['mfu']} on "
          f"{level['mfu_tokens']} tokens, padding efficiency {level['padding_efficiency']})", flush=True)
    return level


def throughput(check: Check, block: dict, inputs: str, texts: list, levels: list, window_rows: int) -> None:
    """ST's warm encode first (the peer), then `run` eager at `auto`, `auto` with the other
    forward, and each token level, each started only if the last one's wall still fits the
    deadline and saved as it ends; then ST at batch 32 and with flash-attention 2 if they fit."""
    import torch

    os.environ["TOKENIZERS_PARALLELISM"] = "true"  # ST tokenizes in this process: let it use the cores
    rows = len(texts)
    block.update(rows=rows, dtype=check.dtype, tokenizers_parallelism=os.environ["TOKENIZERS_PARALLELISM"],
                 window_rows=window_rows, sentence_transformers=[], lengthwise=[], skipped_for_time=[])
    started = time.perf_counter()
    model = sentence_transformer(check.args.model, check.device, getattr(torch, check.dtype))
    st_load_s = time.perf_counter() - started
    lengths = [len(ids) for ids in model.tokenizer(texts, truncation=True, max_length=model.max_seq_length)[
        "input_ids"]]
    block["sentence_transformers"].append(encode_level(model, texts, lengths, 256, check.device, dtype=check.dtype))
    check.save()
    last_s = 0.0

    def measured(name: str, **settings) -> dict | None:
        nonlocal last_s
        if check.left_s() < 1.2 * last_s:
            block["skipped_for_time"].append(name)
            check.save()
            return None
        started = time.perf_counter()
        block["running"] = name  # what a deadline cut, if one does
        level = run_level(check, inputs, rows, name, window_rows, **settings)
        last_s = time.perf_counter() - started
        del block["running"]
        block["lengthwise"].append(level)
        with_ratios_to_st(block)
        check.save()
        return level

    auto = measured("auto")
    flip = "off" if auto and auto["unpad"].startswith("unpadded") else "on"
    other = measured(f"auto-unpad-{flip}", unpad=flip) if auto else None
    if other:
        padded, unpadded = (other, auto) if flip == "off" else (auto, other)
        block["unpad_comparison"] = {"padded": padded["name"], "unpadded": unpadded["name"],
                                     "unpadded_ran": unpadded["unpad"].startswith("unpadded"),
                                     "device_speedup_unpadded": ratio(unpadded["device_rows_per_s"],
                                                                      padded["device_rows_per_s"]),
                                     "steady_speedup_unpadded": ratio(unpadded["steady_rows_per_s"],
                                                                      padded["steady_rows_per_s"])}
        print(f"  {unpadded['unpad']}: {block['unpad_comparison']['device_speedup_unpadded']}x padded on the "
              f"device", flush=True)
    for tokens in levels:
        measured(str(tokens), max_batch_tokens=tokens, max_batch_rows=16384)
    encode_s = block["sentence_transformers"][0]["encode_s"]
    if check.left_s() > 3 * encode_s:
        block["sentence_transformers"].append(encode_level(model, texts, lengths, 32, check.device,
                                                           dtype=check.dtype))
        with_ratios_to_st(block)
        check.save()
    else:
        block["skipped_for_time"].append("sentence_transformers batch 32")
    del model
    if check.left_s() < 1.5 * (st_load_s + encode_s):  # its load and encode, with room: it must not overrun
        block["skipped_for_time"].append("sentence_transformers flash_attention_2")
        return
    try:
        flash = sentence_transformer(check.args.model, check.device, getattr(torch, check.dtype), "flash_attention_2")
        block["sentence_transformers_flash_attention_2"] = encode_level(flash, texts, lengths, 256, check.device,
                                                                        attention="flash_attention_2")
    except Exception as error:  # noqa: BLE001 - not installed, or not on this device: recorded, not a failure
        block["sentence_transformers_flash_attention_2"] = {"unavailable": f"{type(error).__name__}: {error}"}
        print(f"  sentence-transformers with flash-attention 2: unavailable ({type(error).__name__})", flush=True)


def memory_plan(check: Check, block: dict) -> None:
    """The memory plan probed afresh (no cache) under `--plan-memory-budget`, a budget the
    probe must bind: predicted and measured peak per bucket, the largest measured one, and
    whether every one fits the available bytes."""
    import torch

    from pipeline.core.probe import memory_plan_for

    config = check.config(max_batch_tokens=None, max_batch_rows=16384, memory_budget=check.args.plan_memory_budget,
                          use_plan_cache=False, plan_cache=str(check.scratch / "plans"))
    loaded = check.loaded
    started = time.perf_counter()
    plan = memory_plan_for(config.batch, config.cache, config.model.job, loaded.choice.max_length, loaded.job, loaded.model,
                           loaded.choice.path, check.device)
    block.update(budget_bytes=check.args.plan_memory_budget, probe_s=round(time.perf_counter() - started, 2),
                 plan=json.loads(plan.to_json()) if plan else None)
    buckets = block["plan"]["buckets"] if plan else []
    measured = [bucket["measured_peak_bytes"] for bucket in buckets if bucket["measured_peak_bytes"]]
    block["probe_peak_bytes"] = max(measured, default=None)
    block["plan_within_budget"] = bool(measured) and max(measured) <= plan.available_bytes
    block["buckets"] = [{"length": b["length"], "rows": b["probed_rows"], "predicted_peak_bytes":
                         b["predicted_peak_bytes"], "measured_peak_bytes": b["measured_peak_bytes"],
                         "check": b["check"]} for b in buckets]
    if check.device.type == "cuda":  # after the probe: what it left, not a peak (each measurement resets those)
        block["reserved_after_probe_bytes"] = torch.cuda.memory_reserved(check.device)
    print(f"  {len(buckets)} buckets probed in {block['probe_s']}s, largest measured peak "
          f"{block['probe_peak_bytes']} of {plan.available_bytes if plan else '-'} bytes, within budget "
          f"{block['plan_within_budget']}", flush=True)


def induced_oom(check: Check, block: dict, inputs: str, rows: int) -> None:
    """Huge batches under a cap: they must split, and every row must come out."""
    import gc

    import torch

    from pipeline.engines.local import run_job

    config = check.config(input=(inputs,), output=str(check.scratch / "oom"), probe=False, max_batch_tokens=1 << 20,
                          max_batch_rows=16384)
    if check.device.type == "cuda":
        gc.collect()  # once: what earlier steps left would count against the cap
        torch.cuda.empty_cache()
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
    block.update(**cap, rows_in=rows, rows_written=summary.rows, oom_splits=summary.oom_splits,
                 lowered_batch_rows=summary.lowered_batch_rows,
                 error_rows=sum(error is not None for error in errors), lost_rows=rows - summary.rows)
    print(f"  {block['oom_splits']} splits, {block['rows_written']} of {rows} rows written, "
          f"{block['error_rows']} error rows", flush=True)


def compiled(check: Check, block: dict, inputs: str, rows: int, window_rows: int, eager_levels: list) -> None:
    """`run --compile on` at the eager level that ran fastest on the device: compile seconds,
    rates, and the speed-up over that eager level."""
    ran = [level for level in eager_levels if level.get("device_rows_per_s")]
    if not ran:
        block["skipped"] = "no eager throughput level ran"
        return
    eager = max(ran, key=lambda level: level["device_rows_per_s"])
    block["eager_level"] = eager["name"]
    tokens = eager["max_batch_tokens"] if eager["max_batch_tokens"] != "auto" else None
    check.save()  # which level it compiles at, should the compile outlast the deadline
    block.update(run_level(check, inputs, rows, f"compiled-{eager['name']}", window_rows, compile="on",
                           max_batch_tokens=tokens, max_batch_rows=None if tokens is None else 16384))
    block["device_speedup_over_eager"] = ratio(block["device_rows_per_s"], eager["device_rows_per_s"])
    block["steady_speedup_over_eager"] = ratio(block["steady_rows_per_s"], eager["steady_rows_per_s"])
    print(f"  compiled in {block['compile_s']} s: {block['device_speedup_over_eager']}x eager on the device",
          flush=True)


def parse_args(argv=None):
    from pipeline.core.units import parse_bytes

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder (benchmarks/make_gpu_assets.py builds one)")
    parser.add_argument("--rows", required=True, help="Parquet file with id and text")
    parser.add_argument("--json", required=True, type=Path, help="where the report goes")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--require-cuda", action="store_true", help="exit 2 at once (with the JSON) without CUDA")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help="seconds for the steps, counted once imports are done and the device has started")
    parser.add_argument("--deadline-scale", type=float, default=1.0,
                        help="each step's deadline times this (a slow or shared CPU's dry run: 4)")
    parser.add_argument("--limit-rows", type=int, default=None, help="use only this many rows")
    parser.add_argument("--repeat", type=int, default=None,
                        help="the rows this many times over for throughput, words rotated in each copy so every "
                             "text is distinct (default: 2 on a GPU, 1 on a CPU)")
    parser.add_argument("--correctness-rows", type=int, default=256)
    parser.add_argument("--token-levels", default=None,
                        help=f"default: {GPU_TOKEN_LEVELS} on a GPU, {CPU_TOKEN_LEVELS} on a CPU")
    parser.add_argument("--oom-cap", type=parse_bytes, default="2GiB", help="the memory cap of the induced OOM (CUDA)")
    parser.add_argument("--oom-cap-tokens", type=int, default=256, help="the token cap of the induced OOM (CPU)")
    parser.add_argument("--memory-budget", type=parse_bytes, default=None,
                        help="memory budget of the throughput runs (default: the device's; on CPU give a small one, "
                             "e.g. 64MiB)")
    parser.add_argument("--plan-memory-budget", type=parse_bytes, default="4GiB",
                        help="memory budget of the memory plan step: small enough that the probe must bind it")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "command": " ".join(sys.argv), "definitions": DEFINITIONS}

    def cannot_run(message: str) -> int:
        report["error"] = message
        save_report(report, args.json)
        print(f"gpu_check: {message}", file=sys.stderr, flush=True)
        return EXIT_CANNOT_RUN

    started = time.perf_counter()
    from pipeline.core.device import resolve_device  # first: `pipeline` sets the allocator before torch starts CUDA
    from pipeline.core.errors import UsageError

    import torch

    if args.require_cuda and not torch.cuda.is_available():
        return cannot_run(f"--require-cuda: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU; "
                          f"run on the device machine's python3, or drop --require-cuda for a CPU dry run")
    try:
        device = resolve_device(args.device)
    except UsageError as error:
        return cannot_run(str(error))
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(args.rows, columns=["id", "text"])
    except Exception as error:  # noqa: BLE001 - named in the JSON
        return cannot_run(f"--rows {args.rows}: {type(error).__name__}: {error}")
    import pyarrow as pa

    from pipeline.core.settings import MAX_WINDOW_ROWS

    import_before_clock()

    imports_s = time.perf_counter() - started
    on_gpu = device.type == "cuda"
    levels = [int(t) for t in (args.token_levels or (GPU_TOKEN_LEVELS if on_gpu else CPU_TOKEN_LEVELS)).split(",")]
    if args.limit_rows:
        table = table.slice(0, args.limit_rows)
    half = args.correctness_rows // 2
    sample = pa.concat_tables([table.slice(0, half), table.slice(max(half, table.num_rows - half))])
    distinct, dropped = distinct_rows(table, args.repeat or (2 if on_gpu else 1))
    window_rows = throughput_window_rows(distinct.num_rows, MIN_WINDOWS, MAX_WINDOW_ROWS)
    report["before_clock"] = {"imports_s": round(imports_s, 2), "warm_up_s": warm_up(device)}
    report["throughput_rows"] = {"rows": distinct.num_rows, "duplicate_texts_dropped": dropped,
                                 "window_rows": window_rows}
    report["budget_s"], report["steps"] = args.budget_s, list(STEP_S)
    print(f"imports {report['before_clock']['imports_s']}s, {device} started in "
          f"{report['before_clock']['warm_up_s']}s; the {args.budget_s:g} s budget starts now", flush=True)

    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        os.environ["XDG_CACHE_HOME"] = str(scratch / "cache")  # a fresh plan cache: nothing from an earlier run
        check = Check(args, device, scratch, args.budget_s, report)
        check.save()
        inputs = lambda: write_rows(distinct, scratch / "in")  # noqa: E731
        steps = {"environment": lambda block: environment(check, block),
                 "correctness": lambda block: correctness(check, block, sample),
                 "throughput": lambda block: throughput(check, block, inputs(), distinct["text"].to_pylist(), levels,
                                                        window_rows),
                 "memory_plan": lambda block: memory_plan(check, block),
                 "induced_oom": lambda block: induced_oom(check, block, write_rows(table, scratch / "oom-in"),
                                                          table.num_rows),
                 "compile": lambda block: compiled(check, block, inputs(), distinct.num_rows, window_rows,
                                                   report.get("throughput", {}).get("lengthwise", []))}
        for name in STEP_S:
            seconds = step_deadline_s(STEP_S[name] * args.deadline_scale, args.budget_s,
                                      time.monotonic() - check.started)
            print(f"{name} (deadline {seconds:.0f} s):", flush=True)
            started = time.perf_counter()
            if seconds < 1:
                report[name] = {"not_run": NOT_RUN_FOR_TIME}
            elif name != "environment" and check.loaded is None:
                report[name] = {"not_run": "the environment step did not load the model"}
            else:
                run_step(check, name, steps[name], seconds)
            report.setdefault("step_s", {})[name] = round(time.perf_counter() - started, 2)
            check.save()
            print(f"  ({report['step_s'][name]}s)", flush=True)
    result = report["verdict"]
    print(f"verdict: {'passed' if result['passed'] else 'FAILED'} {json.dumps(result['checks'])}; compile: "
          f"{result['compile']}; skipped for time: {result['skipped_for_time'] or 'nothing'}", flush=True)
    return 0 if result["passed"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
