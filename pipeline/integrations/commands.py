"""The `lengthwise` command lines a scheduler runs, made of the API's keyword names, and how to
read their exit codes and JSON. Pure and stdlib-only (no scheduler, no torch), so Airflow's own
environment can hold it without lengthwise's dependencies.

The keyword names and what each takes come from `pipeline.offline.options.RUN_OPTIONS`, the one
declaration the CLI's flags and `pipeline.api.run` are made of: an operator's `max_length=128`
becomes `--max-length 128` by the same rule that makes the flag, never by a second list.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from pipeline.core import exit_codes
from pipeline.core.errors import UsageError
from pipeline.core.options import Option
from pipeline.core.values import Flag
from pipeline.offline.options import LOG_LEVEL_OPTIONS, RUN_OPTIONS, keyword_value

CONFIG = "config"  # `--config JOB.toml`: a keyword of `run` with no Option row (the file is read by the command)
RUN_KEYWORDS: dict[str, Option] = {**RUN_OPTIONS, **LOG_LEVEL_OPTIONS}
OPTION_NAMES = (*RUN_KEYWORDS, CONFIG)  # every keyword `pipeline.api.run` takes, input, output and job included
DEFAULT_EXECUTABLE = "lengthwise"  # found on PATH, as a shell would


def flag_of(name: str) -> str:
    """The CLI flag of an API keyword: `max_length` → `--max-length` (how the CLI names them)."""
    return "--" + name.replace("_", "-")


def unknown_options(names) -> list[str]:
    """The names that are no keyword of `run`, sorted: checked when a DAG is parsed, so a typo fails
    the DAG's import instead of every night's task."""
    return sorted(set(names) - set(OPTION_NAMES))


def option_arguments(name: str, value) -> list[str]:
    """One keyword as flags. A flag's True is `--name`; its False is `--no-name` where the flag can be
    negated (its default is not False: `probe`, `dedupe`, `progress`), else nothing. A repeatable option
    repeats its flag (`input=[a, b]`, `threshold={"toxic": 0.8}` → `--threshold toxic=0.8`); a list for
    any other option is comma-separated (`keep_columns=["label", "lang"]`), as `pipeline.api.run` takes it."""
    if value is None:
        return []
    if name == CONFIG:
        return [flag_of(name), str(value)]
    if name not in RUN_KEYWORDS:
        raise UsageError(f"run() has no option {name!r}; options: {', '.join(sorted(OPTION_NAMES))}")
    option = RUN_KEYWORDS[name]
    value = keyword_value(name, option, value)
    if isinstance(option.kind, Flag):
        if value:
            return [flag_of(name)]
        return [] if option.default is False else ["--no-" + name.replace("_", "-")]
    if option.multiple:
        return [part for item in value for part in (flag_of(name), str(item))]
    return [flag_of(name), str(value)]


def run_arguments(options: Mapping) -> list[str]:
    """`lengthwise run`'s arguments for API keywords (`input`, `output`, `job` among them), in the
    order given; None means "not set" (the CLI's own default, variable or --config file decides)."""
    return ["run", *(part for name, value in options.items() for part in option_arguments(name, value))]


def command_prefix(executable: str | Sequence[str] | None) -> list[str]:
    """The argv that starts lengthwise: `lengthwise` on PATH by default, one path, or a list such as
    `[python, "-m", "pipeline.cli"]` (the venv that has torch, from a scheduler's venv that has not)."""
    if executable is None:
        return [DEFAULT_EXECUTABLE]
    if isinstance(executable, str):
        return [executable]
    return [str(part) for part in executable]


def storage_arguments(storage_option) -> list[str]:
    """`--storage-option KEY=VALUE` pairs of a dict or a list of pairs (status and verify take them too)."""
    return option_arguments("storage_option", storage_option)


def status_arguments(output: str, storage_option=None) -> list[str]:
    return ["status", "--output", str(output), *storage_arguments(storage_option), "--json"]


def verify_arguments(output: str, input=None, storage_option=None) -> list[str]:
    return ["verify", "--output", str(output), *option_arguments("input", input), *storage_arguments(storage_option),
            "--json"]


def run_exit_is_final(code: int) -> bool:
    """Whether a `run` that exited `code` must not be retried: only a usage error (2: the settings
    are wrong and nothing was written, so a retry fails the same way). 1 (shards failed; a retry
    redoes only those), 4 (the storage refused a write; it may be back), 130/143 (interrupted; a
    rerun resumes) and a kill by a signal are retried."""
    return code == exit_codes.USAGE


def verify_exit_is_final(code: int) -> bool:
    """Whether a `verify` that exited `code` must not be retried: 1 (rows missing, extra or of other
    settings) and 2 (no run there) say what the output holds, which a second look does not change;
    4 (the storage could not be read) may pass later."""
    return code in (exit_codes.SHARDS_FAILED, exit_codes.USAGE)


def parse_json_answer(stdout: str) -> dict | None:
    """The JSON `status --json` / `verify --json` printed, or None when there is none (a usage error
    prints one line on stderr and nothing on stdout)."""
    try:
        answer = json.loads(stdout)
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


def status_is_complete(code: int, status: dict | None) -> bool:
    """Whether `status --json` says every shard is done: exit 0 and its counts agree. Exit 1 (shards
    pending or failed) and 2 (no run at that output yet) are "not yet"; so is 4 (storage not readable
    now), which a sensor waits out up to its timeout."""
    return (code == exit_codes.DONE and status is not None and status.get("shards", 0) > 0
            and status.get("done") == status.get("shards") and not status.get("failed") and not status.get("pending"))


def status_line(code: int, status: dict | None, stderr: str = "") -> str:
    """One line for the task log about a status answer: the counts, or why there are none."""
    if status is None:
        last = stderr.strip().splitlines()[-1:] or [f"exit {code}, no JSON"]
        return f"status exit {code}: {last[0]}"
    return (f"{status.get('output')}: {status.get('done')} of {status.get('shards')} shards done, "
            f"{status.get('failed')} failed, {status.get('pending')} pending; "
            f"{status.get('rows_done')} of {status.get('rows')} rows done")


def failed_shards_line(summary: dict | None, limit: int = 3) -> str:
    """The first failed shards of a summary and their errors, for the exception a retry is logged with."""
    failed = (summary or {}).get("failed_shards") or []
    listed = "; ".join(f"{item.get('shard')}: {item.get('error')}" for item in failed[:limit])
    return f"{len(failed)} shard(s) failed: {listed}" if failed else ""
