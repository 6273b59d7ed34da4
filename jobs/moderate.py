"""Moderation: a sequence classifier's per-label scores, and a threshold per label that flags a row.

Scores are `classify`'s (sigmoid for a multi-label or one-logit model, softmax otherwise). A
label is hit when it is one of the flag labels and its score is at least its threshold; a row
is flagged when any label is hit. A row with an error is neither flagged nor clean: null.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from transformers import AutoConfig

from jobs.classify import ClassifyJob, uses_sigmoid
from pipeline.core.settings import ModelSettings
from pipeline.core.errors import UsageError


def model_labels(config) -> tuple[str, ...]:
    """The model's label names in logit order, which must be distinct (they name the score fields)."""
    labels = tuple(str(config.id2label[i]) for i in range(config.num_labels))
    if len(set(labels)) != len(labels):
        raise UsageError(f"the model's labels are not distinct ({', '.join(labels)}); fix id2label in its config.json")
    return labels


def resolve_thresholds(labels: tuple[str, ...], sigmoid: bool, thresholds: dict[str, float],
                       default_threshold: float, flag_labels: tuple[str, ...] | None) -> dict[str, float]:
    """Flag label → threshold, in the model's label order: what decides `flagged`.

    No `flag_labels` means every label of a sigmoid model; a softmax model's labels share one
    distribution (one of them is usually `normal`), so it must name them."""
    known = f"the model's labels: {', '.join(labels)}"
    for flag, names in (("--threshold", thresholds), ("--flag-labels", flag_labels or ())):
        unknown = [name for name in names if name not in labels]
        if unknown:
            raise UsageError(f"{flag} names {', '.join(map(repr, unknown))}, not a label of this model; {known}")
    for name, value in {**thresholds, "--default-threshold": default_threshold}.items():
        if not 0.0 <= value <= 1.0:
            raise UsageError(f"threshold {name}={value} is outside 0…1 (scores are probabilities)")
    if not flag_labels and not sigmoid:
        raise UsageError(f"a single-label (softmax) model needs --flag-labels: which labels count as flagged, "
                         f"e.g. all but the harmless one; {known}")
    flagging = set(flag_labels or labels)
    ignored = [name for name in thresholds if name not in flagging]
    if ignored:
        raise UsageError(f"--threshold {', '.join(ignored)}: not among --flag-labels ({', '.join(flag_labels)}); "
                         "add it there or drop its threshold")
    return {name: float(thresholds.get(name, default_threshold)) for name in labels if name in flagging}


FLAG_SPAN = pa.struct([("label", pa.string()), ("start", pa.int32()), ("end", pa.int32())])


def flag_hits(scores: np.ndarray, labels: tuple[str, ...], thresholds: dict[str, float]) -> np.ndarray:
    """(rows, labels) bool: label hit = flag label with score ≥ its threshold."""
    cut = np.array([thresholds.get(name, np.inf) for name in labels], dtype=np.float64)
    return scores.astype(np.float64) >= cut


def flag_span_column(spans: np.ndarray, hits: np.ndarray, offsets: np.ndarray, names: pa.Array,
                     null: pa.Array) -> pa.Array:
    """Per row, one {label, start, end} per flag label hit (as `flagged_labels` lists them): the
    character span of the row's text whose segment scored the label highest."""
    hit_spans = spans[hits]  # (hits, 2), row-major as `names`
    entries = pa.StructArray.from_arrays([names, pa.array(hit_spans[:, 0], pa.int32()),
                                          pa.array(hit_spans[:, 1], pa.int32())], fields=list(FLAG_SPAN))
    return pa.ListArray.from_arrays(pa.array(offsets), entries, mask=null)


class Moderator(torch.nn.Module):
    """A sequence classifier with its labels and the run's thresholds (a job is shared by runs;
    the loaded model is this run's)."""

    def __init__(self, classifier: torch.nn.Module, thresholds: dict[str, float]):
        super().__init__()
        self.classifier = classifier
        self.config = classifier.config  # what the memory plan and length checks read
        self.labels = model_labels(classifier.config)
        self.thresholds = thresholds
        # the classifier's verdict on a prepared mask (jobs.base.model_attention_mask)
        self.takes_prepared_mask = getattr(classifier, "takes_prepared_mask", False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                token_type_ids: torch.Tensor | None = None):
        types = {} if token_type_ids is None else {"token_type_ids": token_type_ids}  # a pair's (jobs/pair.py)
        return self.classifier(input_ids=input_ids, attention_mask=attention_mask, **types)


