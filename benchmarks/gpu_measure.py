"""What the GPU check's steps measure with, shared: the rows (made distinct, written, read back),
sentence-transformers loaded and timed, a matmul peak, the attention kernel a forward ran, each
batch's clock in a run, what the host and the weights are. torch and pyarrow are imported inside
the functions, as in `gpu_check.py` (spawned tokenizer workers import these modules again)."""

from __future__ import annotations

import contextlib
import importlib
import json
import shutil
import struct
import subprocess
import time
from pathlib import Path

from gpu_report import encode_padded_tokens, sdpa_kernel


def rotated_words(text: str, turns: int) -> str:
    """`text` with its words rotated by `turns` (0: unchanged): another text of the same words,
    so of the same word-piece tokens (a tokenizer splits within whitespace-separated words)."""
    words = text.split()
    if turns == 0 or not words:
        return text
    turns %= len(words)
    return " ".join(words[turns:] + words[:turns])


def distinct_rows(table, times: int):
    """`table` `times` over, the k-th copy's words rotated by k and ids made unique (`id#k`),
    every text that came before (or null) dropped: rows no run can copy from another, so
    lengthwise and sentence-transformers compute every one. Returns (rows, dropped)."""
    import pyarrow as pa

    ids, texts = [str(value) for value in table["id"].to_pylist()], table["text"].to_pylist()
    seen, kept_ids, kept_texts = set(), [], []
    for turns in range(times):
        for row_id, text in zip(ids, texts):
            variant = rotated_words(text, turns) if text is not None else None
            if variant is not None and variant not in seen:
                seen.add(variant)
                kept_ids.append(f"{row_id}#{turns}")
                kept_texts.append(variant)
    return pa.table({"id": kept_ids, "text": kept_texts}), len(ids) * times - len(kept_ids)


def write_rows(table, directory: Path) -> str:
    import pyarrow.parquet as pq

    if not (directory / "rows.parquet").exists():
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


BEFORE_CLOCK_MODULES = ("transformers", "sentence_transformers", "torch.profiler", "pipeline.engines.local",
                        "pipeline.runtime.model", "pipeline.core.probe")


def import_before_clock() -> None:
    """Import what the steps import, so their seconds come out of no step's deadline."""
    for name in BEFORE_CLOCK_MODULES:
        importlib.import_module(name)


def warm_up(device) -> float:
    """Seconds to start the device's runtime (the CUDA context, cuBLAS) with a small matmul:
    paid before the check's clock starts, so no step's deadline is spent on it."""
    import torch

    started = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.init()
    a = torch.ones(64, 64, device=device)
    (a @ a).sum().item()
    synchronize(device)
    return round(time.perf_counter() - started, 2)


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device, dtype_name: str) -> dict:
    """2n³ / seconds of the fastest of a few n×n×n matmuls in `dtype_name`, after warm-ups."""
    import torch

    n, repeats = (8192, 10) if device.type == "cuda" else (512, 5)
    a = torch.randn(n, n, device=device, dtype=getattr(torch, dtype_name))
    b = torch.randn(n, n, device=device, dtype=getattr(torch, dtype_name))
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return {"n": n, "dtype": dtype_name, "flops": 2 * n**3 / best, "tflops": round(2 * n**3 / best / 1e12, 3)}


def time_encode(model, texts: list, batch_size: int, device) -> float:
    """Seconds of a warm `encode` of `texts` (after a warm-up on a few batches)."""
    model.encode(texts[:batch_size * 2], batch_size=batch_size)
    synchronize(device)
    started = time.perf_counter()
    model.encode(texts, batch_size=batch_size)
    synchronize(device)
    return time.perf_counter() - started


