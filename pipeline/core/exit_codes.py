"""The exit codes of every `lengthwise` command, in one table: what cron and Airflow branch on.

Each code names the error types that end a command with it. Only those do: any other
exception is a bug, which exits 1 with its (redacted) traceback, never 2, so that a bug never
reads as a setting to change. click's own usage errors (an unknown flag, a value its type
refuses) exit 2 as well, from the CLI. `run --help`, the README and docs/operations.md say the
same codes (tests/cli/test_exit_codes.py holds them to this table).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from pipeline.core.errors import StorageError, UsageError


@dataclass(frozen=True)
class ExitCode:
    code: int
    meaning: str  # one line, as `run --help` prints it
    errors: tuple[type[BaseException], ...] = ()  # the error types a command exits with this code for
    signal_number: int | None = None  # the signal that ends a command with this code (128 + its number)


DONE = 0
SHARDS_FAILED = 1
USAGE = 2
REGRESSION = 3
STORAGE = 4
INTERRUPTED_BY_SIGINT = 128 + signal.SIGINT  # 130, as a shell reports a process a signal ended
INTERRUPTED_BY_SIGTERM = 128 + signal.SIGTERM  # 143

EXIT_CODES = (
    ExitCode(DONE, "every shard is done (also: nothing was left to do)"),
    ExitCode(SHARDS_FAILED, "some shards failed; the others are committed, a rerun retries them (also an "
                            "unexpected error, with its traceback)"),
    ExitCode(USAGE, "usage or config error: nothing written, one line says what to change", (UsageError,)),
    ExitCode(REGRESSION, "sweep or loadtest --fail-on-regression: a level regressed against --compare"),
    ExitCode(STORAGE, "the output's storage refused a write (no space, no permission, an object store down); "
                      "committed shards stay, rerun once it is fixed", (StorageError,)),
    ExitCode(INTERRUPTED_BY_SIGINT, "interrupted by SIGINT; committed shards stay, a rerun resumes",
             signal_number=signal.SIGINT),
    ExitCode(INTERRUPTED_BY_SIGTERM, "interrupted by SIGTERM; committed shards stay, a rerun resumes",
             signal_number=signal.SIGTERM),
)

INTERRUPTING_SIGNALS = {row.signal_number: row.code for row in EXIT_CODES if row.signal_number is not None}


def exit_code_for(error: BaseException) -> int | None:
    """The code a command exits with for `error`, or None: not an error the table maps (a bug)."""
    return next((row.code for row in EXIT_CODES if isinstance(error, row.errors)), None)


def exit_codes_help() -> str:
    """The table as `--help` prints it: one code a line, the meaning wrapped under its column."""
    import textwrap

    lines = []
    for row in EXIT_CODES:
        wrapped = textwrap.wrap(row.meaning, 72)
        lines.append(f"  {row.code:<5}{wrapped[0]}")
        lines.extend(f"       {line}" for line in wrapped[1:])
    return "\n".join(lines)
