"""The GPU check: one script, one JSON, run whenever a GPU is at hand (and on CPU in CI).

On a bare CUDA box with torch, transformers, sentence-transformers, pyarrow, click, fsspec,
tqdm and psutil (nothing installed at run time), from a checkout, with the model and rows
built by `benchmarks/make_gpu_assets.py`:

    PYTHONPATH=. python benchmarks/gpu_check.py --model gpu_assets/minilm --rows gpu_assets/rows.parquet \\
        --json $OUT/gpu_check.json

It records, step by step (the JSON is rewritten after each step, so a timeout keeps what ran):
- environment: versions, GPU name, compute capability, the attention implementation;
- correctness: lengthwise in float32 and bfloat16 against a float32 one-row-at-a-time reference
  on the same device (min cosine, all outputs finite);
- throughput: `run` end to end at several token budgets and at the memory plan's choice, against
  `SentenceTransformer.encode` in the same dtype at batch 32 and 256, on the same rows;
- the memory plan probed afresh: predicted vs measured peak per bucket, probe seconds, and the
  allocator's reserved peak;
- an induced out-of-memory (a per-process memory cap on CUDA) that must lose no row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from pipeline.core.settings import RunConfig  # noqa: E402
from pipeline.core.device import allocator_config, dtype_name  # noqa: E402
from pipeline.engines.local import run_job  # noqa: E402


def environment(device: torch.device, model_path: str) -> dict:
    import sentence_transformers
    import transformers

    from pipeline.core.model import load_model

    loaded = load_model(RunConfig(input=(), output="", model=model_path, device=str(device)))
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "sentence_transformers": sentence_transformers.__version__,
            "device": str(device), "dtype_auto": dtype_name(loaded.choice.dtype),
            "dtype_reason": loaded.choice.dtype_reason,
            "attention_implementation": getattr(loaded.model.config, "_attn_implementation", None),
            "prepared_attention_mask": bool(getattr(getattr(loaded.model, "encoder", loaded.model),
                                                    "takes_prepared_mask", False)),
            "allocator_config": allocator_config(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(gpu=properties.name, compute_capability=f"{properties.major}.{properties.minor}",
                    gpu_memory_bytes=properties.total_memory)
    return info


def write_rows(table: pa.Table, directory: Path) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, directory / "rows.parquet")
    return str(directory)


def read_embeddings(output: Path) -> tuple[np.ndarray, list]:
    table = pa.concat_tables(pq.read_table(p) for p in sorted(output.glob("*.parquet")))
    return np.array([v if v is not None else [np.nan] for v in table["embedding"].to_pylist()], dtype=object), \
        table["error"].to_pylist()


def correctness(table: pa.Table, model_path: str, device: torch.device, scratch: Path) -> dict:
    """lengthwise (batched, padded) in float32 and bfloat16 against one row at a time in float32."""
    from pipeline.core.model import load_model

    loaded = load_model(RunConfig(input=(), output="", model=model_path, device=str(device), dtype="float32"))
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(loaded.tokenizer.tokenizer_json)
    reference = []
    with torch.inference_mode():
        for text in table["text"].to_pylist():
            ids = torch.tensor([tokenizer.encode(text).ids], device=device)
            output = loaded.job.forward(loaded.model, ids, torch.ones_like(ids))["embedding"]
            reference.append(output.float().cpu().numpy()[0])
    reference = np.stack(reference)
    inputs = write_rows(table, scratch / "correctness-in")
    results = {"rows": table.num_rows}
    for dtype in ("float32", "bfloat16"):
        output = scratch / f"correctness-{dtype}"
        run_job(RunConfig(input=(inputs,), output=str(output), model=model_path, device=str(device), dtype=dtype,
                          progress=False, tokenize_workers=0, probe=False))
        ours = np.stack(pq.read_table(output / "rows.parquet")["embedding"].to_numpy(zero_copy_only=False))
        cosine = (ours * reference).sum(axis=1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
        results[dtype] = {"min_cosine": float(cosine.min()), "all_finite": bool(np.isfinite(ours).all())}
    return results


def throughput(inputs: str, rows: int, texts: list, model_path: str, device: torch.device, token_levels: list,
               scratch: Path, budget: int | None) -> dict:
    """`run` end to end per token budget (and auto: the device's default under the memory plan), then
    ST.encode, same rows."""
    results = {"rows": rows, "lengthwise": [], "sentence_transformers": []}
    for tokens in token_levels + [None]:
        output = scratch / f"throughput-{tokens}"
        started = time.perf_counter()
        summary = run_job(RunConfig(input=(inputs,), output=str(output), model=model_path, device=str(device),
                                    max_batch_tokens=tokens, max_batch_rows=None if tokens is None else 16384,
                                    memory_budget=budget,
                                    progress=False))
        wall_s = time.perf_counter() - started
        results["lengthwise"].append({
            "max_batch_tokens": tokens or "auto", "wall_s": round(wall_s, 2), "rows_per_s": round(rows / wall_s, 1),
            "tokens_per_s": round(summary.real_tokens / wall_s), "padding_efficiency": round(summary.padding_efficiency, 4),
            "device_busy": round(summary.device_busy_fraction, 3), "batches": summary.batches, "dtype": summary.dtype,
            "stage_s": summary.stage_s, "oom_splits": summary.oom_splits, "rows_written": summary.rows})
        print(f"lengthwise --max-batch-tokens {tokens or 'auto'}: {rows / wall_s:,.0f} rows/s", flush=True)
    from sentence_transformers import SentenceTransformer

    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    model = SentenceTransformer(model_path, device=str(device), model_kwargs={"torch_dtype": dtype})
    for batch_size in (32, 256):
        model.encode(texts[:batch_size * 2], batch_size=batch_size)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        model.encode(texts, batch_size=batch_size)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        encode_s = time.perf_counter() - started
        results["sentence_transformers"].append({"batch_size": batch_size, "dtype": dtype_name(dtype),
                                                 "encode_s": round(encode_s, 2), "rows_per_s": round(rows / encode_s, 1)})
        print(f"sentence-transformers batch {batch_size}: {rows / encode_s:,.0f} rows/s", flush=True)
    return results


def memory_plan(model_path: str, device: torch.device, scratch: Path, budget: int | None) -> dict:
    """The memory plan probed afresh (no cache), with the allocator's reserved peak."""
    from pipeline.core.probe import memory_plan_for
    from pipeline.core.model import load_model

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
    if device.type == "cuda":
        result["max_memory_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        result["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return result


def induced_oom(inputs: str, rows: int, model_path: str, device: torch.device, scratch: Path,
                cap_bytes: int) -> dict:
    """Huge batches under a per-process memory cap: they must split, and every row must come out."""
    if device.type != "cuda":
        return {"skipped": "needs CUDA (torch.cuda.set_per_process_memory_fraction)"}
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_bytes / total, device)
    try:
        summary = run_job(RunConfig(input=(inputs,), output=str(scratch / "oom"), model=model_path, device=str(device),
                                    probe=False, max_batch_tokens=1 << 20, max_batch_rows=16384, progress=False))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    _, errors = read_embeddings(scratch / "oom")
    return {"cap_bytes": cap_bytes, "rows_in": rows, "rows_written": summary.rows, "oom_splits": summary.oom_splits,
            "lowered_batch_rows": summary.lowered_batch_rows,
            "error_rows": sum(error is not None for error in errors), "lost_rows": rows - summary.rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder (benchmarks/make_gpu_assets.py builds one)")
    parser.add_argument("--rows", required=True, help="Parquet file with id and text")
    parser.add_argument("--json", required=True, type=Path, help="where the report goes")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--limit-rows", type=int, default=None, help="use only this many rows for throughput")
    parser.add_argument("--correctness-rows", type=int, default=256)
    parser.add_argument("--token-levels", default="2048,16384,65536")
    parser.add_argument("--oom-cap", default="2GiB", help="the memory cap of the induced out-of-memory step")
    parser.add_argument("--memory-budget", default=None,
                        help="memory budget of the plan (default: the device's; on CPU give a small one, e.g. 64MiB)")
    args = parser.parse_args()
    from pipeline.core.units import parse_bytes

    device = torch.device(args.device)
    budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    table = pq.read_table(args.rows, columns=["id", "text"])
    if args.limit_rows:
        table = table.slice(0, args.limit_rows)
    half = args.correctness_rows // 2
    sample = pa.concat_tables([table.slice(0, half), table.slice(max(half, table.num_rows - half))])
    report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def save() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        os.environ["XDG_CACHE_HOME"] = str(scratch / "cache")  # a fresh plan cache: nothing from an earlier run
        steps = [("environment", lambda: environment(device, args.model)),
                 ("correctness", lambda: correctness(sample, args.model, device, scratch)),
                 ("throughput", lambda: throughput(write_rows(table, scratch / "in"), table.num_rows,
                                                   table["text"].to_pylist(), args.model, device,
                                                   [int(t) for t in args.token_levels.split(",")], scratch,
                                                   budget)),
                 ("memory_plan", lambda: memory_plan(args.model, device, scratch, budget)),
                 ("induced_oom", lambda: induced_oom(str(scratch / "in"), table.num_rows, args.model, device, scratch,
                                                     parse_bytes(args.oom_cap)))]
        for name, step in steps:
            started = time.perf_counter()
            try:
                report[name] = step()
            except Exception as error:  # noqa: BLE001 - a failed step is recorded, the others still run
                report[name] = {"error": f"{type(error).__name__}: {error}"}
            report.setdefault("step_s", {})[name] = round(time.perf_counter() - started, 2)
            save()
            print(f"{name}: done in {report['step_s'][name]}s", flush=True)


if __name__ == "__main__":
    main()
