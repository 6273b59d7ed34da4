"""The GPU check: one script, one JSON, run whenever a GPU is at hand (and on CPU in CI).

On a bare CUDA box with torch, transformers, sentence-transformers, pyarrow, click, fsspec,
tqdm and psutil (nothing installed at run time), from a checkout, with the model and rows
built by `benchmarks/make_gpu_assets.py`:

    PYTHONPATH=. python benchmarks/gpu_check.py --model gpu_assets/minilm --rows gpu_assets/rows.parquet \\
        --json $OUT/gpu_check.json

It records, step by step (the JSON is rewritten after each step, so a timeout keeps what ran;
a failed step keeps its error and traceback, and the others still run), and prints each
step's key numbers:
- environment: versions, GPU name, compute capability, the dtype `auto` picks, the attention
  implementation, the allocator setting in effect;
- correctness: lengthwise against `SentenceTransformer.encode` itself, in float32 and in the
  dtype lengthwise runs in (min cosine, all outputs finite);
- throughput: `run` at several token budgets and at `auto`, on the rows repeated so that device
  time dominates, as rows/s end to end (a cold run: load, probe, pool start, write, commit) and
  over the device part alone; against ST's warm `encode` in the same dtype at batch 32 and 256,
  and with flash-attention 2 where it loads (sentence-transformers then drops the padding);
- the memory plan probed afresh: predicted vs measured peak per bucket, the largest of them,
  probe seconds, and the allocator's reserved peak;
- an induced out-of-memory (a per-process memory cap on CUDA) that must lose no row.

Heavy imports (torch, the pipeline) happen in `main()`: every spawned tokenizer worker imports
this module again.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GPU_TOKEN_LEVELS = "8192,32768,65536,131072,262144"
CPU_TOKEN_LEVELS = "512"


def rates(rows: int, real_tokens: int, wall_s: float, device_s: float) -> dict:
    """Rows and tokens per second end to end and over the device part alone (the forward's
    time: CUDA events on a GPU, the host's clock on a CPU)."""
    return {"rows_per_s": round(rows / wall_s, 1) if wall_s > 0 else None,
            "tokens_per_s": round(real_tokens / wall_s) if wall_s > 0 else None,
            "device_rows_per_s": round(rows / device_s, 1) if device_s > 0 else None,
            "device_share": round(device_s / wall_s, 3) if wall_s > 0 else None}


def repeat_rows(table, times: int):
    """`table` `times` over, with ids made unique (`id#k`), so that device time dominates."""
    import pyarrow as pa

    ids = [str(value) for value in table["id"].to_pylist()]
    texts = table["text"].to_pylist()
    return pa.table({"id": [f"{value}#{k}" for k in range(times) for value in ids], "text": texts * times})


def environment(device, model_path: str) -> dict:
    import platform

    import sentence_transformers
    import torch
    import transformers

    from pipeline.core.device import allocator_config, dtype_name
    from pipeline.core.model import load_model
    from pipeline.core.settings import RunConfig

    loaded = load_model(RunConfig(input=(), output="", model=model_path, device=str(device)))
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "sentence_transformers": sentence_transformers.__version__,
            "device": str(device), "dtype_auto": dtype_name(loaded.choice.dtype),
            "dtype_reason": loaded.choice.dtype_reason,
            "attention_implementation": getattr(loaded.model.config, "_attn_implementation", None),
            "prepared_attention_mask": bool(getattr(getattr(loaded.model, "encoder", loaded.model),
                                                    "takes_prepared_mask", False)),
            "allocator": allocator_config(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count()}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(gpu=properties.name, compute_capability=f"{properties.major}.{properties.minor}",
                    gpu_memory_bytes=properties.total_memory)
    print(f"  {info.get('gpu', info['cpu'])}: dtype auto {info['dtype_auto']} ({info['dtype_reason']}), attention "
          f"{info['attention_implementation']}, prepared mask {info['prepared_attention_mask']}, "
          f"allocator {info['allocator'] or '-'}", flush=True)
    return info


def write_rows(table, directory: Path) -> str:
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, directory / "rows.parquet")
    return str(directory)


