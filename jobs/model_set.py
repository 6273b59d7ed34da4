"""Several models over the same tokens, presented to the pipeline as one job (docs/jobs.md "Several models,
one pass"): every batch runs through each model in turn, and each model's outputs and columns are its own
job's, named `NAME.KEY`. The runner, the device loop and the writer see one job; nothing else changes.

A `flagged_by` column lists, per row, the `NAME:LABEL` each moderating model flagged (model order, then
label order), so that a review queue needs no join.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

SEPARATOR = "."  # between a model's name and its own column or output name
FLAGGED_BY = "flagged_by"


def prefixed(name: str, values: dict) -> dict:
    return {f"{name}{SEPARATOR}{key}": value for key, value in values.items()}


def own(name: str, values: dict) -> dict:
    """The entries of `values` that belong to model `name`, under their own names."""
    start = f"{name}{SEPARATOR}"
    return {key[len(start):]: value for key, value in values.items() if key.startswith(start)}


class ModelSet(torch.nn.Module):
    """The loaded models of a run by name, in the run's order; `config` is the first's (what a
    product that reads one model's shape reads: the memory plans are each model's own)."""

    def __init__(self, models: dict[str, torch.nn.Module]):
        super().__init__()
        self.names = tuple(models)
        self.members = dict(models)  # not a ModuleDict: each model already sits on its device in its dtype
        self.config = next(iter(models.values())).config
        # any model's unpadded forward (core/unpadded.py): the host then packs each batch's layout once, which
        # that model reads, and the others, padded, ignore
        self.unpadded = next((getattr(each, "unpadded") for each in models.values()
                              if getattr(each, "unpadded", None) is not None), None)


class ModelSetJob:
    """The `Job` of several models (jobs/base.py): `jobs` by name, in the run's order."""

    name = "models"

    def __init__(self, jobs: dict[str, object]):
        self.jobs = dict(jobs)
        first = next(iter(self.jobs.values()))
        self.auto_class = first.auto_class
        self.inputs = first.inputs
        if any(hasattr(job, "count_flagged") for job in self.jobs.values()):  # the runner counts flags where a job can
            self.count_flagged = self.count_flags

    def forward(self, model: ModelSet, input_ids, attention_mask, padded: bool = True, packing=None,
                token_type_ids=None, models: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """Every model's outputs, or those of `models` only (a change of models: rows whose other models'
        columns are carried, offline/carry.py)."""
        types = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        outputs = {}
        for name, job in self.jobs.items():
            if models is not None and name not in models:
                continue
            outputs.update(prefixed(name, job.forward(model.members[name], input_ids, attention_mask, padded,
                                                      packing, **types)))
        return outputs

    def agreement(self, reference, candidate, strict: bool = False, model=None) -> tuple[bool, str]:
        """Each model's own test (its dtype and compile trials ran alone, when its runtime opened)."""
        verdicts = [(name, *job.agreement(own(name, reference), own(name, candidate), strict,
                                          model.members[name] if model is not None else None))
                    for name, job in self.jobs.items()]
        return all(agrees for _, agrees, _ in verdicts), "; ".join(f"{name}: {how}" for name, _, how in verdicts)

    def output_schema(self, model: ModelSet) -> pa.Schema:
        fields = [field.with_name(f"{name}{SEPARATOR}{field.name}") for name, job in self.jobs.items()
                  for field in job.output_schema(model.members[name])]
        return pa.schema([*fields, (FLAGGED_BY, pa.list_(pa.string()))])

    def split_schema(self, model: ModelSet) -> pa.Schema:
        """--long-text split: each model's own split columns (moderate's flag_spans), named per model."""
        return pa.schema([field.with_name(f"{name}{SEPARATOR}{field.name}") for name, job in self.jobs.items()
                          if hasattr(job, "split_schema") for field in job.split_schema(model.members[name])])

    def fold_segments(self, model: ModelSet, outputs: dict, starts: np.ndarray, lengths: np.ndarray) -> dict:
        folded = {}
        for name, job in self.jobs.items():
            if own(name, outputs):  # a model that ran no row of the window (its columns carried) has none
                folded.update(prefixed(name, job.fold_segments(model.members[name], own(name, outputs), starts,
                                                               lengths)))
        return folded

    def to_columns(self, model: ModelSet, outputs: dict, valid: np.ndarray) -> dict[str, pa.Array]:
        """Each model's columns, then `flagged_by`, then the split columns: always in the order
        `output_schema` and `split_schema` give, as a window with no row to run writes them. A model that ran
        no row of the window (its columns carried) has none here: the runner fills them with nulls."""
        columns = {}
        for name, job in self.jobs.items():
            if own(name, outputs):
                columns.update(prefixed(name, job.to_columns(model.members[name], own(name, outputs), valid)))
        columns[FLAGGED_BY] = flagged_by(
            {name: columns[f"{name}{SEPARATOR}flagged_labels"] for name in self.jobs
             if f"{name}{SEPARATOR}flagged_labels" in columns}, valid)
        order = [*self.output_schema(model).names, *self.split_schema(model).names]
        return {name: columns[name] for name in order if name in columns}

    def count_flags(self, model: ModelSet, table: pa.Table) -> tuple[int, dict[str, int]]:
        """Rows any model flagged, and per moderating model: `NAME` → rows it flagged and
        `NAME:LABEL` → rows that label hit (the summary's `models` reads them apart)."""
        counts = {}
        for name, job in self.jobs.items():
            if not hasattr(job, "count_flagged"):
                continue
            columns = own(name, dict(zip(table.column_names, table.columns)))
            rows, by_label = job.count_flagged(model.members[name], pa.table(columns))
            counts[name] = rows
            counts.update({f"{name}:{label}": hits for label, hits in by_label.items()})
        flagged = pc.greater(pc.fill_null(pc.list_value_length(table[FLAGGED_BY]), 0), 0)
        return int(pc.sum(flagged).as_py() or 0), counts


def flagged_by(flagged_labels: dict[str, pa.ListArray], valid: np.ndarray) -> pa.ListArray:
    """Per row, `NAME:LABEL` for each label each model flagged, in model order then label order;
    null where the row has no result."""
    rows = len(valid)
    parents, entries = [], []
    for name, labels in flagged_labels.items():
        parents.append(pc.list_parent_indices(labels).to_numpy(zero_copy_only=False))
        values = pc.list_flatten(labels)
        entries.append(pc.binary_join_element_wise(pa.array([f"{name}:"] * len(values), pa.string()), values, ""))
    parent = np.concatenate(parents) if parents else np.zeros(0, np.int64)
    order = np.argsort(parent, kind="stable")  # each row's entries, models in order, labels in order
    names = pa.concat_arrays([entry.cast(pa.string()) for entry in entries]) if entries else pa.array([], pa.string())
    offsets = np.concatenate([[0], np.cumsum(np.bincount(parent, minlength=rows))]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), names.take(pa.array(order)), mask=pa.array(~valid))
