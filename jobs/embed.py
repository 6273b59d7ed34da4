"""Sentence embeddings, computed as `SentenceTransformer(folder).encode` computes them.

The model folder's sentence-transformers files (`jobs/sentence_transformers_folder.py`) say how token
states become one vector: CLS, mean, max, mean-sqrt-len, weighted-mean or last-token pooling
(several concatenated), then L2 normalisation or not. A plain Hugging Face folder gets mean
pooling + normalisation, as all-MiniLM-L6-v2 uses.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
from transformers import AutoModel

from jobs.base import fixed_size_list, load_pretrained, model_attention_mask
from jobs.sentence_transformers_folder import EmbeddingRecipe, read_embedding_recipe
from pipeline.core.segments import weighted_mean_per_group


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, recipe: EmbeddingRecipe,
         prompt_tokens: int = 0) -> torch.Tensor:
    """(rows, width × modes) float32 sentence vectors from right-padded (rows, length, width)
    states, pooled in the states' own dtype (sums as a masked matmul, which accumulates in
    float32 on the device) so that no float32 copy of all the states is made. The matmul's
    weights are divided by their total first: its result is stored in the states' dtype, and
    a float16 sum overflows at 65,504 (weighted-mean weights alone add up to 131,328 at 512
    tokens).

    `prompt_tokens` leading positions are left out of the pooling when the recipe excludes
    the prompt (sentence-transformers' `include_prompt: false`)."""
    mask = attention_mask.to(hidden.dtype)
    if prompt_tokens and not recipe.include_prompt:
        mask = mask.clone()
        mask[:, :prompt_tokens] = 0
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    vectors = []
    for mode in recipe.pooling:
        if mode == "cls":  # the first position the mask keeps
            vectors.append(hidden[rows, mask.argmax(dim=1)].float())
        elif mode == "max":
            vectors.append(hidden.masked_fill(mask.unsqueeze(-1) == 0, float("-inf")).max(dim=1).values.float())
        elif mode in ("mean", "mean_sqrt_len_tokens", "weightedmean"):
            weights = mask.float()
            if mode == "weightedmean":  # position i (from 1) weighs i
                weights = weights * torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=torch.float32)
            total = weights.sum(dim=1, keepdim=True).clamp(min=1e-9)
            # mean_sqrt_len_tokens divides the sum by √count, not count
            weights = weights / (total.sqrt() if mode == "mean_sqrt_len_tokens" else total)
            vectors.append(torch.bmm(weights.to(hidden.dtype).unsqueeze(1), hidden).squeeze(1).float())
        elif mode == "lasttoken":  # the last position the mask keeps (the last one if none)
            kept, offset = mask.flip(1).max(dim=1)
            last = torch.where(kept == 0, hidden.shape[1] - 1, hidden.shape[1] - 1 - offset)
            vectors.append((hidden[rows, last] * mask[rows, last].unsqueeze(-1)).float())
        else:  # read_embedding_recipe admits only the modes above
            raise ValueError(f"unknown pooling mode {mode!r}")
    pooled = torch.cat(vectors, dim=-1)
    return torch.nn.functional.normalize(pooled, p=2, dim=1) if recipe.normalize else pooled


class NoPooler(torch.nn.Module):
    """Stands in for a BERT-style pooler that sentence embeddings never use, so it does not run."""

    def forward(self, hidden_states: torch.Tensor) -> None:
        return None


class SentenceEmbedder(torch.nn.Module):
    """The folder's transformer with its pooling recipe: (ids, mask) → sentence vectors."""

    def __init__(self, encoder: torch.nn.Module, recipe: EmbeddingRecipe, prompt_tokens: int):
        super().__init__()
        self.encoder = encoder
        self.recipe = recipe
        self.prompt_tokens = prompt_tokens
        self.config = encoder.config  # what the memory plan and length checks read

    @property
    def embedding_width(self) -> int:
        return self.config.hidden_size * len(self.recipe.pooling)

    unpadded = None  # the encoder's unpadded forward, where `--unpad` settled on one (pipeline/core/unpadded.py)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, padded: bool = True,
                packing=None) -> torch.Tensor:
        if padded and self.unpadded is not None:
            hidden = self.unpadded.last_hidden_state(input_ids, attention_mask, packing)
        else:
            mask = model_attention_mask(self.encoder, attention_mask, padded)
            hidden = self.encoder(input_ids=input_ids, attention_mask=mask).last_hidden_state
        return pool(hidden, attention_mask, self.recipe, self.prompt_tokens)


MIN_COSINE = 0.999  # another dtype must keep every row's vector this close to float32's
MIN_COSINE_STRICT = 0.9999  # a compiled forward must keep it this close to eager's in the same dtype


class EmbedJob:
    name = "embed"
    auto_class = AutoModel
    inputs = ("text",)

    def load(self, model_path, device, dtype, prompt_tokens: int = 0, **loading):
        """`prompt_tokens`: how many leading tokens the run's prompt takes (for recipes that
        leave the prompt out of the pooling)."""
        recipe = read_embedding_recipe(model_path)
        encoder = load_pretrained(AutoModel, model_path, device, dtype, may_be_missing=("pooler.",), **loading)
        if getattr(encoder, "pooler", None) is not None:
            encoder.pooler = NoPooler()
        return SentenceEmbedder(encoder, recipe, prompt_tokens).eval()

    def forward(self, model, input_ids, attention_mask, padded: bool = True, packing=None):
        return {"embedding": model(input_ids, attention_mask, padded, packing)}

    def agreement(self, reference, candidate, strict: bool = False, model=None) -> tuple[bool, str]:
        """Whether `candidate` outputs are as good as `reference`: cosine ≥ MIN_COSINE on every row
        (MIN_COSINE_STRICT when `strict`)."""
        a, b = reference["embedding"].float(), candidate["embedding"].float()
        cosine = float(torch.nn.functional.cosine_similarity(a, b, dim=1).min())
        return cosine >= (MIN_COSINE_STRICT if strict else MIN_COSINE), f"min cosine {cosine:.5f}"

    def fold_segments(self, model, outputs, starts, lengths):
        """A long row's vector: its segments' vectors averaged, each weighed by its tokens, then
        L2-normalised again where the model normalises."""
        mean = weighted_mean_per_group(outputs["embedding"], lengths, starts)
        if model.recipe.normalize and len(mean):
            mean = mean / np.maximum(np.linalg.norm(mean, axis=1, keepdims=True), 1e-12)
        return {"embedding": mean.astype(np.float32)}

    def output_schema(self, model):
        return pa.schema([("embedding", pa.list_(pa.float32(), model.embedding_width))])

    def to_columns(self, model, outputs, valid):
        return {"embedding": fixed_size_list(outputs["embedding"], valid)}
