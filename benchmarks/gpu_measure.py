"""What the GPU check's steps measure with, shared: the rows (repeated, written, read back),
sentence-transformers loaded and timed, a matmul peak, the attention kernel a forward ran. torch and pyarrow are imported inside
the functions, as in `gpu_check.py` (spawned tokenizer workers import these modules again)."""

from __future__ import annotations

import time
from pathlib import Path

from gpu_report import encode_padded_tokens, sdpa_kernel


def repeat_rows(table, times: int):
    """`table` `times` over, with ids made unique (`id#k`), so that device time dominates."""
    import pyarrow as pa

    ids = [str(value) for value in table["id"].to_pylist()]
    texts = table["text"].to_pylist()
    return pa.table({"id": [f"{value}#{k}" for k in range(times) for value in ids], "text": texts * times})


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
