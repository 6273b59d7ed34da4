"""The GPU check's arithmetic and its judgement, pure (no torch): rates and their ratios to
sentence-transformers, model FLOPs and MFU, the SDPA kernel read off profiler names, step
deadlines, and the verdict. `benchmarks/gpu_check.py` measures; this module says what the
numbers mean, and `DEFINITIONS` goes into the JSON beside them."""

from __future__ import annotations

import numpy as np

MIN_COSINE = 0.999  # lengthwise in its dtype against sentence-transformers in the same dtype

DEFINITIONS = {
    "cold_rows_per_s": "rows / the whole run_job wall: model load, plan, tokenizer pool start, read, tokenize, "
                       "forward, write, commit (what a nightly run of this size sees)",
    "steady_rows_per_s": "rows / (wall - setup): the run once loaded and planned, read to commit",
    "device_rows_per_s": "rows / forward seconds (CUDA events around each batch's forward and output copy on a GPU; "
                         "the host's clock on a CPU)",
    "device_padded_tokens_per_s": "padded tokens (rows x padded length, summed over batches) / forward seconds",
    "st_rows_per_s": "rows / a warm SentenceTransformer.encode of the same rows, same device and dtype, "
                     "TOKENIZERS_PARALLELISM=true (its tokenizer uses every core)",
    "st_padded_tokens_per_s": "the padded tokens encode computes (its batches: rows sorted by length, batch_size "
                              "at a time, each padded to its longest) / its wall",
    "ratio_to_st": "a lengthwise rate / the same rate of ST at its best batch size (> 1: lengthwise faster)",
    "flops_per_token": "per layer 2 x (4 h^2 + 2 h i) for the projections and 4 L h for attention (QK^T and AV, L "
                       "the mean padded length); embeddings and pooling left out",
    "mfu": "model FLOPs of the padded tokens / forward seconds / the measured matmul peak in the run's dtype",
    "useful_mfu": "as mfu, counting real tokens only: padding is work the device did for nothing",
    "matmul_peak_flops": "2 n^3 / seconds of an n x n x n matmul in the run's dtype on this device, best of the timed "
                         "repeats after warm-ups",
    "sdpa_kernel": "the attention kernel the profiler saw in one forward of a batch with padding (mask) and one "
                   "without: flash, efficient, cudnn, math (CUDA); flash_cpu or math (CPU)",
    "unpad_comparison": "the throughput level fastest on the device run again with the other forward (--unpad): "
                        "padded (every linear layer on rows x padded length) against unpadded (real tokens packed, "
                        "attention per row); `unpad` in each level says which ran and its attention kernel",
    "peak_reserved_bytes": "the CUDA allocator's reserved peak from the run's last probe measurement to its end: the "
                           "batches' peak (each probe measurement resets it)",
    "plan_within_budget": "every bucket's measured probe peak <= the plan's available bytes",
    "lossless_oom": "under an induced out-of-memory (a memory cap on CUDA; on a CPU a forward over a token cap "
                    "raises torch.OutOfMemoryError) batches split and every input row is written",
}


def rates(rows: int, real_tokens: int, padded_tokens: int, wall_s: float, setup_s: float, device_s: float) -> dict:
    """A lengthwise run's rates: cold (whole wall), steady (past setup), on the device."""
    def per(count: float, seconds: float, digits: int = 1):
        return round(count / seconds, digits) if seconds > 0 else None

    return {"cold_rows_per_s": per(rows, wall_s), "steady_rows_per_s": per(rows, wall_s - setup_s),
            "device_rows_per_s": per(rows, device_s), "device_padded_tokens_per_s": per(padded_tokens, device_s, 0),
            "real_tokens_per_s": per(real_tokens, wall_s, 0),
            "device_share": round(device_s / wall_s, 3) if wall_s > 0 else None}


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 3) if ours and theirs else None


def encode_padded_tokens(lengths: np.ndarray, batch_size: int) -> int:
    """Padded tokens of sentence-transformers' `encode`: rows sorted longest first, cut into
    `batch_size` rows, each batch padded to its longest row."""
    ordered = np.sort(np.asarray(lengths, dtype=np.int64))[::-1]
    return int(sum(len(chunk) * int(chunk[0]) for chunk in np.array_split(ordered, range(batch_size, len(ordered),
                                                                                          batch_size)) if len(chunk)))


