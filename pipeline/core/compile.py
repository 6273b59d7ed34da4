"""A compiled forward, chosen like the dtype: by measurement, and only where it pays back.

Inductor with freezing (weights folded and prepacked as constants) runs MiniLM's short batches
up to ~2x faster in bf16 on an AMX CPU and not at all faster in others; a first compile takes
tens of seconds. It is compiled ahead of time into a package kept under the plan cache
(`compiled_forward.py`), which the next process loads in under a second. So `--compile auto` compiles
where a trial on this device and dtype measured it faster and its outputs agree with eager
(the job's strict test), and where the job is large enough that the time it saves beats the
compile: estimated forward seconds = job tokens / eager tokens per second (job tokens: rows
from the shards' footers × mean tokens of a tokenized sample), saved = that × (1 - 1/speedup).
The verdict and the package are cached beside the memory plans (docs/performance.md has the
figures).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


COMPILE_SETTINGS = ("auto", "on", "off")
MIN_SPEEDUP = 1.1  # below this a compiled forward is not worth its compile time and its risk
OPTIMISTIC_SPEEDUP = 2.0  # the best measured gain (bf16, short rows, AMX): a job that cannot pay back a
# cold compile even at this speed-up is not worth a trial


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
    compile_s: float = 0.0  # seconds spent compiling, or loading the compiled package, in this process (0 when eager)

    def graphs(self) -> int:
        """Graphs the forward runs on: a package holds one for every shape (it cannot recompile)."""
        return 1 if self.compiled else 0


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


CPU_TRIAL_SHAPES = ((64, 32), (16, 128))  # rows × length of the CPU trial batches: short rows, where the gain is
TRIAL_LENGTHS = (32, 128)  # the padded lengths a CUDA trial runs at, each with the run's own rows


def trial_shapes(device_type: str, max_batch_tokens: int, max_batch_rows: int, max_length: int) -> tuple:
    """Rows × length of the compile trial's batches. On the CPU, CPU_TRIAL_SHAPES (its batches
    are that small). On CUDA the run's own batches at TRIAL_LENGTHS: as many rows as its token
    budget and row limit give. A 2,048-token trial is launch-bound on a large GPU, where eager
    and compiled are timed on kernel launches, not on the batches the run will have."""
    if device_type != "cuda":
        return CPU_TRIAL_SHAPES
    lengths = sorted({min(length, max_length) for length in TRIAL_LENGTHS})
    return tuple((max(1, min(max_batch_rows, max_batch_tokens // length)), length) for length in lengths)


def inductor_cache_dir(cache: Path) -> Path:
    return cache / "inductor"


def use_inductor_cache(cache: Path) -> None:
    """Inductor's working files (kernels, a package's build) under the plan cache rather than in
    /tmp, where a compile leaves hundreds of MB. A directory of the user's own wins;
    torch's default does not (torch writes it into the environment the first time it asks, which
    importing a model's code can do before this runs)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir(cache))
