"""Sequence classification: the top label, its probability and every label's probability.

Probabilities follow `transformers.pipeline("text-classification")`: sigmoid for a single
logit or a multi-label model, softmax otherwise.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from transformers import AutoModelForSequenceClassification

from jobs.base import load_pretrained, model_attention_mask
from pipeline.core.segments import max_per_group


MAX_SCORE_CHANGE = 0.01  # another dtype must keep every probability this close to float32's
MAX_SCORE_CHANGE_STRICT = 1e-3  # a compiled forward must keep it this close to eager's in the same dtype


def uses_sigmoid(config) -> bool:
    return config.num_labels == 1 or config.problem_type == "multi_label_classification"


class ClassifyJob:
    name = "classify"
    auto_class = AutoModelForSequenceClassification
    inputs = ("text",)

    def load(self, model_path, device, dtype, prompt_tokens: int = 0, **loading):
        return load_pretrained(AutoModelForSequenceClassification, model_path, device, dtype, **loading)

    def forward(self, model, input_ids, attention_mask, padded: bool = True, packing=None, token_type_ids=None):
        unpadded = getattr(model, "unpadded", None)  # where `--unpad` settled on one (pipeline/core/unpadded.py)
        if padded and unpadded is not None:
            logits = unpadded.logits(input_ids, attention_mask, packing, token_type_ids).float()
        else:
            mask = model_attention_mask(model, attention_mask, padded)
            types = {} if token_type_ids is None else {"token_type_ids": token_type_ids}  # the call stays as it was
            logits = model(input_ids=input_ids, attention_mask=mask, **types).logits.float()
        scores = logits.sigmoid() if uses_sigmoid(model.config) else logits.softmax(dim=-1)
        return {"scores": scores}

    def agreement(self, reference, candidate, strict: bool = False, model=None) -> tuple[bool, str]:
        """Another dtype is as good as `reference` when every row keeps its top label and no
        score moves by more than MAX_SCORE_CHANGE (MAX_SCORE_CHANGE_STRICT when `strict`)."""
        a, b = reference["scores"].float(), candidate["scores"].float()
        same_label = int((a.argmax(dim=1) == b.argmax(dim=1)).sum())
        change = float((a - b).abs().max())
        return same_label == len(a) and change <= (MAX_SCORE_CHANGE_STRICT if strict else MAX_SCORE_CHANGE), \
            f"same top label on {same_label}/{len(a)} rows, max |Δscore| {change:.4f}"

    def fold_segments(self, model, outputs, starts, lengths):
        """A long row scores the maximum per label over its segments: a label any part of the text
        has, the row has (its top label follows from those maxima)."""
        scores, best = max_per_group(outputs["scores"], starts)
        return {"scores": scores, "best_segment": best}

    def output_schema(self, model):
        return pa.schema([("label", pa.string()), ("score", pa.float32()),
                          ("scores", pa.list_(pa.float32()))])

    def to_columns(self, model, outputs, valid):
        scores = outputs["scores"].astype(np.float32)
        best = scores.argmax(axis=1)
        id2label = model.config.id2label
        null = ~valid
        labels = [id2label[int(i)] for i in best]
        rows, width = scores.shape
        offsets = pa.array(np.arange(0, (rows + 1) * width, width, dtype=np.int32))
        return {
            "label": pa.array(labels, pa.string(), mask=null),
            "score": pa.array(scores[np.arange(rows), best], pa.float32(), mask=null),
            "scores": pa.ListArray.from_arrays(offsets, pa.array(scores.reshape(-1)), mask=pa.array(null)),
        }
