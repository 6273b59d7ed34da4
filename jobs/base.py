"""The contract between the pipeline and a job: what the model is and what it outputs.

A job loads a model, runs one padded batch through it, and turns per-row numpy outputs
into Arrow columns. It never reads input files, batches rows or writes output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import torch
import transformers

from pipeline.errors import UsageError


class Job(Protocol):
    name: str

    def load(self, model_path: str, device: torch.device, dtype: torch.dtype, prompt_tokens: int = 0,
             **loading) -> torch.nn.Module:
        """The model, in eval mode, on `device` in `dtype`; `prompt_tokens` leading tokens of
        every row are the run's prompt (a job may leave them out of its output); `loading` goes
        to load_pretrained (allow_pickle, trust_remote_code)."""

    def forward(self, model: torch.nn.Module, input_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-row float32 outputs of one batch, each shaped (rows, …)."""

    def agreement(self, reference: dict[str, torch.Tensor], candidate: dict[str, torch.Tensor]) -> tuple[bool, str]:
        """Whether `candidate` (the same batch in another dtype) is as good as `reference`, and how close."""

    def output_schema(self, model: torch.nn.Module) -> pa.Schema:
        """The job's output columns (the pipeline adds id, truncated and error)."""

    def to_columns(self, model: torch.nn.Module, outputs: dict[str, np.ndarray],
                   valid: np.ndarray) -> dict[str, pa.Array]:
        """Arrow columns from stacked outputs; rows where `valid` is False are null."""


def load_pretrained(auto_class, model_path: str, device: torch.device, dtype: torch.dtype,
                    may_be_missing: tuple[str, ...] = (), allow_pickle: bool = False,
                    trust_remote_code: bool = False) -> torch.nn.Module:
    """from_pretrained, moved to the device, in eval mode; safetensors weights only unless
    `allow_pickle` (a pickle checkpoint can run code when it is loaded).

    Weights the checkpoint lacks would be random, so their outputs meaningless: refused,
    except those named by `may_be_missing` prefixes (parts the job never uses).
    """
    transformers.utils.logging.disable_progress_bar()  # lengthwise has its own progress bar
    folder = Path(model_path)
    if not allow_pickle and not any(folder.glob("*.safetensors")):
        pickles = sorted(p.name for p in folder.glob("*.bin"))
        raise UsageError(f"{model_path} has no safetensors weights" + (
            f", only pickle checkpoints ({', '.join(pickles)}), which can run code when loaded; convert them "
            "to safetensors or pass --allow-pickle if you trust their source" if pickles else "; set --model"))
    try:
        model, info = auto_class.from_pretrained(model_path, dtype=dtype, use_safetensors=None if allow_pickle
                                                 else True, trust_remote_code=trust_remote_code,
                                                 output_loading_info=True)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot load the model in {model_path}: {error}") from error
    missing = [key for key in info.get("missing_keys", []) if not key.startswith(may_be_missing)]
    if missing:
        raise UsageError(f"{model_path} has no trained weights for {', '.join(sorted(missing)[:4])}"
                         f"{' …' if len(missing) > 4 else ''}; is it the right --model for --job?")
    return model.to(device).eval()


def fixed_size_list(values: np.ndarray, valid: np.ndarray) -> pa.FixedSizeListArray:
    """(rows, width) float32 values as fixed_size_list<float32>[width], null where not valid."""
    rows, width = values.shape
    flat = pa.array(np.ascontiguousarray(values, dtype=np.float32).reshape(-1))
    return pa.FixedSizeListArray.from_arrays(flat, width, mask=pa.array(~valid))
