"""A compiled forward, chosen like the dtype: by measurement, and only where it pays back.

`torch.compile(model, dynamic=True)` with inductor's freezing (weights folded and prepacked as
constants) runs MiniLM's short batches up to ~2x faster in bf16 on an AMX CPU and not at all
faster in others; its first call compiles for tens of seconds. So `--compile auto` compiles
where a trial on this device and dtype measured it faster and its outputs agree with eager
(the job's strict test), and where the job is large enough that the time it saves beats the
compile: estimated forward seconds = job tokens / eager tokens per second (job tokens: rows
from the shards' footers × mean tokens of a tokenized sample), saved = that × (1 - 1/speedup).
The verdict is cached beside the memory plans; inductor's own caches live there too, so a
second night's compile is a cache load (docs/performance.md has the figures).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

COMPILE_SETTINGS = ("auto", "on", "off")
MIN_SPEEDUP = 1.1  # below this a compiled forward is not worth its compile time and its risk
OPTIMISTIC_SPEEDUP = 2.0  # the best measured gain (bf16, short rows, AMX): a job that cannot pay back a
# cold compile even at this speed-up is not worth a trial
TRIAL_SHAPES = ((64, 32), (16, 128))  # rows × length of the trial batches: short rows, where the gain is
TRIAL_REPEATS = 3  # timed forwards per shape, best taken


@dataclass(frozen=True)
class CompileVerdict:
    """What a trial measured for one model, job, device and dtype."""

    speedup: float  # eager seconds / compiled seconds over the trial shapes
    agrees: bool  # the compiled outputs pass the job's strict agreement test against eager
    agreement: str  # how closely, in words
    eager_tokens_per_s: float  # padded tokens per second of the eager forward on the trial shapes
    compile_s: float  # seconds the first compiled call took when the verdict was measured


@dataclass(frozen=True)
class CompileChoice:
    """Whether this run's forward is compiled, and why."""

    compiled: bool
    reason: str
    compile_s: float = 0.0  # seconds spent compiling in this process (0 when eager)
    graphs_before: int = 0  # graphs dynamo had compiled in this process before this model's

    def graphs(self) -> int:
        """Graphs this model's compiled forward has run on so far (one per recompile after the first)."""
        return compiled_graphs() - self.graphs_before if self.compiled else 0


def job_pays_back(job_tokens: float | None, eager_tokens_per_s: float, speedup: float, compile_s: float) -> bool:
    """Whether compiling saves more forward time than it costs. An unknown job size (a sweep, a
    service) counts as large: those run long enough."""
    if job_tokens is None:
        return True
    if eager_tokens_per_s <= 0 or speedup <= 1.0:
        return False
    forward_s = job_tokens / eager_tokens_per_s
    return forward_s * (1.0 - 1.0 / speedup) > compile_s


def pick_compile(setting: str, verdict: CompileVerdict | None, job_tokens: float | None,
                 expected_compile_s: float) -> tuple[bool, str]:
    """(compile?, why) from the setting and what a trial measured (None: no trial yet)."""
    if setting == "off":
        return False, "eager: --compile off"
    if setting == "on":
        return True, "compiled: --compile on"
    if verdict is None:
        return False, "eager: no compile trial for this model, device and dtype"
    if not verdict.agrees:
        return False, f"eager: the compiled forward disagrees with eager ({verdict.agreement})"
    if verdict.speedup < MIN_SPEEDUP:
        return False, f"eager: compiled only {verdict.speedup:.2f}x as fast (needs {MIN_SPEEDUP}x)"
    if not job_pays_back(job_tokens, verdict.eager_tokens_per_s, verdict.speedup, expected_compile_s):
        return False, (f"eager: {job_tokens:,.0f} tokens are too few to pay back a {expected_compile_s:.0f} s "
                       f"compile at {verdict.speedup:.2f}x")
    return True, f"compiled: {verdict.speedup:.2f}x faster, {verdict.agreement}"


def worth_a_trial(job_tokens: float | None, eager_tokens_per_s: float, cold_compile_s: float) -> bool:
    """A trial compiles once (cold); worth it only if even the best measured gain could pay that back."""
    return job_tokens is not None and job_pays_back(job_tokens, eager_tokens_per_s, OPTIMISTIC_SPEEDUP,
                                                    cold_compile_s)


