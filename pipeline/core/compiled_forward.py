"""The compiled forward (torch side of `compile.py`): the job's call to its model exported and
compiled ahead of time into an AOTInductor package under the plan cache, the trial that times
it against eager, and the wrapper the rest of the pipeline runs."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from pipeline.core.compile import CPU_TRIAL_SHAPES, CompileVerdict
from pipeline.core.settings import MAX_BATCH_ROWS

log = logging.getLogger(__name__)

TRIAL_REPEATS = 3  # timed forwards per shape, best taken
EXAMPLE_ROWS, EXAMPLE_LENGTH = 3, 17  # the example batch the forward is exported with: sizes no fixed dim of a
# model's inputs has, so every input dim of one of these sizes is the batch's rows or length, marked dynamic


class _Delegating(torch.nn.Module):
    """A wrapper that answers what the jobs and the probe read (config, parameters, a job's own
    attributes such as `embedding_width`) from the eager model it holds."""

    def __init__(self, eager: torch.nn.Module):
        super().__init__()
        self.eager = eager
        self.config = eager.config

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("eager"), name)


class _CallRecorder(_Delegating):
    """Runs the eager model and keeps the arguments of the last call: how the job calls its model."""

    call: tuple | None = None

    def forward(self, *args, **kwargs):
        self.call = (args, kwargs)
        return self.eager(*args, **kwargs)


class CompiledModel(_Delegating):
    """The eager model's attributes, with its forward run by an AOTInductor package (`package`)."""

    def __init__(self, eager: torch.nn.Module, runner, package: Path):
        super().__init__(eager)
        self.runner, self.package = runner, package

    def forward(self, *args, **kwargs):
        return self.runner(*args, **kwargs)


def is_compiled(model) -> bool:
    """Whether `model`'s forward runs compiled. Its batches always get their attention mask
    (`jobs.base.model_attention_mask`): the package was exported with one, and the no-padding
    fast path (mask None) would not match it."""
    return isinstance(model, CompiledModel)


def export_call(job, model, device) -> tuple[tuple, dict, dict]:
    """(args, kwargs, dynamic shapes by argument name) of the call the job makes to its model,
    recorded on an example batch: each input dim of the example's rows or length is dynamic."""
    import inspect

    from torch.export import Dim

    recorder = _CallRecorder(model)
    (input_ids, attention_mask), = trial_batches(model, device, shapes=((EXAMPLE_ROWS, EXAMPLE_LENGTH),))
    with torch.inference_mode():
        job.forward(recorder, input_ids, attention_mask, True)
    args, kwargs = recorder.call
    positions = getattr(model.config, "max_position_embeddings", None)
    rows = Dim("rows", min=1, max=MAX_BATCH_ROWS)  # batches never hold more (`resolve_batch_setting`)
    length = Dim("length", min=1, max=positions) if positions else Dim("length", min=1)
    sizes = {EXAMPLE_ROWS: rows, EXAMPLE_LENGTH: length}

    def dims(value):
        if not isinstance(value, torch.Tensor):
            return None
        return {i: sizes[size] for i, size in enumerate(value.shape) if size in sizes} or None

    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    return args, kwargs, {name: dims(value) for name, value in bound.items()}


def compile_model(job, model, device, package: Path) -> tuple[CompiledModel, float]:
    """(`model` compiled ahead of time, seconds it took): the package at `package` is loaded if
    it is there and loads (a second night: under a second), else the job's call to the model is exported
    with dynamic rows and length (one graph for every bucket's shape: no recompile) and
    compiled by AOTInductor with frozen weights (folded and prepacked as constants), then
    written there for the next process. Frozen weights are why the package is keyed by the
    weights' content, and why a package beats `torch.compile`: with freezing, inductor
    bypasses its own FX-graph and AOT caches, so a warm `torch.compile` took 20 s here."""
    import torch._inductor

    started = time.perf_counter()
    runner = load_package(package) if package.exists() else None
    if runner is None:
        args, kwargs, dynamic_shapes = export_call(job, model, device)
        with torch.no_grad():
            program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes)
        package.parent.mkdir(parents=True, exist_ok=True)
        temporary = package.with_name(f"{package.name}.{os.getpid()}.tmp.pt2")
        torch._inductor.aoti_compile_and_package(program, package_path=str(temporary),
                                                 inductor_configs={"freezing": True})
        os.replace(temporary, package)  # whole or not at all, for another process compiling the same
        runner = torch._inductor.aoti_load_package(str(package))
    return CompiledModel(model, runner, package), time.perf_counter() - started


def load_package(package: Path):
    """The runner of a compiled package; None (and the file removed) if it does not load: cut
    short or damaged outside lengthwise, it is compiled anew."""
    import torch._inductor

    try:
        return torch._inductor.aoti_load_package(str(package))
    except Exception as error:  # noqa: BLE001 - whatever is wrong with the file, compiling again mends it
        log.warning(f"the compiled package {package} does not load ({type(error).__name__}: {error}); "
                    "compiling it again")
        package.unlink(missing_ok=True)
        return None


def trial_batches(model, device, shapes=CPU_TRIAL_SHAPES):
    """Random token batches of `shapes`, half the rows padded to half length."""
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


def eager_tokens_per_s(job, model, device, shapes=CPU_TRIAL_SHAPES) -> float:
    """Padded tokens per second of the eager forward on the trial shapes (a second or two)."""
    batches = trial_batches(model, device, shapes)
    seconds, _ = time_forward(job, model, batches, device)
    return sum(ids.numel() for ids, _ in batches) / seconds


def compile_trial(job, model, device, package: Path,
                  shapes=CPU_TRIAL_SHAPES) -> tuple[CompileVerdict, CompiledModel]:
    """Compile `model` (`compile_model`), time it against eager on the trial shapes, check the
    job's strict agreement; the verdict and the compiled model (kept: the compile is paid for)."""
    batches = trial_batches(model, device, shapes)
    eager_s, eager_outputs = time_forward(job, model, batches, device)
    compiled, compile_s = compile_model(job, model, device, package)
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
