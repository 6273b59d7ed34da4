"""`--compile auto|on|off`, the step of loading the model (`runtime/model.py`) that settles whether
the forward runs compiled: a cached verdict of a compile trial on this model, job, device and dtype,
a trial where none is cached and the job's work could pay a compile back (`core/compile.py` decides)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.core.cache import cache_dir, plan_cache_key, read_keyed, write_keyed
from pipeline.core.compile import CompileChoice, CompileVerdict, pick_compile, use_inductor_cache, worth_a_trial
from pipeline.core.compiled_forward import compile_model, compile_trial, eager_tokens_per_s
from pipeline.core.device import dtype_name
from pipeline.core.settings import BatchSettings, CacheSettings, ModelSettings

if TYPE_CHECKING:
    from pipeline.runtime.choice import ModelChoice


FASTEST_EAGER_TOKENS_PER_S = 50_000.0  # MiniLM's eager bf16 forward on AMX at its best: a job too small even
# at this speed is decided without timing anything
COLD_COMPILE_S = 30.0  # a first compile of a MiniLM-sized encoder on a 2-core CPU (19-47 s measured); a trial
# is worth running only for a job that could pay this back; once a device has compiled, its own seconds
# (`device_compile_seconds`)


def device_compile_seconds(cache: Path, device_key: str) -> tuple[float, Path, dict]:
    """(seconds of the last cold compile measured on this device, else COLD_COMPILE_S; where it
    is kept; its key): what a trial's pay-back is judged by before this model has a verdict."""
    key, name = plan_cache_key(kind="compile-seconds", device=device_key)
    path = cache / f"compile-seconds-{name}.json"
    record = read_keyed(path, key)
    return (record["compile_s"] if record else COLD_COMPILE_S), path, key


def compile_trial_shapes(batch: BatchSettings, device, model_config, max_length: int) -> tuple:
    """The trial's shapes from the run's batch limits as set, else the device's defaults (a
    sweep's recommendation and the memory plan are settled after the model loads)."""
    from pipeline.core.compile import trial_shapes
    from pipeline.core.settings import MAX_BATCH_ROWS, device_batch_limit

    tokens = batch.max_batch_tokens or device_batch_limit(device.type, "max_batch_tokens",
                                                                               model_config)
    rows = batch.max_batch_rows or device_batch_limit(device.type, "max_batch_rows")
    return trial_shapes(device.type, tokens, min(rows, MAX_BATCH_ROWS), max_length)


def settle_compile(settings: ModelSettings, batch: BatchSettings, cache: CacheSettings, choice: ModelChoice,
                   job, model,
                   job_tokens: float | None):
    """(the model that runs, why): eager or compiled, by `settings.compile` and, for `auto`, the
    cached verdict of a compile trial on this model, job, device and dtype (a trial runs when
    there is none and the job is large enough to pay a compile back)."""
    setting = settings.compile
    folder = cache_dir(cache.plan_cache)
    key, name = compile_verdict_key(settings, choice)
    path = folder / f"compile-{name}.json"
    record = read_keyed(path, key) if setting != "off" else None
    verdict = CompileVerdict(**{f: record[f] for f in CompileVerdict.__dataclass_fields__}) if record else None
    if setting == "off":
        return model, CompileChoice(False, "eager: --compile off")
    if settings.unpad == "on":  # --compile on with it is refused in choose_model
        return model, CompileChoice(False, "eager: --unpad on (a compiled forward runs padded)")
    use_inductor_cache(folder)
    package = compiled_package_path(folder, settings, choice)
    if setting == "auto" and verdict is None and job_tokens is not None:
        compile_s, seconds_path, seconds_key = device_compile_seconds(folder, choice.device_key)
        too_few = f"eager: {job_tokens:,.0f} tokens are too few to try a compile ({compile_s:.0f} s on this device)"
        if not worth_a_trial(job_tokens, FASTEST_EAGER_TOKENS_PER_S, compile_s):
            return model, CompileChoice(False, too_few)  # not even worth timing the eager forward
        shapes = compile_trial_shapes(batch, choice.device, model.config, choice.max_length)
        try:
            if not worth_a_trial(job_tokens, eager_tokens_per_s(job, model, choice.device, shapes), compile_s):
                return model, CompileChoice(False, too_few)
            cold = not package.exists()
            verdict, compiled = compile_trial(job, model, choice.device, package, shapes)
        except Exception as error:  # noqa: BLE001 - out of memory, an op inductor lacks: eager is always safe
            return model, CompileChoice(False, f"eager: the compile trial failed ({type(error).__name__}: {error})")
        write_keyed(path, key, {**dataclasses.asdict(verdict), "last_compile_s": verdict.compile_s})
        if cold:
            write_keyed(seconds_path, seconds_key, {"compile_s": verdict.compile_s})
        use, reason = pick_compile(setting, verdict, job_tokens, expected_compile_s=0.0)  # already compiled
        if not use:
            return model, CompileChoice(False, reason)
        return compiled, CompileChoice(True, reason, verdict.compile_s)
    loads = package.exists()  # a package compiled before: loading it costs under a second, not a compile
    if loads:
        expected = record.get("last_load_s", PACKAGE_LOAD_S) if record else PACKAGE_LOAD_S
    else:
        expected = record.get("last_compile_s", verdict.compile_s) if record else COLD_COMPILE_S
    use, reason = pick_compile(setting, verdict, job_tokens, expected)
    if not use:
        return model, CompileChoice(False, reason)
    compiled, compile_s = compile_model(job, model, choice.device, package)
    if record:
        write_keyed(path, key, {**record, "last_load_s" if loads else "last_compile_s": compile_s})
    if not loads:
        _, seconds_path, seconds_key = device_compile_seconds(folder, choice.device_key)
        write_keyed(seconds_path, seconds_key, {"compile_s": compile_s})
    return compiled, CompileChoice(True, reason, compile_s)


def compile_verdict_key(settings: ModelSettings, choice: ModelChoice) -> tuple[dict, str]:
    """What a compile verdict holds for: its agreement test ran on this model's content, job,
    device, dtype and attention."""
    return plan_cache_key(kind="compile", model=choice.content_hash,
                          job=settings.job, device=choice.device_key, dtype=dtype_name(choice.dtype),
                          attention=choice.attention)


PACKAGE_LOAD_S = 1.0  # loading a compiled package (MiniLM: 0.1-0.6 s)


def compiled_package_path(cache: Path, settings: ModelSettings, choice: ModelChoice) -> Path:
    """Where the compiled package of this model, job, device and dtype lives: keyed by the
    weights' content (they are folded into it) and what the job builds around them."""
    key, name = plan_cache_key(kind="package", model=choice.content_hash,
                               job=settings.job, device=choice.device_key, dtype=dtype_name(choice.dtype),
                               attention=choice.attention, prompt=choice.prompt, **choice.job_options)
    return cache / "compiled" / f"{name}.pt2"