class ModerateJob(ClassifyJob):
    name = "moderate"

    def options(self, settings: ModelSettings, model_path: str) -> dict:
        """The resolved thresholds, checked against the model's labels before anything runs
        (they change the output, so they join its fingerprint). A sweep has none: it
        measures speed, and flags with the default threshold. The options that set them are
        declared beside the job: jobs/moderate_options.py."""
        if settings.thresholds is None:
            return {}
        try:
            config = AutoConfig.from_pretrained(model_path, trust_remote_code=settings.trust_remote_code)
        except (OSError, ValueError) as error:
            raise UsageError(f"cannot read the model config in {model_path}: {error}") from error
        return {"thresholds": resolve_thresholds(model_labels(config), uses_sigmoid(config), settings.thresholds,
                                                 settings.default_threshold, settings.flag_labels)}

    def load(self, model_path, device, dtype, prompt_tokens: int = 0, thresholds: dict | None = None, **loading):
        classifier = super().load(model_path, device, dtype, **loading)
        labels = model_labels(classifier.config)
        return Moderator(classifier, thresholds or {name: ModelSettings.default_threshold for name in labels}).eval()

    def agreement(self, reference, candidate, strict: bool = False, model=None) -> tuple[bool, str]:
        """`classify`'s test, and with `model` (its labels and thresholds) no row's flags may
        change: a score that stays within 0.01 can still cross a threshold."""
        agrees, how = super().agreement(reference, candidate, strict)
        if model is None:
            return agrees, how
        hits = [flag_hits(outputs["scores"].float().numpy(), model.labels, model.thresholds)
                for outputs in (reference, candidate)]
        changed = int((hits[0] != hits[1]).any(axis=1).sum())
        return agrees and changed == 0, f"{how}, flags changed on {changed}/{len(hits[0])} rows"

    def output_schema(self, model):
        return pa.schema([("flagged", pa.bool_()), ("flagged_labels", pa.list_(pa.string())),
                          ("scores", pa.struct([(name, pa.float32()) for name in model.labels]))])

    def split_schema(self, model):
        """--long-text split adds, per flag label hit, the character span of the segment that hit it."""
        return pa.schema([("flag_spans", pa.list_(FLAG_SPAN))])

    def to_columns(self, model, outputs, valid):
        scores = outputs["scores"].astype(np.float32)
        hits = flag_hits(scores, model.labels, model.thresholds) & valid[:, None]
        null = pa.array(~valid)
        rows, hit_labels = np.nonzero(hits)  # row-major: each row's labels in label order
        offsets = np.concatenate([[0], np.cumsum(hits.sum(axis=1))]).astype(np.int32)
        names = pa.array(np.array(model.labels, dtype=object)[hit_labels] if len(hit_labels) else [], pa.string())
        return {
            "flagged": pa.array(hits.any(axis=1), pa.bool_(), mask=~valid),
            "flagged_labels": pa.ListArray.from_arrays(pa.array(offsets), names, mask=null),
            "scores": pa.StructArray.from_arrays([pa.array(scores[:, i]) for i in range(len(model.labels))],
                                                 names=list(model.labels), mask=null),
            **({"flag_spans": flag_span_column(outputs["spans"], hits, offsets, names, null)}
               if "spans" in outputs else {}),
        }

    def count_flagged(self, model, table: pa.Table) -> tuple[int, dict[str, int]]:
        """Rows flagged in one written block, and per flag label the rows it hit."""
        hit = pc.value_counts(pc.list_flatten(table["flagged_labels"])).to_pylist()
        by_label = {item["values"]: item["counts"] for item in hit}
        return int(pc.sum(table["flagged"]).as_py() or 0), {name: by_label.get(name, 0) for name in model.thresholds}
