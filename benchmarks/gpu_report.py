"""The GPU check's arithmetic and its judgement, pure (no torch): rates and their ratios to
sentence-transformers, model FLOPs and MFU, the SDPA kernel read off profiler names, step
deadlines, and the verdict. `benchmarks/gpu_check.py` measures; this module says what the
numbers mean, and `DEFINITIONS` goes into the JSON beside them."""

from __future__ import annotations

import numpy as np

MIN_COSINE = 0.999  # lengthwise in its dtype against sentence-transformers in the same dtype

DEFINITIONS = {
    "throughput_rows": "the rows once per --repeat, the k-th copy's words rotated by k (the same tokens, another "
                       "text), every duplicate text dropped: lengthwise and ST compute every row, with --no-dedupe "
                       "(`deduplicated_rows` 0 in every level)",
    "cold_rows_per_s": "rows / the whole run_job wall: model load, plan, tokenizer pool start, read, tokenize, "
                       "forward, write, commit (what a nightly run of this size sees)",
    "past_setup_rows_per_s": "rows / (wall - setup): the run once loaded and planned, read to commit, the first "
                             "window's fill and the last one's drain included",
    "steady_rows_per_s": "rows of the batches after the first / seconds from the first batch's result to the last's, "
                         "over at least 5 windows (`window_rows`): the rate once the pipeline is full",
    "device_rows_per_s": "rows / forward seconds (CUDA events around each batch's forward and output copy on a GPU; "
                         "the host's clock on a CPU)",
    "device_padded_tokens_per_s": "padded tokens (rows x padded length, summed over batches) / forward seconds",
    "st_rows_per_s": "rows / a warm SentenceTransformer.encode of the same rows, same device and dtype, "
                     "TOKENIZERS_PARALLELISM=true (its tokenizer uses every core)",
    "st_padded_tokens_per_s": "the padded tokens encode computes (its batches: rows sorted by length, batch_size "
                              "at a time, each padded to its longest) / its wall",
    "ratio_to_st": "a lengthwise rate / ST's rows/s at its best batch size (> 1: lengthwise faster)",
    "flops_per_token": "per layer 2 x (4 h^2 + 2 h i) for the projections and 4 L h for attention (QK^T and AV, L "
                       "the mean length); embeddings and pooling left out",
    "mfu": "model FLOPs of the tokens the forward computed (`mfu_tokens`: padded tokens at the mean padded length "
           "for a padded forward, real tokens at the mean real length for an unpadded one) / forward seconds / the "
           "measured matmul peak in the run's dtype",
    "real_token_mfu": "as mfu, counting real tokens at the mean real length: the MFU of an unpadded level, and the "
                      "useful part of a padded one (padding is work the device did for nothing)",
    "matmul_peak_flops": "2 n^3 / seconds of an n x n x n matmul in the run's dtype on this device, best of the timed "
                         "repeats after warm-ups",
    "sdpa_kernel": "the attention kernel the profiler saw in one forward of a batch with padding (mask) and one "
                   "without: flash, efficient, cudnn, math (CUDA); flash_cpu or math (CPU)",
    "unpad_comparison": "the `auto` level run again with the other forward (--unpad; the level named auto-unpad-on "
                        "or -off): padded (every linear layer on rows x padded length) against unpadded (real tokens "
                        "packed, attention per row); `unpad` in each level says which ran and its attention kernel",
    "peak_reserved_bytes": "the CUDA allocator's reserved peak from the run's last probe measurement to its end: the "
                           "batches' peak (each probe measurement resets it)",
    "plan_within_budget": "every bucket's measured probe peak <= the plan's available bytes, under "
                          "--plan-memory-budget (4 GiB: a budget the probe must bind, not the whole device)",
    "lossless_oom": "under an induced out-of-memory (a memory cap on CUDA; on a CPU a forward over a token cap "
                    "raises torch.OutOfMemoryError) batches split and every input row is written",
    "weights_stored_dtype": "the dtypes of the tensors in the model's safetensors files, read off their headers "
                            "(gpu_assets' MiniLM is stored in float16, whatever dtype the run computes in)",
    "skipped_for_time": "steps and levels not started, or cut by their deadline, for lack of time: not a failure; "
                        "what finished before is kept",
}


