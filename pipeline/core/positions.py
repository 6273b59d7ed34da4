"""How many tokens a model takes, read off its architecture.

BERT-like models take `max_position_embeddings` tokens. RoBERTa, XLM-R, CamemBERT, MPNet,
Longformer, ESM and the other families whose embeddings count positions from
`pad_token_id + 1` (transformers' `create_position_ids_from_input_ids`) take
`max_position_embeddings - pad_token_id - 1`: a 514-position RoBERTa takes 512, and a 513-token
row indexes past its position table mid-run. The offset is read from the loaded embedding
module (its position table's padding index), not from a list of model types: MPNet hard-codes
its padding index whatever the config says.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from pipeline.core.errors import UsageError

POSITION_IDS_FROM_PADDING = "create_position_ids_from_input_ids"  # transformers' name for the offset count


@dataclass(frozen=True)
class PositionLimit:
    """The longest row a model takes, and where that comes from."""

    tokens: int
    positions: int  # rows of the position table (max_position_embeddings)
    padding_idx: int | None = None  # the offset families' padding index: positions start at padding_idx + 1

    def describe(self) -> str:
        if self.padding_idx is None:
            return f"{self.positions} positions"
        return (f"{self.positions} positions, counted from its padding index {self.padding_idx} + 1, "
                f"so {self.tokens} tokens")


def offset_position_limit(positions: int, padding_idx: int) -> int:
    """Tokens a table of `positions` takes when position ids start at `padding_idx + 1`."""
    return positions - padding_idx - 1


def counts_positions_from_padding(embeddings) -> bool:
    """Whether an embeddings module numbers positions from its padding index + 1: its class, or
    the transformers module that defines it, has `create_position_ids_from_input_ids`."""
    code = sys.modules.get(type(embeddings).__module__)
    return hasattr(type(embeddings), POSITION_IDS_FROM_PADDING) or hasattr(code, POSITION_IDS_FROM_PADDING)


def position_limit(model) -> PositionLimit | None:
    """The model's limit: from an offset family's position table, else `max_position_embeddings`;
    None when the model has neither (rotary or relative positions with no fixed table)."""
    import torch

    for module in model.modules():
        table = getattr(module, "position_embeddings", None)
        if isinstance(table, torch.nn.Embedding) and table.padding_idx is not None \
                and counts_positions_from_padding(module):
            return PositionLimit(offset_position_limit(table.num_embeddings, table.padding_idx),
                                 table.num_embeddings, table.padding_idx)
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return PositionLimit(positions, positions) if positions else None


def position_limit_of_config(model_config, trust_remote_code: bool = False) -> PositionLimit | None:
    """`position_limit` of the architecture `model_config` describes, built on the meta device
    (no weights read, no memory used): for a driver that checks before any worker loads the model."""
    import torch
    import transformers

    try:
        with torch.device("meta"):
            model = transformers.AutoModel.from_config(model_config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - an architecture AutoModel cannot build: the config's count, checked as before
        positions = getattr(model_config, "max_position_embeddings", None)
        return PositionLimit(positions, positions) if positions else None
    return position_limit(model)


def check_folder_max_length(model_path: str, max_length: int, trust_remote_code: bool = False) -> None:
    """`check_max_length` from the folder's config alone, before the dtype trial and the output
    check: a refusal costs no work. A config only the model's remote code can read is checked
    once the model is loaded."""
    import transformers

    try:
        model_config = transformers.AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return
    check_max_length(position_limit_of_config(model_config, trust_remote_code), max_length, model_config.model_type)


def check_max_length(limit: PositionLimit | None, max_length: int, model_type: str) -> None:
    """Refuse a --max-length longer than the model takes, naming the real limit."""
    if limit is not None and max_length > limit.tokens:
        raise UsageError(f"--max-length {max_length} is more than the {limit.tokens} tokens this {model_type} "
                         f"model takes "
                         f"({limit.describe()}); set --max-length {limit.tokens} or less")
