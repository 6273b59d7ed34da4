"""`--dtype auto` on a CPU, a step of choosing the model (`runtime/choice.py`): a bf16 trial against
float32 on the job's own rows (random ids without them), its verdict cached."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.core.cache import cache_dir, plan_cache_key, read_keyed, write_keyed
from pipeline.core.device import DTYPES, device_name, native_bf16_feature
from pipeline.core.settings import ModelSettings
from pipeline.core.tokenize import TokenizerSpec, count_prompt_tokens, load_tokenizer_spec

if TYPE_CHECKING:
    from pipeline.runtime.choice import ModelChoice


BF16_MIN_SPEEDUP = 1.2  # below this, the precision is not worth it
TRIAL_ROWS, TRIAL_LENGTH = 64, 128  # the trial: 64 rows; random ids are 32…128 tokens, padded
TRIAL_BATCHES = 4  # the input's trial rows run in this many batches by length, each padded to its longest


def pick_cpu_dtype(feature: str | None, capability: str, speedup: float | None, agrees: bool | None,
                   agreement: str) -> tuple[str, str]:
    """(dtype name, why) from what the CPU has and what the trial batch measured."""
    if feature is None:
        return "float32", f"float32: no native bf16 ({capability})"
    if not agrees:
        return "float32", f"float32: bfloat16 disagrees with float32 ({agreement})"
    if speedup < BF16_MIN_SPEEDUP:
        return "float32", (f"float32: bfloat16 only {speedup:.2f}x as fast on {feature} (needs {BF16_MIN_SPEEDUP}x; "
                           f"{agreement})")
    return "bfloat16", f"bfloat16: {feature}, {speedup:.2f}x faster, {agreement}"


@dataclass(frozen=True)
class TrialBatches:
    """What the bf16 trial runs: (input ids, attention mask) batches, and what they are, in words."""

    batches: list
    rows: str  # "64 of the input's rows (3–128 tokens)", "64 random-id rows"
    prompt_tokens: int = 0  # leading prompt tokens in every row (pooling may leave them out)


def choose_cpu_dtype(settings: ModelSettings, plan_cache: str | None, choice: ModelChoice,
                     trial_texts: Callable[[], list | None] | None) -> tuple[torch.dtype, str]:
    """`--dtype auto` on the CPU: bfloat16 when the CPU runs it natively and the trial is at
    least BF16_MIN_SPEEDUP times faster in it and agrees with float32 (the job's test, flag
    flips included) on the job's own rows (`trial_texts()`, tokenized as the run will; random ids
    without them); else float32. The decision is cached per model content, job and its options,
    trial, CPU and torch version (`dtype_verdict_key`)."""
    feature = native_bf16_feature()
    if feature is None:
        return torch.float32, pick_cpu_dtype(None, torch.backends.cpu.get_cpu_capability(), None, None, "")[1]
    key, name = dtype_verdict_key(settings.job, choice, trial_texts is not None)
    cached = read_keyed(cache_dir(plan_cache) / f"dtype-{name}.json", key)
    if cached and cached.get("dtype") in DTYPES:
        return DTYPES[cached["dtype"]], cached["reason"] + " (cached)"
    loading = {"allow_pickle": settings.allow_pickle, "trust_remote_code": settings.trust_remote_code,
               "attention": choice.attention, **choice.job_options}
    try:
        spec = functools.partial(load_tokenizer_spec, choice.path, choice.max_length, settings.trust_remote_code,
                                 choice.prompt, choice.lowercase)
        trial = input_trial_batches(trial_texts, spec) if trial_texts else None
        if trial is None:  # no rows (`plan`, the batcher, an input with no readable text): random ids
            key, name = dtype_verdict_key(settings.job, choice, False)
        speedup, agrees, agreement = bf16_trial(choice.job, choice.path, loading, trial,
                                                min(TRIAL_LENGTH, choice.max_length))
    except Exception as error:  # noqa: BLE001 - out of memory, an op bf16 lacks: float32 is always safe
        return torch.float32, f"float32: the bfloat16 trial failed ({type(error).__name__}: {error})"
    chosen, reason = pick_cpu_dtype(feature, torch.backends.cpu.get_cpu_capability(), speedup, agrees, agreement)
    write_keyed(cache_dir(plan_cache) / f"dtype-{name}.json", key, {"dtype": chosen, "reason": reason})
    return DTYPES[chosen], reason


def dtype_verdict_key(job: str, choice: ModelChoice, on_input_rows: bool) -> tuple[dict, str]:
    """What a CPU dtype verdict holds for: the model's content (weights, pooling, normalisation,
    prompts: a retrained checkpoint of the same shape gets its own trial), the job and its
    options (thresholds decide flag flips), the prompt, which rows it ran on, CPU, torch."""
    return plan_cache_key(kind="cpu-dtype", model=choice.content_hash, job=job, options=choice.job_options,
                          prompt=choice.prompt, trial="input rows" if on_input_rows else "random ids",
                          device=device_name(torch.device("cpu")), torch=torch.__version__,
                          length=choice.max_length if on_input_rows else min(TRIAL_LENGTH, choice.max_length))


def spread_over_lengths(lengths: np.ndarray, count: int) -> np.ndarray:
    """Up to `count` row indices spread evenly over the rows sorted by length (shortest to
    longest), so the trial sees short, typical and long rows; rows of length 0 (no text) are
    left out."""
    order = np.argsort(lengths, kind="stable")
    order = order[lengths[order] > 0]
    if len(order) <= count:
        return order
    return order[np.unique(np.linspace(0, len(order) - 1, count).round().astype(np.int64))]


def input_trial_batches(texts: Callable[[], list[str]], spec: Callable[[], TokenizerSpec]) -> TrialBatches | None:
    """TRIAL_ROWS of the job's own texts, tokenized as the run will (`spec()`), spread over their
    lengths (`spread_over_lengths`) in TRIAL_BATCHES batches by length; None without any text."""
    from tokenizers import Tokenizer

    from pipeline.core.collate import collate
    from pipeline.core.tokenize import encode_texts

    sample = texts()
    if not sample:
        return None
    tokenizer_spec = spec()
    encoded = encode_texts(sample, Tokenizer.from_str(tokenizer_spec.tokenizer_json), tokenizer_spec)
    rows = spread_over_lengths(encoded.lengths, TRIAL_ROWS)
    if not len(rows):
        return None
    batches = []
    for part in np.array_split(rows, min(TRIAL_BATCHES, len(rows))):
        input_ids, attention_mask = collate(encoded.token_ids, encoded.offsets, part, int(encoded.lengths[part].max()),
                                            tokenizer_spec.pad_token_id)
        batches.append((torch.from_numpy(input_ids), torch.from_numpy(attention_mask)))
    lengths = encoded.lengths[rows]
    return TrialBatches(batches, f"{len(rows)} of the input's rows ({lengths.min()}–{lengths.max()} tokens)",
                        count_prompt_tokens(tokenizer_spec))


def random_trial_batches(vocab: int, length: int) -> TrialBatches:
    """One padded batch of TRIAL_ROWS rows of random token ids, 1/4 to all of `length` long."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(1, length // 4), length + 1, (TRIAL_ROWS,), generator=generator)
    lengths[0] = length
    attention_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    input_ids = torch.randint(1000 if vocab > 2000 else 1, vocab, (TRIAL_ROWS, length), generator=generator)
    return TrialBatches([(input_ids * attention_mask, attention_mask)], f"{TRIAL_ROWS} random-id rows")


