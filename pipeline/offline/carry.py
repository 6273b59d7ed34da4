"""A change of models (docs/jobs.md "Several models, one pass"): a rerun into an output of several models,
with a model added, changed or removed, carries the kept models' columns from the shards committed before and
runs only the added and changed models. Rows are recognised as --reuse recognises them (offline/reuse.py: the
id and text hashes of each done shard, each copied row's id checked), from the output itself: a shard is
rewritten whole, with every model's columns, and committed by rename as any shard is, so that a kill leaves
the old file or the new one. A row whose columns cannot be carried (not in the output before, edited, or an
error a retry may fix) runs every model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa

from pipeline.offline.model_set import ModelChange
from pipeline.offline.reuse import PreviousOutput, ReusedRows, hash_rows
from pipeline.offline.manifest import fingerprint_digest
from pipeline.offline.source import RowBlock

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Carry:
    """What a shard runner carries: the columns of the `kept` models, from the done shards whose marker holds
    `made_with` (a fingerprint digest); `computed`: the models the carried rows still run."""

    made_with: str
    kept: tuple[str, ...]
    computed: tuple[str, ...]


def carry_of(change: ModelChange | None) -> Carry | None:
    return None if change is None else Carry(fingerprint_digest(change.source), change.kept, change.computed)


def kept_columns(names: Iterable[str], kept: tuple[str, ...]) -> list[str]:
    """The columns of `names` that belong to a kept model (`NAME.COLUMN`)."""
    from jobs.model_set import SEPARATOR  # here: jobs/model_set.py imports torch

    return [name for name in names if SEPARATOR in name and name.partition(SEPARATOR)[0] in kept]


def mark_carried(windows: Iterable[list[RowBlock]], previous: PreviousOutput, carry: Carry,
                 columns: list[str]) -> Iterator[list[RowBlock]]:
    """Each window's blocks with `reuse` set, `carried`: the rows found in the output's earlier shards take
    the kept models' `columns` from there; their texts stay, for the models computed."""
    for blocks in windows:
        yield [block if block.failure is not None else carry_block(block, previous, carry, columns)
               for block in blocks]


def carry_block(block: RowBlock, previous: PreviousOutput, carry: Carry, columns: list[str]) -> RowBlock:
    hashes = hash_rows(block.ids, block.texts, block.pairs)
    has_text = hashes.text_hashes.is_valid().to_numpy(zero_copy_only=False)
    matches = previous.index.match(hashes.id_hashes, hashes.text_hashes.fill_null(0).to_numpy(), has_text)
    results = previous.take_results(matches, block.ids)
    if results is not None:
        missing = sorted(set(columns) - set(results.column_names))
        if missing:  # a file rewritten by hand without a model's columns: those rows run every model
            log.warning(f"the output's earlier shards lack {', '.join(missing)}: their rows are computed by every "
                        "model")
            matches.skip(np.flatnonzero(matches.reused))
            results = None
        else:
            results = results.select(columns)
    return replace(block, reuse=ReusedRows(hashes, matches.reused.copy(), results, matches, carried=True))


def split_by_carry(rows: np.ndarray, carried_rows: np.ndarray | None, segment_owner: np.ndarray | None,
                   num_rows: int, computed: tuple[str, ...] | None) -> list[tuple[np.ndarray, tuple[str, ...] | None]]:
    """Positions in a window's `scored` rows, as (positions, the models that run them; None: every model):
    rows whose kept models' columns are carried (`carried_rows`) run only the `computed` models, the others
    every one. A segment (a position from `num_rows` on, of row `segment_owner`) goes with its row."""
    if carried_rows is None or computed is None:
        return [(rows, None)]
    owner = rows.copy()
    segments = rows >= num_rows
    if segments.any():
        owner[segments] = segment_owner[rows[segments] - num_rows]
    carried = carried_rows[owner]
    return [(rows[~carried], None), (rows[carried], computed)]


def carried_mask(blocks: list[RowBlock]) -> np.ndarray | None:
    """Per row of a window, whether its kept models' columns are carried; None where no block carries."""
    if not any(block.reuse is not None and block.reuse.carried for block in blocks):
        return None
    return np.concatenate([block.reuse.mask if block.reuse is not None and block.reuse.carried
                           else np.zeros(block.num_rows, bool) for block in blocks])


def carried_table(table: pa.Table) -> pa.Table:
    """A block's output once its carried columns are merged: `flagged_by` made anew from every model's
    `flagged_labels`, carried or computed (the window's was made before the merge)."""
    from jobs.model_set import FLAGGED_BY, SEPARATOR, flagged_by

    if FLAGGED_BY not in table.column_names:
        return table
    suffix = f"{SEPARATOR}flagged_labels"
    labels = {name[:-len(suffix)]: table[name].combine_chunks() for name in table.column_names
              if name.endswith(suffix)}
    valid = table["error"].combine_chunks().is_null().to_numpy(zero_copy_only=False)  # a row with a result
    column = flagged_by(labels, valid)
    return table.set_column(table.column_names.index(FLAGGED_BY), FLAGGED_BY, column)
