"""What every format module hands back, and what it raises: the readers' small vocabulary."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

# The column a format whose rows can be bad one by one (a JSONL line without the text key) adds to its
# record batches: per row, why it could not be read, null where it was. Such a row still reaches the
# output, with this as its `error`.
ROW_ERROR_COLUMN = "lengthwise:row_error"


@dataclass(frozen=True)
class Columns:
    """The columns read from a shard, by what they hold: the row id, the texts the job reads (the
    --text-column, and any more a job takes), and the --keep-columns copied to the output."""

    id: str
    texts: tuple[str, ...]
    kept: tuple[str, ...] = ()

    @property
    def names(self) -> list[str]:
        """Every column read, each once, id first."""
        return list(dict.fromkeys([self.id, *self.texts, *self.kept]))


@dataclass(frozen=True)
class ShardFacts:
    """What a shard says of itself before a row is read: its rows; its columns with their types, a
    type None where the format declares none (a JSONL value's type is checked row by row), or
    `columns` None where the shard names none (an empty JSONL file); a problem the format finds
    (a footer that lies, a line over the limit), which fails the shard alone."""

    num_rows: int
    columns: dict[str, pa.DataType | None] | None
    problem: str | None = None


class ShardError(Exception):
    """This shard cannot be read; the message says why."""
