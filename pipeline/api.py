"""lengthwise from Python (an Airflow PythonOperator, a notebook): `run(input, output, job, **options)`.

The options are `lengthwise run`'s flags with underscores (`max_length=128`, `keep_columns=["label"]`,
`threshold={"toxic": 0.8}`, `config="configs/nightly_moderation.toml"`), resolved without click
from the same declarations as the CLI's (`pipeline.offline.options`; the keys of a `config` file that
only another command takes: `pipeline.tuning.options`): keyword, then LENGTHWISE_* variable, then the
`config` TOML file, then the default, each checked as the flag is. Errors are exceptions,
never an exit: UsageError (exit 2 on the CLI; bad settings, or a script without a main guard),
ShardsFailed (exit 1), StorageError (exit 4) and WorkerStartError (a tokenizer worker process
could not start). `run_async` is the same call for code inside a running event loop (a notebook,
a web app): it runs the job on a thread and keeps the loop responsive.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from pipeline.core.errors import UsageError
from pipeline.core.logs import configure_logging
from pipeline.core.tokenize import WorkerStartError
from pipeline.engines.execute import execute_run
from pipeline.offline.config import RunConfig
from pipeline.offline.options import resolve_run_options, run_config
from pipeline.tuning.options import OTHER_COMMANDS_KEYS

__all__ = ["run", "run_async", "ShardsFailed", "UsageError", "WorkerStartError"]


class ShardsFailed(RuntimeError):
    """Some shards failed (the others are committed); `summary` says which. Rerun to retry them."""

    def __init__(self, summary: dict):
        super().__init__(f"{len(summary['failed_shards'])} shard(s) failed: "
                         + "; ".join(f"{f['shard']}: {f['error']}" for f in summary["failed_shards"][:3]))
        self.summary = summary


def run(input: str | list[str], output: str | None = None, job: str = "embed", **options) -> dict:
    """Run `job` over `input` into `output` and return the summary (the keys of --summary-json).

    Raises UsageError on bad settings (nothing written), ShardsFailed when shards failed,
    StorageError when the output's storage refused a write (committed shards stay; rerun) and
    WorkerStartError when a tokenizer worker process could not start. A script that calls this
    must do so under `if __name__ == "__main__":` unless tokenize_workers=0 (the tokenizer
    workers are spawned and re-run the main script): a call outside that guard raises
    UsageError at once, before anything is read or written."""
    return _run(input, output, job, options, unguarded_main_call_line(sys._getframe(1)))


async def run_async(input: str | list[str], output: str | None = None, job: str = "embed", **options) -> dict:
    """`run` for code inside a running event loop (a notebook cell, a web app): the job runs
    on a worker thread while the loop goes on serving other tasks; the same summary and errors.
    An interrupt (Ctrl-C) reaches the loop, not the job's thread: the job stops at the end of the
    process, and a rerun resumes from its committed shards."""
    unguarded = unguarded_main_call_line(sys._getframe(1))  # here: the worker thread's stack has no caller
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(_run, input, output, job,
                                                                                    options, unguarded))


def _run(input, output: str | None, job: str, options: dict, unguarded: tuple[str, int] | None) -> dict:
    config, quiet, verbose = run_config_from({**options, "input": input, "output": output, "job": job})
    if quiet or verbose:  # as -q / -v: the same logger, at another level
        configure_logging(logging.DEBUG if verbose else logging.WARNING)
    if unguarded and config.tokenize_workers != 0:  # None: auto, at least one worker
        refuse_an_unguarded_main_script(*unguarded)
    summary = json.loads(execute_run(config).to_json())
    if summary["failed_shards"]:
        raise ShardsFailed(summary)
    return summary


def run_config_from(given: Mapping, environ: Mapping[str, str] | None = None) -> tuple[RunConfig, bool, bool]:
    """The RunConfig of API keywords (`resolve_run_options`, then `run_config`), and whether quiet and
    verbose were asked for. A `config` file's keys that only another command takes are skipped."""
    options = resolve_run_options(given, os.environ if environ is None else environ, OTHER_COMMANDS_KEYS)
    quiet, verbose = options.pop("quiet"), options.pop("verbose")
    return run_config(**options), quiet, verbose


def refuse_an_unguarded_main_script(script: str, line: int) -> None:
    """Tokenizer workers are spawned, and each runs the main script again: a call at its top
    level, outside `if __name__ == "__main__":`, would run once more in every worker (and a
    try/except around it would hide that). Refuse such a call before any work, in the parent."""
    raise UsageError(f"lengthwise is called at the top level of {script} (line {line}), outside "
                         f"`if __name__ == \"__main__\":`; its tokenizer workers are spawned and would each run "
                     f"that script again. Put the call under that guard, or set tokenize_workers=0")


def unguarded_main_call_line(frame) -> tuple[str, int] | None:
    """(script, line) when the call stack reaches the main script's top-level code at a
    statement that is not inside an `if __name__ == "__main__":` block; None otherwise (no
    script file, as in a notebook or `python -c`, or a guarded call)."""
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__")
                                     in ("__main__", "__mp_main__")):
        frame = frame.f_back
    path = frame and frame.f_globals.get("__file__")
    if not path or not Path(path).is_file():
        return None
    try:
        tree = ast.parse(Path(path).read_text())
    except (SyntaxError, UnicodeDecodeError, OSError):
        return None
    line = frame.f_lineno
    for statement in tree.body:
        if statement.lineno <= line <= (statement.end_lineno or statement.lineno):
            return None if _is_main_guard(statement) else (path, line)
    return None


def _is_main_guard(statement: ast.stmt) -> bool:
    """`if __name__ == "__main__":` (either side of the ==)."""
    if not isinstance(statement, ast.If) or not isinstance(statement.test, ast.Compare):
        return False
    sides = [statement.test.left, *statement.test.comparators]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and \
        any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)
