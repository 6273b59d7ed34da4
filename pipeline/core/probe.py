"""The memory probe: measure peak memory of real forwards on the device, fit it, and settle (or
read from the cache) the plan of rows per length bucket."""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import asdict
from pathlib import Path

from pipeline.core.cache import cache_dir, model_memory_fingerprint, plan_cache_key, read_keyed, write_keyed
from pipeline.core.errors import UsageError
from pipeline.core.settings import BatchSettings, CacheSettings
from pipeline.core.units import format_bytes
from pipeline.core.memory import (
    FIT_LENGTH_FRACTIONS,
    PROBE_ROUNDS,
    MemoryPlan,
    PeakMeasurement,
    fit_memory_model,
    fit_rows,
    memory_bucket_lengths,
    plan_buckets,
    plan_for_budget,
)

log = logging.getLogger(__name__)


def forward_peak_bytes(job, model, device, rows: int, length: int, since_bytes: int | None = None) -> float:
    """Peak bytes of one forward pass of `rows` × `length` (on the CPU above `since_bytes`, see
    `measure_peak_bytes`); infinite if it ran out of memory. Every row has a padded position, as
    real batches do, so attention takes the same (masked) kernel."""
    import torch

    from pipeline.core.device import is_out_of_memory, measure_peak_bytes, release_cached_memory

    vocab_size = getattr(model.config, "vocab_size", 1000)
    input_ids = torch.randint(0, vocab_size, (rows, length), device=device)  # ids do not change memory
    attention_mask = torch.ones((rows, length), dtype=torch.long, device=device)
    if length > 1:
        attention_mask[:, -1] = 0

    def forward() -> None:
        try:
            with torch.inference_mode():
                job.forward(model, input_ids, attention_mask)
        except Exception as error:
            if is_out_of_memory(error):
                raise
            raise UsageError(probe_failure(rows, length, error)) from error

    try:
        return measure_peak_bytes(forward, device, since_bytes)
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        release_cached_memory(device, error)
    return math.inf


def probe_failure(rows: int, length: int, error: BaseException) -> str:
    """One line for a probe forward that failed other than by running out of memory: every batch
    of the run would fail the same way, so the run stops before any work (exit 2)."""
    cause = str(error).strip().splitlines()[0] if str(error).strip() else "no message"
    return (f"the memory probe's forward of {rows} rows × {length} tokens failed with {type(error).__name__}: "
            f"{cause}; every batch this long would fail the same way: check --max-length, --dtype and --model")


KEPT_BLOCKS = 1  # a large CPU check runs through the first block, plus one hidden state (check_through_first_blocks)


def repeated_blocks(model) -> tuple[object, str, object] | None:
    """(parent module, attribute, the list) of the model's stack of identical blocks (an
    encoder's layers): the ModuleList of more than KEPT_BLOCKS modules of one class holding the
    most parameters; None if the model has no such stack."""
    import torch

    best, best_parameters = None, 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > KEPT_BLOCKS and \
                len({type(block) for block in module}) == 1:
            parameters = sum(p.numel() for p in module.parameters())
            if parameters > best_parameters:
                parent, _, attribute = name.rpartition(".")
                best, best_parameters = (model.get_submodule(parent), attribute, module), parameters
    return best


@contextlib.contextmanager
def first_blocks(stack: tuple[object, str, object]):
    """The model runs through only its first KEPT_BLOCKS blocks inside the block; restored after."""
    import torch

    parent, attribute, blocks = stack
    setattr(parent, attribute, torch.nn.ModuleList(list(blocks)[:KEPT_BLOCKS]))
    try:
        yield
    finally:
        setattr(parent, attribute, blocks)