def rates(rows: int, real_tokens: int, padded_tokens: int, wall_s: float, setup_s: float, device_s: float,
          span_rows: int, span_s: float) -> dict:
    """A lengthwise run's rates: cold (whole wall), past setup, steady (first batch to last:
    `span_rows` after the first batch in `span_s`), on the device."""
    def per(count: float, seconds: float, digits: int = 1):
        return round(count / seconds, digits) if seconds > 0 else None

    return {"cold_rows_per_s": per(rows, wall_s), "past_setup_rows_per_s": per(rows, wall_s - setup_s),
            "steady_rows_per_s": per(span_rows, span_s), "device_rows_per_s": per(rows, device_s),
            "device_padded_tokens_per_s": per(padded_tokens, device_s, 0),
            "real_tokens_per_s": per(real_tokens, wall_s, 0),
            "device_share": round(device_s / wall_s, 3) if wall_s > 0 else None}


def steady_span(batch_ends: list[tuple[float, int]]) -> tuple[int, float]:
    """(rows, seconds) from the first batch's result to the last's: `batch_ends` holds each
    batch's (clock, rows) as its outputs came back; the first batch's own rows are before the span."""
    if len(batch_ends) < 2:
        return 0, 0.0
    return sum(rows for _, rows in batch_ends[1:]), batch_ends[-1][0] - batch_ends[0][0]


