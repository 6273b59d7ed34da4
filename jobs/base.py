"""The contract between the pipeline and a job: what the model is and what it outputs.

A job loads a model, runs one padded batch through it, and turns per-row numpy outputs
into Arrow columns. It never reads input files, batches rows or writes output.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import pyarrow as pa
import torch
import transformers


class Job(Protocol):
    name: str

    def load(self, model_path: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
        """The model, in eval mode, on `device` in `dtype`."""

    def forward(self, model: torch.nn.Module, input_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-row float32 outputs of one batch, each shaped (rows, …)."""

    def output_schema(self, model: torch.nn.Module) -> pa.Schema:
        """The job's output columns (the pipeline adds id, truncated and error)."""

    def to_columns(self, model: torch.nn.Module, outputs: dict[str, np.ndarray],
                   valid: np.ndarray) -> dict[str, pa.Array]:
        """Arrow columns from stacked outputs; rows where `valid` is False are null."""


def load_pretrained(auto_class, model_path: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """from_pretrained from safetensors weights only, moved to the device, in eval mode."""
    transformers.utils.logging.disable_progress_bar()  # lengthwise has its own progress bar
    model = auto_class.from_pretrained(model_path, dtype=dtype, use_safetensors=True)
    return model.to(device).eval()


def fixed_size_list(values: np.ndarray, valid: np.ndarray) -> pa.FixedSizeListArray:
    """(rows, width) float32 values as fixed_size_list<float32>[width], null where not valid."""
    rows, width = values.shape
    flat = pa.array(np.ascontiguousarray(values, dtype=np.float32).reshape(-1))
    return pa.FixedSizeListArray.from_arrays(flat, width, mask=pa.array(~valid))
