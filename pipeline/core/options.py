"""An option of a `lengthwise` command, declared once and below the CLI: what it takes (a kind of
`pipeline.core.values`), its default as a flag would give it, whether it repeats or is required, the
name the command takes it by when that is not its key, and its `--help` text. An option's key is its
TOML key; its flag is `--KEY` (dashes for underscores) and its variable LENGTHWISE_<KEY> (`env_name`).

The tables: `run`'s in `pipeline.offline.options` (a job's own options declared by the job, in
`jobs/`), `status`'s and `verify`'s beside it, `plan`'s, `sweep`'s and `loadtest`'s in
`pipeline.tuning.options`. The CLI makes its click options of them alone (`pipeline.cli.options`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from pipeline.core import values


@dataclass(frozen=True)
class Option:
    """One option of one or more commands. `parameter`: the name the command (and `run_config`) takes
    it by when that is not the key (`--json` → `as_json`)."""

    kind: values.Kind
    default: object = None
    multiple: bool = False
    parameter: str | None = None
    help: str = ""
    required: bool = False

    @property
    def shows_default(self) -> bool:
        """Whether `--help` shows the default: one that is a value, not none, off or empty."""
        return (not self.multiple and self.default is not None and self.default is not False
                and self.default not in ((), {}))

    def parse(self, value):
        """The option's value from one source; ValueError says what is wrong."""
        if self.multiple:
            return tuple(self.kind.parse(item) for item in value)
        return None if value is None else self.kind.parse(value)

    def but(self, **changes) -> Option:
        """This option as another command says it: its own help, or required there."""
        return dataclasses.replace(self, **changes)


def env_name(key: str) -> str:
    return f"LENGTHWISE_{key.upper()}"


def options_of(table: Mapping[str, Option], *keys: str) -> dict[str, Option]:
    """The rows of these keys, in this order: a group of options that several commands take."""
    return {key: table[key] for key in keys}