def check_through_first_blocks(device_type: str, compiled: bool, blocks: int, rows: int, length: int,
                               hidden_size: int, element_bytes: int, mmap_threshold_bytes: int) -> bool:
    """Whether a full-size check may run through the first KEPT_BLOCKS blocks only, its peak
    counted one hidden state higher (`shortened_check_bytes`).

    An encoder's activations are freed block by block, so every block peaks at the same
    working set plus what is held across it: its input and the embedding output, which the
    model keeps referenced throughout. In the first block the two are one tensor; from the
    second on they are two, so the first block plus one hidden state peaks as high as all of
    them, at a fraction of the time (MiniLM-L6, fp32: 393×128 814 vs 821 MiB through six
    blocks, 2.7 s instead of 13.3; 512×256 2,121 vs 2,123 MiB; a model that does not keep the
    embedding output is over-counted by one hidden state, the safe side). That holds where
    the hidden states are large enough for glibc to map them on their own
    (`mmap_threshold_bytes`); smaller ones come from the heap, whose fragmentation grows with
    each block (64×128: 192 MiB through two blocks, 229-240 through six), and such checks are
    cheap to run whole. CPU only (a GPU runs the checks in moments), and never on a compiled
    forward, whose graph is the whole model."""
    return (device_type == "cpu" and not compiled and blocks > KEPT_BLOCKS
            and hidden_state_bytes(rows, length, hidden_size, element_bytes) >= mmap_threshold_bytes)


def hidden_state_bytes(rows: int, length: int, hidden_size: int, element_bytes: int) -> int:
    return rows * length * hidden_size * element_bytes


def shortened_check_bytes(peak_bytes: float, rows: int, length: int, hidden_size: int, element_bytes: int) -> float:
    """The whole model's peak from a check through the first KEPT_BLOCKS blocks: one hidden
    state more, the one later blocks hold besides their input (check_through_first_blocks)."""
    return peak_bytes + hidden_state_bytes(rows, length, hidden_size, element_bytes)


def probe_memory_plan(job, model, device, available_bytes: int, safety: float, max_length: int,
                      max_batch_rows: int, max_batch_tokens: int | None) -> MemoryPlan:
    """Fit the memory model from small forward passes of `model`, then check the buckets
    (`plan_buckets`), large CPU checks through the first blocks only (`check_through_first_blocks`)."""
    import time

    from pipeline.core.compiled_forward import is_compiled
    from pipeline.core.device import HOST_MMAP_THRESHOLD_BYTES, dtype_name, garbage_frozen, resident_bytes

    with garbage_frozen(device):
        started = time.perf_counter()
        compiled = is_compiled(model)
        stack = repeated_blocks(model)
        hidden_size = getattr(model.config, "hidden_size", 0)
        element_bytes = next(model.parameters()).element_size()
        shortened = []
        # CPU: forwards keep buffers (kernel and thread caches; for MiniLM they grow to 56 MiB over the fitting
        # grid, then stay) that a fresh process pays in its first batches; full-size checks count from before the
        # first forward, the fitting grid per call (their growth would steepen the fit) plus what was kept by its end
        since = resident_bytes() if device.type == "cpu" else None

        def measure(rows: int, length: int, since_bytes: int | None = since) -> float:
            if stack and check_through_first_blocks(device.type, compiled, len(stack[2]), rows, length, hidden_size,
                                                    element_bytes, HOST_MMAP_THRESHOLD_BYTES):
                shortened.append((rows, length))
                with first_blocks(stack):
                    peak = forward_peak_bytes(job, model, device, rows, length, since_bytes)
                return shortened_check_bytes(peak, rows, length, hidden_size, element_bytes)
            return forward_peak_bytes(job, model, device, rows, length, since_bytes)

        measure(1, min(8, max_length), None)  # the first call's one-off costs (CUDA workspaces) stay out of the fit
        fit_lengths = sorted({max(1, int(max_length * f)) for f in FIT_LENGTH_FRACTIONS})
        grid_rows = fit_rows(device.type, fit_lengths[0], max_length, hidden_size, element_bytes, max_batch_tokens)
        measurements = [PeakMeasurement(rows, length, measure(rows, length, None))
                        for rows in grid_rows for length in fit_lengths]
        if any(math.isinf(m.peak_bytes) for m in measurements):
            raise ValueError(f"even the fitting batches ({max(grid_rows)} rows × {max_length} tokens) run out of "
                             f"memory on {device}; lower --max-length")
        kept = max(0, resident_bytes() - since) if since is not None else 0
        measurements = [PeakMeasurement(m.rows, m.length, m.peak_bytes + kept) for m in measurements]
        if kept:
            log.info(f"memory probe: forwards keep {format_bytes(kept)} of caches, counted in every batch's peak")
        coefficients = fit_memory_model(measurements)
        buckets = plan_buckets(coefficients, available_bytes, safety, memory_bucket_lengths(max_length),
                               max_batch_rows, max_batch_tokens, measure, 1 if device.type == "cuda" else PROBE_ROUNDS,
                               measurements)
        if shortened:
            log.info(f"memory probe: {len(shortened)} large check(s) ran through {KEPT_BLOCKS} of "
                     f"{len(stack[2])} blocks, counted one hidden state higher (see check_through_first_blocks)")
        return MemoryPlan(available_bytes, safety, coefficients, buckets, str(device),
                          dtype_name(next(model.parameters()).dtype),
                          round(time.perf_counter() - started, 2))


