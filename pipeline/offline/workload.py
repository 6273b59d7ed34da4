"""How much work a run has: rows from the shards' footers × the mean tokens of a sample of
their texts, tokenized as the model will see them. `--compile auto` weighs a compile against it;
`--dtype auto`'s bf16 trial runs on the same sample."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.core.settings import InputSettings
from pipeline.core.tokenize import TokenizerSpec, encode_texts
from pipeline.offline.source import Shard, list_source_shards, read_blocks

SAMPLE_ROWS = 1000  # texts tokenized for the mean length: a fraction of a second


def sample_texts(shards: Sequence[Shard], id_column: str, text_column: str, storage_options: dict | None = None,
                 rows: int = SAMPLE_ROWS) -> list | None:
    """The first `rows` texts of the first readable shard (the run's first window starts with
    them); None when there is no row or it cannot be read."""
    readable = [shard for shard in shards if not shard.problem and shard.num_rows]
    for block in read_blocks(readable[:1], id_column, text_column, rows, storage_options):
        if block.failure or not block.num_rows:
            break
        return block.texts.to_pylist()
    return None


@dataclass(frozen=True)
class InputSample:
    """An input as the one setup reads it (`pipeline.runtime.InputRows`), only where it needs it: the same
    for a run, `plan`, a sweep and an estimate of it, so that they share one cached dtype verdict (a sweep's
    recommendation is kept per dtype) and weigh a compile against the same work."""

    shards: Sequence[Shard]
    source: InputSettings

    @classmethod
    def listed(cls, source: InputSettings) -> InputSample:
        """Every shard of `source` (a product's whole input: `plan`, the estimate, the sweep)."""
        return cls(list_source_shards(source), source)

    def texts(self) -> list | None:
        """What the bf16 trial of `--dtype auto` runs on: the input's own first rows."""
        return sample_texts(self.shards, self.source.id_column, self.source.text_column, self.source.storage_options)

    def tokens(self, tokenizer: TokenizerSpec) -> float:
        """What `--compile auto` weighs a compile against (`estimate_tokens`)."""
        return estimate_tokens(self.shards, self.source.id_column, self.source.text_column, tokenizer,
                               self.source.storage_options)


def estimate_tokens(shards: Sequence[Shard], id_column: str, text_column: str, spec: TokenizerSpec,
                    storage_options: dict | None = None) -> float:
    """Estimated real tokens of `shards`: their rows × the mean token length of the first
    SAMPLE_ROWS rows of the first readable shard (0 when they hold no rows)."""
    rows = sum(shard.num_rows for shard in shards if not shard.problem)
    if rows == 0:
        return 0.0
    from tokenizers import Tokenizer

    texts = sample_texts(shards, id_column, text_column, storage_options)
    if texts is None:
        return rows * spec.max_length / 2  # the sample could not be read: assume half-full rows
    encoded = encode_texts(texts, Tokenizer.from_str(spec.tokenizer_json), spec)
    return rows * float(np.mean(encoded.lengths))