def inductor_cache_dir(cache: Path) -> Path:
    return cache / "inductor"


def use_inductor_cache(cache: Path) -> None:
    """Inductor's compiled kernels and FX graphs under the plan cache, so the next process (the
    next night) loads them instead of compiling again. A directory of the user's own wins;
    torch's default does not (torch writes it into the environment the first time it asks, which
    importing a model's code can do before this runs)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir(cache))


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def is_compiled(model) -> bool:
    """Whether `model` is torch.compile's wrapper. Its batches always get their attention mask:
    the no-padding fast path (mask None) would trace a second graph, a whole second compile."""
    return hasattr(model, "_orig_mod")


def compile_model(model):
    """`model` compiled with dynamic shapes (one graph for every bucket's rows × length, no
    recompile per shape) and frozen weights (inductor folds and prepacks them).

    Sizes are traced size-obliviously: torch otherwise compiles a separate graph the first
    time a batch of one row (or one token) comes, which costs a second compile inside the
    run (MiniLM-L6 on 2 cores: +22 s; 2 graphs → 1, outputs unchanged). Both settings are
    process-wide: they apply to what dynamo traces from here on."""
    import torch
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config

    inductor_config.freezing = True
    fx_config.backed_size_oblivious = True
    return torch.compile(model, dynamic=True)


def trial_batches(model, device, shapes=TRIAL_SHAPES):
    """Random token batches of `shapes`, half the rows padded to half length."""
    import torch

    generator = torch.Generator().manual_seed(0)
    vocab = getattr(model.config, "vocab_size", 1000)
    batches = []
    for rows, length in shapes:
        input_ids = torch.randint(1000 if vocab > 2000 else 1, vocab, (rows, length), generator=generator)
        attention_mask = torch.ones((rows, length), dtype=torch.long)
        attention_mask[rows // 2:, length // 2:] = 0
        batches.append((input_ids.to(device), attention_mask.to(device)))
    return batches


def time_forward(job, model, batches, device) -> tuple[float, list[dict]]:
    """(seconds of the best of TRIAL_REPEATS forwards, summed over the batches; each batch's outputs)."""
    import torch

    seconds, outputs = 0.0, []
    with torch.inference_mode():
        for input_ids, attention_mask in batches:
            outputs.append(job.forward(model, input_ids, attention_mask))
            best = float("inf")
            for _ in range(TRIAL_REPEATS):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                started = time.perf_counter()
                job.forward(model, input_ids, attention_mask)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                best = min(best, time.perf_counter() - started)
            seconds += best
    return seconds, outputs


def first_call_s(job, model, batches) -> float:
    """Seconds of the first compiled call (the compile itself, or its cache load)."""
    import torch

    started = time.perf_counter()
    with torch.inference_mode():
        job.forward(model, *batches[0])
    return time.perf_counter() - started


def eager_tokens_per_s(job, model, device) -> float:
    """Padded tokens per second of the eager forward on the trial shapes (a second or two)."""
    batches = trial_batches(model, device)
    seconds, _ = time_forward(job, model, batches, device)
    return sum(ids.numel() for ids, _ in batches) / seconds


def compile_trial(job, model, device) -> tuple[CompileVerdict, object]:
    """Compile `model`, time it against eager on the trial shapes, check the job's strict
    agreement; the verdict and the compiled model (kept: the compile is already paid for)."""
    batches = trial_batches(model, device)
    eager_s, eager_outputs = time_forward(job, model, batches, device)
    compiled = compile_model(model)
    compile_s = first_call_s(job, compiled, batches)
    compiled_s, compiled_outputs = time_forward(job, compiled, batches, device)
    agrees, agreement = True, ""
    for reference, candidate in zip(eager_outputs, compiled_outputs):
        agrees_here, agreement = job.agreement(reference, candidate, strict=True)
        agrees = agrees and agrees_here
        if not agrees:
            break
    tokens = sum(ids.numel() for ids, _ in batches)
    verdict = CompileVerdict(speedup=eager_s / compiled_s, agrees=agrees, agreement=agreement,
                             eager_tokens_per_s=tokens / eager_s, compile_s=compile_s)
    return verdict, compiled