def load_cached_plan(path: Path, key: dict) -> MemoryPlan | None:
    record = read_keyed(path, key)
    try:
        plan = MemoryPlan.from_dict(record) if record else None
    except (ValueError, TypeError, KeyError):
        return None  # unreadable: probe again
    if plan is not None:
        plan.source = str(path)
    return plan


def memory_plan_for(batch: BatchSettings, cache: CacheSettings, job_name: str, max_length: int, job, model, model_path: str,
                    device) -> MemoryPlan | None:
    """The memory plan for `batch` (its limits resolved) at `max_length`: from the plan cache (made
    for this budget or scaled to it), else probed on the device and cached. Logs which."""
    from pipeline.core.device import available_memory_bytes, device_name, dtype_name

    available = available_memory_bytes(device, batch.memory_budget, batch.memory_reserve)
    if available <= 0:
        raise UsageError(f"no memory left for batches on {device} ({available} bytes); "
                         "lower --memory-reserve or set --memory-budget")
    dtype = dtype_name(next(model.parameters()).dtype)
    # not the budget: a plan made for a larger one is scaled down, one for a little less is reused (plan_for_budget)
    key, name = plan_cache_key(model=model_memory_fingerprint(model_path), job=job_name,
                               device=device_name(device), dtype=dtype, max_length=max_length,
                               safety=batch.safety, attention=getattr(model.config, "_attn_implementation", None),
                               max_batch_tokens=batch.max_batch_tokens, max_batch_rows=batch.max_batch_rows,
                               # the unpadded forward holds other temporaries (packed and re-padded states);
                               # a padded forward's plans keep the key they had before --unpad
                               **({"forward": "unpadded"} if getattr(model, "unpadded", None) is not None else {}))
    path = cache_dir(cache.plan_cache) / f"{name}.json"
    cached = load_cached_plan(path, key) if cache.use_plan_cache else None
    plan = plan_for_budget(cached, available) if cached else None
    if plan is None:
        try:
            plan = probe_memory_plan(job, model, device, available, batch.safety, max_length,
                                     batch.max_batch_rows, batch.max_batch_tokens)
        except (ValueError, RuntimeError) as error:
            if batch.max_batch_tokens is None:
                raise UsageError(f"the memory probe failed ({error}); give --max-batch-tokens a number") from error
            log.warning(f"batch plan: the memory probe failed ({error}); using --max-batch-tokens and "
                        "--max-batch-rows only")
            return None
        plan.key = key
        if cache.use_plan_cache:
            plan.source = f"probed in {plan.probe_s:.1f}s, cached at {write_keyed(path, key, asdict(plan))}"
        else:
            plan.source = f"probed in {plan.probe_s:.1f}s (plan cache off)"
    else:
        plan.source = f"from cache {plan.source}"
    log.info(f"batch plan: {plan.source}")
    return plan


NO_MEMORY_PLAN = "token and row limits only (no memory plan)"  # a run's batch plan without the probe


def describe_plan(plan: MemoryPlan | None) -> str:
    if plan is None:
        return NO_MEMORY_PLAN
    rows = ", ".join(f"≤{b.length}: {b.probed_rows}" for b in plan.buckets)
    return f"{plan.source}; rows per padded length {rows}"