def throughput_window_rows(rows: int, windows: int, largest: int) -> int:
    """Window rows that cut `rows` into at least `windows` windows (none above `largest`, the
    auto maximum), so a level's steady rate is not mostly one window's fill and drain."""
    return max(1, min(largest, rows // windows))


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 3) if ours and theirs else None


def with_ratios_to_st(block: dict) -> None:
    """Each lengthwise level's rates over ST's best rows/s so far (the step may end at any level)."""
    if not block["sentence_transformers"]:
        return
    best = max(block["sentence_transformers"], key=lambda level: level["rows_per_s"])
    for level in block["lengthwise"]:
        level["ratio_to_st"] = {"st_batch_size": best["batch_size"],
                                **{rate: ratio(level[f"{rate}_per_s"], best["rows_per_s"])
                                   for rate in ("cold_rows", "past_setup_rows", "steady_rows", "device_rows")},
                                "device_padded_tokens": ratio(level["device_padded_tokens_per_s"],
                                                              best["padded_tokens_per_s"])}


def encode_padded_tokens(lengths: np.ndarray, batch_size: int) -> int:
    """Padded tokens of sentence-transformers' `encode`: rows sorted longest first, cut into
    `batch_size` rows, each batch padded to its longest row."""
    ordered = np.sort(np.asarray(lengths, dtype=np.int64))[::-1]
    return int(sum(len(chunk) * int(chunk[0]) for chunk in np.array_split(ordered, range(batch_size, len(ordered),
                                                                                          batch_size)) if len(chunk)))


def flops_per_token(hidden: int, intermediate: int, layers: int, mean_padded_length: float) -> float:
    """Forward FLOPs per padded token of a BERT-style encoder (see DEFINITIONS)."""
    return layers * (2 * (4 * hidden * hidden + 2 * hidden * intermediate) + 4 * mean_padded_length * hidden)


def utilization(tokens: int, mean_length: float, device_s: float, peak_flops: float | None,
                dims: dict | None) -> float | None:
    """`tokens` × FLOPs per token at `mean_length` / forward seconds / peak; None if unknown.
    Six significant digits: a tiny model's MFU on a CPU is far below 1e-4."""
    if not (peak_flops and dims and device_s > 0 and tokens):
        return None
    per_token = flops_per_token(dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"],
                                mean_length)
    return float(f"{tokens * per_token / device_s / peak_flops:.6g}")


def level_mfu(rows: int, real_tokens: int, padded_tokens: int, device_s: float, peak_flops: float | None,
              dims: dict | None, unpadded: bool) -> dict:
    """A level's MFU on the tokens its forward computed (real ones when it ran unpadded) and
    on its real tokens alone."""
    real = utilization(real_tokens, real_tokens / rows if rows else 0, device_s, peak_flops, dims)
    padded = utilization(padded_tokens, padded_tokens / rows if rows else 0, device_s, peak_flops, dims)
    return {"mfu": real if unpadded else padded, "mfu_tokens": "real" if unpadded else "padded",
            "real_token_mfu": real}


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


NOT_RUN_FOR_TIME = "no time left in --budget-s"


def skipped_for_time(report: dict) -> list[str]:
    """Steps not run or cut by their deadline, and levels a step skipped for time: kept apart
    from failures (what finished is in the report)."""
    skipped = []
    for name, block in report.items():
        if not isinstance(block, dict) or name in ("definitions", "verdict"):
            continue
        if "timed_out" in block or block.get("not_run") == NOT_RUN_FOR_TIME:
            skipped.append(name)
        skipped += [f"{name}: {level}" for level in block.get("skipped_for_time", [])]
    return skipped


def throughput_levels(report: dict) -> list[dict]:
    """Every lengthwise level the throughput and compile steps measured (the unpad flip is one
    of the throughput levels)."""
    compiled = report.get("compile") or {}
    return [*(report.get("throughput") or {}).get("lengthwise", []), *([compiled] if "rows_written" in compiled else [])]


def compile_outcome(block: dict | None) -> str:
    """What the compile step found, in words: outside `passed` (a slow or failed compile says
    nothing about the outputs)."""
    block = block or {}
    if "device_speedup_over_eager" in block:
        return f"{block['device_speedup_over_eager']}x eager on the device, compiled in {block['compile_s']} s"
    for key in ("timed_out", "error", "not_run", "skipped"):
        if key in block:
            return f"{key.replace('_', ' ')}: {block[key]}"
    return "not run"


def verdict(report: dict) -> dict:
    """Pass or fail per check from what the steps recorded; a check whose step did not run or
    failed is not ok (None: nothing to judge here). `passed` holds when every check is ok and
    no step raised; steps and levels skipped for time are listed apart, and compile's outcome
    is beside `passed`, not in it. `gpu_run` says whether it was a CUDA run at all."""
    checks = {}
    correctness = report.get("correctness") or {}
    dtype = correctness.get("dtype")
    ran = correctness.get(dtype) if dtype else None
    checks["cosine"] = check(ran["min_cosine_vs_st"] >= MIN_COSINE if ran else False,
                             ran["min_cosine_vs_st"] if ran else step_state(correctness),
                             f"min cosine vs ST in {dtype or 'the run dtype'} >= {MIN_COSINE}")
    finite = [correctness[d]["all_finite"] for d in ("float32", dtype) if isinstance(correctness.get(d), dict)]
    checks["finite"] = check(bool(finite) and all(finite), finite or step_state(correctness), "every output finite")
    oom = report.get("induced_oom") or {}
    if "lost_rows" in oom:
        checks["lossless_oom"] = check(oom["lost_rows"] == 0 and oom["oom_splits"] > 0,
                                       {"lost_rows": oom["lost_rows"], "oom_splits": oom["oom_splits"]},
                                       "splits happened and no row was lost")
    else:
        checks["lossless_oom"] = check(False, step_state(oom), "splits happened and no row was lost")
    plan = (report.get("memory_plan") or {}).get("plan_within_budget")
    checks["plan_within_budget"] = check(plan is True, plan if plan is not None else step_state(report.get("memory_plan")),
                                         "every probed peak within the available bytes")
    deduplicated = [level["deduplicated_rows"] for level in throughput_levels(report) if "deduplicated_rows" in level]
    checks["every_row_computed"] = check(all(count == 0 for count in deduplicated) if deduplicated else None,
                                         sum(deduplicated) if deduplicated else "no throughput level ran",
                                         "0 deduplicated rows in every throughput level")
    failed_steps = sorted(name for name, step in report.items()
                          if isinstance(step, dict) and "error" in step and name != "compile")
    gpu_run = (report.get("environment") or {}).get("device", "").startswith("cuda")
    return {"passed": all(c["ok"] is not False for c in checks.values()) and not failed_steps,
            "gpu_run": gpu_run, "checks": checks, "failed_steps": failed_steps,
            "skipped_for_time": skipped_for_time(report), "compile": compile_outcome(report.get("compile"))}


def step_state(block: dict | None) -> str:
    """Why a step has no value for its check: its error, its deadline, why it did not run."""
    block = block or {}
    for key in ("error", "timed_out", "not_run"):
        if key in block:
            return f"{key.replace('_', ' ')}: {block[key]}" if key != "error" else block[key]
    return "not run"
