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

from pipeline.core.compiled_forward import is_compiled
from pipeline.core.errors import UsageError


class Job(Protocol):
    """Every member below is required. Optional hooks, looked up with hasattr/getattr where they are
    used: `options(settings, model_path) -> dict` (jobs/registry.py: output-changing settings, checked
    before anything runs, passed to `load`), `split_schema(model)` (offline/runner.py: columns
    --long-text split adds), `count_flagged(model, table)` (offline/runner.py: the summary's flag
    counts). docs/jobs.md lists them all."""

    name: str
    auto_class: type  # the transformers Auto class its model loads with
    inputs: tuple[str, ...]  # the row's named inputs: ("text",), or ("text", "pair") for a text and its pair

    def load(self, model_path: str, device: torch.device, dtype: torch.dtype, prompt_tokens: int = 0,
             **loading) -> torch.nn.Module:
        """The model, in eval mode, on `device` in `dtype`; `prompt_tokens` leading tokens of
        every row are the run's prompt (a job may leave them out of its output); `loading` goes
        to load_pretrained (allow_pickle, trust_remote_code)."""

    def forward(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                padded: bool = True, packing: tuple[torch.Tensor, torch.Tensor] | None = None,
                token_type_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Per-row float32 outputs of one batch, each shaped (rows, …); `padded` False says, from
        the host, that no row of the batch has padding (see `model_attention_mask`); `packing`: the
        batch's packed layout from the host, for the unpadded forward (`pipeline.core.unpadded.PackedBatch`);
        `token_type_ids`: a pair's token types, passed (as a keyword) only to a job whose `inputs` has a pair."""

    def agreement(self, reference: dict[str, torch.Tensor], candidate: dict[str, torch.Tensor],
                  strict: bool = False, model: torch.nn.Module | None = None) -> tuple[bool, str]:
        """Whether `candidate` (the same batch in another dtype, or `strict`ly: compiled in the
        same dtype) is as good as `reference`, and how close. `model` (the reference's) lets a
        job count what its outputs decide, such as `moderate`'s flags."""

    def output_schema(self, model: torch.nn.Module) -> pa.Schema:
        """The job's output columns (the pipeline adds id, truncated and error)."""

    def fold_segments(self, model: torch.nn.Module, outputs: dict[str, np.ndarray], starts: np.ndarray,
                      lengths: np.ndarray) -> dict[str, np.ndarray]:
        """--long-text split: one row's outputs from each group of its segments' (consecutive
        rows of `outputs`, groups beginning at `starts`; `lengths`: each segment's tokens). May add
        `best_segment` (row, label → which segment's output it took)."""

    def to_columns(self, model: torch.nn.Module, outputs: dict[str, np.ndarray],
                   valid: np.ndarray) -> dict[str, pa.Array]:
        """Arrow columns from stacked outputs; rows where `valid` is False are null."""


def attention_implementation(auto_class, model_path: str) -> str | None:
    """The attention kernel a model folder runs under this job: "sdpa" (torch's fused kernels)
    where the architecture supports it, else "eager"; None for a class transformers does not
    know (remote code decides for itself). Settled before loading, so the output fingerprint
    and the plan key can hold it: a model that silently fell back to eager attention would
    run slower and need other batch sizes."""
    try:
        config = transformers.AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError):  # a config only remote code can read: that code decides
        return None
    model_class = auto_class._model_mapping.get(type(config), None)
    if model_class is None:
        return None
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def load_pretrained(auto_class, model_path: str, device: torch.device, dtype: torch.dtype,
                    may_be_missing: tuple[str, ...] = (), allow_pickle: bool = False,
                    trust_remote_code: bool = False, attention: str | None = None) -> torch.nn.Module:
    """from_pretrained with `attention` as its attention implementation (None: the model's
    default), moved to the device, in eval mode; safetensors weights only unless
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
                                                 output_loading_info=True,
                                                 **({"attn_implementation": attention} if attention else {}))
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot load the model in {model_path}: {error}") from error
    missing = [key for key in info.get("missing_keys", []) if not key.startswith(may_be_missing)]
    if missing:
        raise UsageError(f"{model_path} has no trained weights for {', '.join(sorted(missing)[:4])}"
                         f"{' …' if len(missing) > 4 else ''}; is it the right --model for --job?")
    model = model.to(device).eval()
    model.takes_prepared_mask = takes_prepared_mask(model)
    return model


def prepared_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """The (rows, 1, 1, length) boolean mask SDPA takes, from a (rows, length) 0/1 mask."""
    return attention_mask.bool()[:, None, None, :]


def model_attention_mask(model: torch.nn.Module, attention_mask: torch.Tensor,
                         padded: bool = True) -> torch.Tensor | None:
    """The mask to give the transformer. None for a batch without padding (the host knows it
    from the collate): any mask rules out SDPA's flash kernel, and there is nothing to mask.
    Under SDPA, transformers checks `mask.all()` on every forward to see whether it may drop a
    2-D mask: a host-device sync per batch, which stalls the host until the GPU has finished all
    queued work. A prepared 4-D mask is used as it is, without that check, where
    `takes_prepared_mask` found it gives the same outputs. A compiled model always gets its mask:
    its package was exported with one."""
    if not padded and not is_compiled(model):
        return None
    return prepared_mask(attention_mask) if getattr(model, "takes_prepared_mask", False) else attention_mask


def attends_locally(config) -> bool:
    """Whether some layers of the model attend within a sliding window (ModernBERT's local
    attention, Mistral-style sliding windows). Their model code builds the window from the 2-D
    mask; handed a prepared 4-D mask, ModernBERT (transformers 5) uses it unchanged in those
    layers, which then attend globally."""
    layer_types = getattr(config, "layer_types", None) or ()
    return bool(getattr(config, "sliding_window", None) or getattr(config, "local_attention", None)
                or "sliding_attention" in layer_types)


def takes_prepared_mask(model: torch.nn.Module) -> bool:
    """Whether `model` under SDPA accepts a prepared 4-D mask and gives the same outputs as with
    the 2-D mask, on a two-row batch with padding (older model code rejects 4-D masks). Never for
    a model with sliding-window layers: an 8-token check cannot see a window that is not kept."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or attends_locally(model.config):
        return False
    device = next(model.parameters()).device
    input_ids = torch.full((2, 8), min(1000, model.config.vocab_size - 1), device=device)
    attention_mask = torch.ones((2, 8), dtype=torch.long, device=device)
    attention_mask[1, 5:] = 0
    try:
        with torch.inference_mode():
            plain = model(input_ids=input_ids, attention_mask=attention_mask)[0].float()
            prepared = model(input_ids=input_ids, attention_mask=prepared_mask(attention_mask))[0].float()
    except (RuntimeError, ValueError, TypeError, IndexError):
        return False
    kept = attention_mask.bool() if plain.dim() == 3 else torch.ones(plain.shape[0], dtype=torch.bool, device=device)
    tolerance = 1e-4 if next(model.parameters()).dtype == torch.float32 else 2e-2
    return plain.shape == prepared.shape and torch.allclose(plain[kept], prepared[kept], rtol=tolerance,
                                                            atol=tolerance)


def fixed_size_list(values: np.ndarray, valid: np.ndarray) -> pa.FixedSizeListArray:
    """(rows, width) float32 values as fixed_size_list<float32>[width], null where not valid."""
    rows, width = values.shape
    flat = pa.array(np.ascontiguousarray(values, dtype=np.float32).reshape(-1))
    return pa.FixedSizeListArray.from_arrays(flat, width, mask=pa.array(~valid))
