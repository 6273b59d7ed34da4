"""Sentence embeddings: mean of the token states over the attention mask, L2-normalised.

This is what sentence-transformers does for all-MiniLM-L6-v2 (Pooling mean + Normalize),
so the vectors match `SentenceTransformer.encode` on the same model.
"""

from __future__ import annotations

import pyarrow as pa
import torch
from transformers import AutoModel

from jobs.base import fixed_size_list, load_pretrained


class EmbedJob:
    name = "embed"

    def load(self, model_path, device, dtype, **loading):
        return load_pretrained(AutoModel, model_path, device, dtype, may_be_missing=("pooler.",), **loading)

    def forward(self, model, input_ids, attention_mask):
        hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.float()
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        summed = (hidden * mask).sum(dim=1)
        mean = summed / mask.sum(dim=1).clamp(min=1e-9)
        return {"embedding": torch.nn.functional.normalize(mean, p=2, dim=1)}

    def output_schema(self, model):
        return pa.schema([("embedding", pa.list_(pa.float32(), model.config.hidden_size))])

    def to_columns(self, model, outputs, valid):
        return {"embedding": fixed_size_list(outputs["embedding"], valid)}