def read_embeddings(output: Path):
    """(embeddings, errors) of an output folder, rows in output order."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.concat_tables(pq.read_table(path) for path in sorted(output.glob("*.parquet")))
    width = max((len(v) for v in table["embedding"].to_pylist() if v is not None), default=1)
    values = np.array([v if v is not None else [np.nan] * width for v in table["embedding"].to_pylist()],
                      dtype=np.float32)
    return values, table["error"].to_pylist()


def min_cosine(a, b) -> float:
    import numpy as np

    return float(((a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def sentence_transformer(model_path: str, device, dtype, attention: str | None = None):
    from sentence_transformers import SentenceTransformer

    kwargs = {"dtype": dtype, **({"attn_implementation": attention} if attention else {})}
    return SentenceTransformer(model_path, device=str(device), model_kwargs=kwargs)


def correctness(table, model_path: str, device, dtype_name: str, scratch: Path) -> dict:
    """lengthwise against sentence-transformers' own `encode` of the same rows, in float32 and
    in the dtype lengthwise runs in (`auto`), on the same device."""
    import numpy as np
    import torch

    from pipeline.core.settings import RunConfig
    from pipeline.engines.local import run_job

    texts = table["text"].to_pylist()
    inputs = write_rows(table, scratch / "correctness-in")
    results = {"rows": table.num_rows, "dtype": dtype_name}
    reference = None
    for dtype in dict.fromkeys(("float32", dtype_name)):
        model = sentence_transformer(model_path, device, getattr(torch, dtype))
        theirs = model.encode(texts, batch_size=32, convert_to_numpy=True).astype(np.float32)
        reference = theirs if reference is None else reference
        del model
        output = scratch / f"correctness-{dtype}"
        run_job(RunConfig(input=(inputs,), output=str(output), model=model_path, device=str(device), dtype=dtype,
                          progress=False, tokenize_workers=0, probe=False))
        ours, _ = read_embeddings(output)
        results[dtype] = {"min_cosine_vs_st": min_cosine(ours, theirs),
                          "min_cosine_vs_st_float32": min_cosine(ours, reference),
                          "all_finite": bool(np.isfinite(ours).all())}
        print(f"  {dtype}: min cosine vs ST {results[dtype]['min_cosine_vs_st']:.6f} (vs ST float32 "
              f"{results[dtype]['min_cosine_vs_st_float32']:.6f}), all finite {results[dtype]['all_finite']}",
              flush=True)
    return results


def time_encode(model, texts: list, batch_size: int, device) -> float:
    """Seconds of a warm `encode` of `texts` (after a warm-up on a few batches)."""
    import torch

    model.encode(texts[:batch_size * 2], batch_size=batch_size)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    model.encode(texts, batch_size=batch_size)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def throughput(inputs: str, rows: int, texts: list, model_path: str, device, dtype_name: str, token_levels: list,
               scratch: Path, budget: int | None) -> dict:
    """`run` per token budget (and `auto`), then ST.encode warm in the same dtype, same rows."""
    import torch

    from pipeline.core.settings import RunConfig
    from pipeline.engines.local import run_job

    results = {"rows": rows, "dtype": dtype_name, "lengthwise": [], "sentence_transformers": []}
    for tokens in token_levels + [None]:
        started = time.perf_counter()
        summary = run_job(RunConfig(input=(inputs,), output=str(scratch / f"throughput-{tokens}"), model=model_path,
                                    device=str(device), dtype=dtype_name, max_batch_tokens=tokens,
                                    max_batch_rows=None if tokens is None else 16384, memory_budget=budget,
                                    progress=False))
        wall_s = time.perf_counter() - started
        device_s = summary.stage_s.get("forward", 0.0)
        level = {"max_batch_tokens": tokens or "auto", "batch_setting": summary.batch_setting,
                 "wall_s": round(wall_s, 2), "device_s": round(device_s, 3), "setup_s": summary.stage_s.get("setup"),
                 **rates(rows, summary.real_tokens, wall_s, device_s),
                 "padding_efficiency": round(summary.padding_efficiency, 4), "batches": summary.batches,
                 "dtype": summary.dtype, "stage_s": summary.stage_s, "oom_splits": summary.oom_splits,
                 "rows_written": summary.rows}
        results["lengthwise"].append(level)
        print(f"  lengthwise --max-batch-tokens {level['max_batch_tokens']}: {level['rows_per_s']:,} rows/s end to "
              f"end, {level['device_rows_per_s']:,} rows/s on the device ({level['batches']} batches, "
              f"{level['device_share']:.0%} of the wall on the device)", flush=True)
    model = sentence_transformer(model_path, device, getattr(torch, dtype_name))
    for batch_size in (32, 256):
        encode_s = time_encode(model, texts, batch_size, device)
        results["sentence_transformers"].append({"batch_size": batch_size, "dtype": dtype_name, "encode_s":
                                                 round(encode_s, 2), "rows_per_s": round(rows / encode_s, 1)})
        print(f"  sentence-transformers encode, batch {batch_size}, {dtype_name}: {rows / encode_s:,.1f} rows/s (warm)",
              flush=True)
    del model
    try:
        flash = sentence_transformer(model_path, device, getattr(torch, dtype_name), "flash_attention_2")
        encode_s = time_encode(flash, texts, 256, device)
        results["sentence_transformers_flash_attention_2"] = {"batch_size": 256, "encode_s": round(encode_s, 2),
                                                              "rows_per_s": round(rows / encode_s, 1)}
        print(f"  sentence-transformers encode, flash-attention 2, batch 256: {rows / encode_s:,.1f} rows/s",
              flush=True)
    except Exception as error:  # noqa: BLE001 - not installed, or not on this device: recorded, not a failure
        results["sentence_transformers_flash_attention_2"] = {"unavailable": f"{type(error).__name__}: {error}"}
        print(f"  sentence-transformers with flash-attention 2: unavailable ({type(error).__name__})", flush=True)
    return results


def memory_plan(model_path: str, device, scratch: Path, budget: int | None) -> dict:
    """The memory plan probed afresh (no cache), its largest measured peak over the buckets, and
    the allocator's reserved peak."""
    import dataclasses

    import torch

    from pipeline.core.model import load_model
    from pipeline.core.probe import memory_plan_for
    from pipeline.core.settings import RunConfig

    config = RunConfig(input=(), output="", model=model_path, device=str(device), max_batch_tokens=None,
                       max_batch_rows=16384, memory_budget=budget, use_plan_cache=False,
                       plan_cache=str(scratch / "plans"))
    loaded = load_model(config)
    config = dataclasses.replace(config, max_length=loaded.choice.max_length)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    plan = memory_plan_for(config, loaded.job, loaded.model, loaded.choice.path, device)
    result = {"probe_s": round(time.perf_counter() - started, 2), "plan": json.loads(plan.to_json()) if plan else None}
    buckets = result["plan"]["buckets"] if plan else []
    result["probe_peak_bytes"] = max((bucket["measured_peak_bytes"] or 0 for bucket in buckets), default=None)
    if device.type == "cuda":
        result["max_memory_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        result["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    print(f"  {len(buckets)} buckets probed in {result['probe_s']}s, largest measured peak "
          f"{result['probe_peak_bytes']} of {result['plan']['available_bytes'] if plan else '-'} bytes", flush=True)
    return result


def induced_oom(inputs: str, rows: int, model_path: str, device, dtype_name: str, scratch: Path,
                cap_bytes: int) -> dict:
    """Huge batches under a per-process memory cap: they must split, and every row must come out."""
    import gc

    import torch

    from pipeline.core.settings import RunConfig
    from pipeline.engines.local import run_job

    if device.type != "cuda":
        print("  skipped: needs CUDA", flush=True)
        return {"skipped": "needs CUDA (torch.cuda.set_per_process_memory_fraction)"}
    gc.collect()
    torch.cuda.empty_cache()  # what earlier steps left cached would count against the cap
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_bytes / total, device)
    try:
        summary = run_job(RunConfig(input=(inputs,), output=str(scratch / "oom"), model=model_path, device=str(device),
                                    dtype=dtype_name, probe=False, max_batch_tokens=1 << 20, max_batch_rows=16384,
                                    progress=False))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    _, errors = read_embeddings(scratch / "oom")
    result = {"cap_bytes": cap_bytes, "rows_in": rows, "rows_written": summary.rows, "oom_splits": summary.oom_splits,
              "lowered_batch_rows": summary.lowered_batch_rows,
              "error_rows": sum(error is not None for error in errors), "lost_rows": rows - summary.rows}
    print(f"  {result['oom_splits']} splits, {result['rows_written']} of {rows} rows written, "
          f"{result['error_rows']} error rows", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder (benchmarks/make_gpu_assets.py builds one)")
    parser.add_argument("--rows", required=True, help="Parquet file with id and text")
    parser.add_argument("--json", required=True, type=Path, help="where the report goes")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--limit-rows", type=int, default=None, help="use only this many rows for throughput")
    parser.add_argument("--repeat", type=int, default=None,
                        help="the rows this many times over for throughput (default: 4 on a GPU, 1 on a CPU)")
    parser.add_argument("--correctness-rows", type=int, default=256)
    parser.add_argument("--token-levels", default=None,
                        help=f"default: {GPU_TOKEN_LEVELS} on a GPU, {CPU_TOKEN_LEVELS} on a CPU")
    parser.add_argument("--oom-cap", default="2GiB", help="the memory cap of the induced out-of-memory step")
    parser.add_argument("--memory-budget", default=None,
                        help="memory budget of the plan (default: the device's; on CPU give a small one, e.g. 64MiB)")
    args = parser.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq

    import pipeline  # noqa: F401 - sets the allocator variable before torch starts CUDA
    from pipeline.core.device import resolve_device
    from pipeline.core.units import parse_bytes

    device = resolve_device(args.device)
    on_gpu = device.type == "cuda"
    budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    levels = [int(t) for t in (args.token_levels or (GPU_TOKEN_LEVELS if on_gpu else CPU_TOKEN_LEVELS)).split(",")]
    table = pq.read_table(args.rows, columns=["id", "text"])
    if args.limit_rows:
        table = table.slice(0, args.limit_rows)
    half = args.correctness_rows // 2
    sample = pa.concat_tables([table.slice(0, half), table.slice(max(half, table.num_rows - half))])
    repeated = repeat_rows(table, args.repeat or (4 if on_gpu else 1))
    report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def save() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")

    def dtype() -> str:  # what lengthwise runs in here; float32 if the environment step failed
        return report.get("environment", {}).get("dtype_auto", "float32")

    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        os.environ["XDG_CACHE_HOME"] = str(scratch / "cache")  # a fresh plan cache: nothing from an earlier run
        inputs = scratch / "in"
        steps = [("environment", lambda: environment(device, args.model)),
                 ("correctness", lambda: correctness(sample, args.model, device, dtype(), scratch)),
                 ("throughput", lambda: throughput(write_rows(repeated, inputs), repeated.num_rows,
                                                   repeated["text"].to_pylist(), args.model, device, dtype(), levels,
                                                   scratch, budget)),
                 ("memory_plan", lambda: memory_plan(args.model, device, scratch, budget)),
                 ("induced_oom", lambda: induced_oom(write_rows(repeated, inputs), repeated.num_rows, args.model,
                                                     device, dtype(), scratch, parse_bytes(args.oom_cap)))]
        for name, step in steps:
            print(f"{name}:", flush=True)
            started = time.perf_counter()
            try:
                report[name] = step()
            except Exception as error:  # noqa: BLE001 - a failed step is recorded, the others still run
                report[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
                print(f"  ERROR {report[name]['error']}", flush=True)
            report.setdefault("step_s", {})[name] = round(time.perf_counter() - started, 2)
            save()
            print(f"  ({report['step_s'][name]}s)", flush=True)


if __name__ == "__main__":
    main()