def flops_per_token(hidden: int, intermediate: int, layers: int, mean_padded_length: float) -> float:
    """Forward FLOPs per padded token of a BERT-style encoder (see DEFINITIONS)."""
    return layers * (2 * (4 * hidden * hidden + 2 * hidden * intermediate) + 4 * mean_padded_length * hidden)


def utilization(tokens: int, rows: int, padded_tokens: int, device_s: float, peak_flops: float | None,
                dims: dict | None) -> float | None:
    """`tokens` (padded or real) × FLOPs per token / forward seconds / peak; None if unknown."""
    if not (peak_flops and dims and device_s > 0 and rows):
        return None
    per_token = flops_per_token(dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"],
                                padded_tokens / rows)
    return round(tokens * per_token / device_s / peak_flops, 4)


SDPA_KERNELS = (  # (kind, substrings of profiler event names), most specific first
    ("flash_cpu", ("_flash_attention_for_cpu",)),
    ("cudnn", ("cudnn_attention", "cudnn_sdpa")),
    ("flash", ("_flash_attention", "flash_fwd", "pytorch_flash")),
    ("efficient", ("efficient_attention", "fmha_cutlass", "fmha")),
    ("math", ("_scaled_dot_product_attention_math",)),
)


def sdpa_kernel(event_names: list[str]) -> str:
    """Which SDPA kernel ran, read off a profiler's event names; `none seen` when attention did
    not go through SDPA (eager attention: matmuls and a softmax)."""
    for kind, marks in SDPA_KERNELS:
        if any(mark in name for name in event_names for mark in marks):
            return kind
    return "none seen"


def step_deadline_s(own_s: float, budget_s: float, elapsed_s: float) -> float:
    """A step's deadline: its own share, never past what is left of the whole budget."""
    return max(0.0, min(own_s, budget_s - elapsed_s))


def check(ok: bool | None, value, needs: str) -> dict:
    return {"ok": ok, "value": value, "needs": needs}


def verdict(report: dict) -> dict:
    """Pass or fail per check from what the steps recorded; a check whose step did not run or
    failed is not ok (None: it cannot run on this device). `passed` holds when every check
    that can run here is ok; `gpu_run` says whether it was a CUDA run at all."""
    checks = {}
    correctness = report.get("correctness") or {}
    dtype = correctness.get("dtype")
    ran = correctness.get(dtype) if dtype else None
    checks["cosine"] = check(ran["min_cosine_vs_st"] >= MIN_COSINE if ran else False,
                             ran["min_cosine_vs_st"] if ran else correctness.get("error", "not run"),
                             f"min cosine vs ST in {dtype or 'the run dtype'} >= {MIN_COSINE}")
    finite = [correctness[d]["all_finite"] for d in ("float32", dtype) if isinstance(correctness.get(d), dict)]
    checks["finite"] = check(bool(finite) and all(finite), finite or "not run", "every output finite")
    oom = report.get("induced_oom") or {}
    if "lost_rows" in oom:
        checks["lossless_oom"] = check(oom["lost_rows"] == 0 and oom["oom_splits"] > 0,
                                       {"lost_rows": oom["lost_rows"], "oom_splits": oom["oom_splits"]},
                                       "splits happened and no row was lost")
    else:
        checks["lossless_oom"] = check(False, oom.get("error", "not run"), "splits happened and no row was lost")
    plan = (report.get("memory_plan") or {}).get("plan_within_budget")
    checks["plan_within_budget"] = check(plan, plan if plan is not None else
                                         (report.get("memory_plan") or {}).get("error", "not run"),
                                         "every probed peak within the available bytes")
    failed_steps = sorted(name for name, step in report.items() if isinstance(step, dict) and "error" in step)
    gpu_run = (report.get("environment") or {}).get("device", "").startswith("cuda")
    return {"passed": all(c["ok"] is not False for c in checks.values()) and not failed_steps,
            "gpu_run": gpu_run, "checks": checks, "failed_steps": failed_steps}