def forward_batches(job, model, batches: list) -> dict[str, torch.Tensor]:
    """The job's outputs of every batch, rows concatenated in batch order."""
    outputs = [job.forward(model, input_ids, attention_mask) for input_ids, attention_mask in batches]
    return {name: torch.cat([output[name] for output in outputs]) for name in outputs[0]}


def bf16_trial(job, path: str, loading: dict, trial: TrialBatches | None, length: int) -> tuple[float, bool, str]:
    """(bf16 speed-up over fp32, whether the job's outputs agree, how closely) on `trial` (None:
    random ids up to `length` tokens), best of three timed passes after a warm-up each."""
    device = torch.device("cpu")
    prompt_tokens = trial.prompt_tokens if trial else 0
    models = {dtype: job.load(path, device, dtype, prompt_tokens=prompt_tokens, **loading)
              for dtype in (torch.float32, torch.bfloat16)}
    trial = trial or random_trial_batches(getattr(models[torch.float32].config, "vocab_size", 1000), length)
    seconds, outputs = {}, {}
    with torch.inference_mode():
        for dtype, model in models.items():
            outputs[dtype] = forward_batches(job, model, trial.batches)
            times = []
            for _ in range(3):
                started = time.perf_counter()
                forward_batches(job, model, trial.batches)
                times.append(time.perf_counter() - started)
            seconds[dtype] = min(times)
    agrees, agreement = job.agreement(outputs[torch.float32], outputs[torch.bfloat16], model=models[torch.float32])
    return seconds[torch.float32] / seconds[torch.bfloat16], agrees, f"{agreement} vs float32 on {trial.rows}"