def encode_level(model, texts: list, lengths, batch_size: int, device, **extra) -> dict:
    encode_s = time_encode(model, texts, batch_size, device)
    padded = encode_padded_tokens(lengths, batch_size)
    level = {"batch_size": batch_size, **extra, "encode_s": round(encode_s, 2),
             "rows_per_s": round(len(texts) / encode_s, 1), "padded_tokens_per_s": round(padded / encode_s)}
    print(f"  sentence-transformers encode, batch {batch_size}{' ' + str(extra) if extra else ''}: "
          f"{level['rows_per_s']:,} rows/s (warm)", flush=True)
    return level


def sdpa_kernels(job, model, device) -> dict:
    """The attention kernel the profiler saw in one forward of a batch with padding (through the
    unpadded forward where `--unpad` chose it) and of one without."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    ids = torch.randint(1000, 2000, (4, 64), device=device)
    seen = {}
    for padded in (True, False):
        mask = torch.ones_like(ids)
        if padded:
            mask[0, 40:] = 0
        with torch.inference_mode():
            job.forward(model, ids, mask, padded)  # warm: the first call may choose kernels
            with profile(activities=activities) as profiled:
                job.forward(model, ids, mask, padded)
                synchronize(device)
        names = sorted({event.name for event in profiled.events()})
        kind = sdpa_kernel(names)
        attention = [name for name in names if any(mark in name for mark in ("attention", "flash", "fmha", "sdpa"))]
        seen["padded" if padded else "unpadded"] = {"kernel": kind, "events": attention[:12]}
    print(f"  SDPA kernel: {seen['padded']['kernel']} with padding, {seen['unpadded']['kernel']} without", flush=True)
    return seen


@contextlib.contextmanager
def batch_clock():
    """Each batch's (clock, rows) as the device loop of `run` hands its outputs back, in a list
    this yields: the steady rate is read off it (`gpu_report.steady_span`). It wraps the
    runner's `run_on_device`, which still does all the work."""
    import pipeline.offline.runner as runner

    original, ends = runner.run_on_device, []

    def clocked(*args, **kwargs):
        for item, result in original(*args, **kwargs):
            if result is not None:  # a batch (window parts pass with None)
                ends.append((time.perf_counter(), len(item.rows)))
            yield item, result

    runner.run_on_device = clocked
    try:
        yield ends
    finally:
        runner.run_on_device = original


SAFETENSORS_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "I64": "int64",
                      "I32": "int32", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def stored_weight_dtypes(model_path: str) -> dict | None:
    """Tensors per stored dtype in the model folder's safetensors files, read off their headers
    (8 bytes of length, then JSON) without loading a weight; None without such files."""
    files = sorted(Path(model_path).glob("*.safetensors")) if Path(model_path).is_dir() else []
    if not files:
        return None
    counts: dict = {}
    for path in files:
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                dtype = SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"])
                counts[dtype] = counts.get(dtype, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def compiler_version(command: str = "g++") -> str | None:
    """The first line of `command --version` (torch's compile builds C++ with it), None if absent."""
    if shutil.which(command) is None:
        return None
    try:
        completed = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return completed.stdout.split("\n")[0] or None


@contextlib.contextmanager
def forward_token_cap(cap_tokens: int):
    """On a CPU, where no memory cap exists: a forward of more than `cap_tokens` padded tokens
    raises torch.OutOfMemoryError, so the split, the lowered limits and the accounting run."""
    import torch

    import pipeline.core.forward as shared_forward

    original = shared_forward.forward_splitting_on_oom

    def capped(forward, input_ids, attention_mask, device, max_rows=None, token_type_ids=None):
        def forward_under_cap(ids, mask, *types):
            if ids.numel() > cap_tokens:
                raise torch.OutOfMemoryError(f"induced: {ids.numel()} tokens over the {cap_tokens}-token cap")
            return forward(ids, mask, *types)
        return original(forward_under_cap, input_ids, attention_mask, device, max_rows, token_type_ids)

    shared_forward.forward_splitting_on_oom = capped
    try:
        yield
    finally:
        shared_forward.forward_splitting_on_oom = original
