"""Airflow 3 operators for lengthwise: run a job, verify an output, wait for one to be complete.

Each runs the `lengthwise` command as a child process (`executable`: the `lengthwise` on PATH, or
e.g. `["/srv/lengthwise/.venv/bin/python", "-m", "pipeline.cli"]`), so Airflow's environment needs
neither torch nor the model, only this module (stdlib and `pipeline.offline.options`, no other
dependency of lengthwise). The exit codes decide what Airflow does:

- `LengthwiseRunOperator`: 0 returns the run's summary (the keys of `--summary-json`) to XCom;
  2 (usage error: nothing written, the same settings fail the same way) raises
  AirflowFailException, which fails the task without its retries; 1 (shards failed), 4 (storage
  refused a write) and an interruption raise AirflowException, which Airflow retries, and the
  retry redoes only what is not committed.
- `LengthwiseVerifyOperator`: 0 returns `verify --json`'s report; 1 (rows missing, extra, of other
  settings) and 2 fail for good, 4 (storage unreadable now) is retried.
- `LengthwiseCompleteSensor`: done when `status --json` counts every shard done. Deferrable by
  default: `LengthwiseStatusTrigger` polls `status` in the triggerer, holding no worker slot.

Only Airflow 3's public API is used: `airflow.sdk` for the bases, `airflow.sdk.exceptions`, and
`airflow.triggers.base` for the trigger.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator, BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowException, AirflowFailException
from airflow.triggers.base import BaseTrigger, TriggerEvent

from pipeline.core.errors import UsageError
from pipeline.integrations.commands import (OPTION_NAMES, command_prefix, failed_shards_line, parse_json_answer,
                                            run_arguments, run_exit_is_final, status_arguments, status_is_complete,
                                            status_line, verify_arguments, verify_exit_is_final)

DEFAULT_KILL_TIMEOUT_S = 60.0  # how long on_kill waits for lengthwise's clean stop (it abandons one shard) before SIGKILL
TRIGGER_PATH = f"{__name__}.LengthwiseStatusTrigger"


def with_option_keywords(init):
    """Give an operator's `__init__(..., **kwargs)` a signature that names every keyword of
    `pipeline.api.run` (default None). Airflow checks `.partial(...)`/`.expand(...)` keywords and
    fills `default_args` against the signature, so `LengthwiseRunOperator.partial(model=...)
    .expand(shard_index=[0, 1, 2])` works for any option without a second list of them."""
    signature = inspect.signature(init)
    fixed = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    rest = [p for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    taken = {p.name for p in fixed}
    options = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
               for name in OPTION_NAMES if name not in taken]
    init.__signature__ = signature.replace(parameters=[*fixed, *options, *rest])
    return init


def stop_child(process: subprocess.Popen, exited: threading.Event, timeout_s: float) -> int | None:
    """SIGTERM, then wait up to `timeout_s` for lengthwise's clean stop (the shard in flight is
    abandoned, committed ones stay: exit 143), then SIGKILL its whole process group (its tokenizer
    workers too). Only the main process gets the SIGTERM: a second one, as a group-wide signal would
    deliver again, makes lengthwise exit at once instead of cleanly. It waits on `exited` (set by the
    thread that reaps the child), never in Popen.wait: this runs in a signal handler, which may have
    interrupted a Popen.wait holding the lock it would need."""
    if exited.is_set():
        return process.returncode
    process.send_signal(signal.SIGTERM)
    if not exited.wait(timeout_s):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        exited.wait(timeout_s)
    return process.returncode


def _pump(stream, sink) -> None:
    """Copy a child's text stream, line by line, into `sink` (the task log, or a list)."""
    with stream:
        for line in stream:
            sink(line.rstrip("\n"))


def _reap(process: subprocess.Popen, exited: threading.Event) -> None:
    """Wait for the child on this thread alone and say so: the one place that reaps it."""
    process.wait()
    exited.set()


class _LengthwiseCommand:
    """Runs one `lengthwise` command as a child process in its own session, so that the signals
    Airflow sends the task's process group do not reach it twice; `on_kill` stops it cleanly."""

    executable: str | Sequence[str] | None
    kill_timeout: float

    def run_command(self, arguments: list[str], keep_stdout: bool = False) -> tuple[int, str]:
        """Run lengthwise with `arguments`; its stderr (and stdout, unless kept) go to the task log
        line by line while it runs. Returns the exit code and the kept stdout."""
        argv = [*command_prefix(self.executable), *arguments]
        self.log.info("running %s", " ".join(argv))
        try:
            child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, errors="replace", start_new_session=True)
        except FileNotFoundError as error:
            raise AirflowFailException(f"cannot start lengthwise ({error}); set executable= to its path, or a "
                                       "list such as [python, '-m', 'pipeline.cli']") from None
        self._child, self._child_exited = child, threading.Event()
        kept: list[str] = []
        threads = [threading.Thread(target=_pump, args=(child.stderr, self._log_line), daemon=True),
                   threading.Thread(target=_pump, args=(child.stdout, kept.append if keep_stdout else self._log_line),
                                    daemon=True),
                   threading.Thread(target=_reap, args=(child, self._child_exited), daemon=True)]
        for thread in threads:
            thread.start()
        for thread in threads:  # joined, not Popen.wait: on_kill (a signal handler) may run meanwhile
            thread.join()
        code = child.returncode
        self.log.info("lengthwise exited %s", code)
        return code, "\n".join(kept)

    def _log_line(self, line: str) -> None:
        self.log.info("%s", line)

    def on_kill(self) -> None:
        child = getattr(self, "_child", None)
        if child is None or self._child_exited.is_set():
            return
        self.log.info("stopping lengthwise (pid %s) with SIGTERM; committed shards stay, a rerun resumes", child.pid)
        code = stop_child(child, self._child_exited, self.kill_timeout)
        self.log.info("lengthwise stopped with exit %s", code)


class LengthwiseRunOperator(_LengthwiseCommand, BaseOperator):
    """`lengthwise run` as a task; returns the run's summary (→ XCom `return_value`).

    `input`, `output`, `job` and every other keyword are `pipeline.api.run`'s (`max_length=128`,
    `keep_columns=["label"]`, `threshold={"toxic": 0.8}`, `config="/srv/…/nightly.toml"`,
    `num_shards=3, shard_index=1`), all templated. Exit 2 fails without retry; 1, 4 and an
    interruption are retried (a retry resumes from the committed shards)."""

    template_fields: Sequence[str] = ("options",)  # `output` is BaseOperator's XComArg: the keywords live here
    template_fields_renderers = {"options": "json"}
    ui_color = "#d8e8f8"

    @with_option_keywords
    def __init__(self, *, input: str | list[str] | None = None, output: str | None = None, job: str = "embed",
                 executable: str | Sequence[str] | None = None, kill_timeout: float = DEFAULT_KILL_TIMEOUT_S,
                 **kwargs) -> None:
        options = {name: kwargs.pop(name) for name in list(kwargs) if name in OPTION_NAMES}
        super().__init__(**kwargs)
        self.options = {name: value for name, value in {"input": input, "output": output, "job": job, **options}.items()
                        if value is not None}
        self.executable, self.kill_timeout = executable, kill_timeout

    def execute(self, context) -> dict:
        with tempfile.TemporaryDirectory(prefix="lengthwise-airflow-") as scratch:
            summary_path = self.options.get("summary_json") or str(Path(scratch) / "summary.json")
            try:
                arguments = run_arguments({**self.options, "summary_json": summary_path})
            except UsageError as error:
                raise AirflowFailException(f"usage error: {error}") from None
            code, _ = self.run_command(arguments)
            summary = read_summary(summary_path)
        if code == 0:
            if summary is None:
                raise AirflowException(f"lengthwise exited 0 but wrote no summary at {summary_path}")
            self.log.info("%s rows this run, %s in the output", summary.get("rows"),
                          (summary.get("output_totals") or {}).get("rows"))
            return summary
        reason = failed_shards_line(summary) or "see the log above for its one-line error"
        if run_exit_is_final(code):
            raise AirflowFailException(f"lengthwise run exited {code} (usage error: fix the settings; not retried): "
                                       f"{reason}")
        raise AirflowException(f"lengthwise run exited {code}; a retry redoes only what is not committed: {reason}")


def read_summary(path: str) -> dict | None:
    """The `--summary-json` file, or None when the run wrote none (a usage error writes nothing)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


class LengthwiseVerifyOperator(_LengthwiseCommand, BaseOperator):
    """`lengthwise verify --json` as a task: returns its report when the output is complete (every
    input id exactly once, in order, under the recorded settings). Exit 1 (not complete) and 2 (no
    run there) fail without retry, since a second look finds the same rows; 4 is retried."""

    template_fields: Sequence[str] = ("output_url", "input", "storage_option")  # `output`: BaseOperator's XComArg
    ui_color = "#e0f0d8"

    def __init__(self, *, output: str, input: str | list[str] | None = None, storage_option=None,
                 executable: str | Sequence[str] | None = None, kill_timeout: float = DEFAULT_KILL_TIMEOUT_S,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.output_url, self.input, self.storage_option = output, input, storage_option
        self.executable, self.kill_timeout = executable, kill_timeout

    def execute(self, context) -> dict:
        code, stdout = self.run_command(verify_arguments(self.output_url, self.input, self.storage_option), keep_stdout=True)
        report = parse_json_answer(stdout)
        if code == 0 and report is not None:
            return report
        problems = verify_problems(report)
        message = f"lengthwise verify exited {code}: " + ("; ".join(problems[:5]) or "see the log above")
        if verify_exit_is_final(code):
            raise AirflowFailException(message)
        raise AirflowException(message)


def verify_problems(report: dict | None) -> list[str]:
    """The problems a `verify --json` report names, shard by shard, for the failure's message."""
    if not report:
        return []
    found = [f"{shard.get('shard')}: {problem}" for shard in report.get("shards", []) for problem in shard.get("problems", [])]
    found += [f"partial file {path}" for path in report.get("partial_files", [])]
    return found + [f"unexpected output {path}" for path in report.get("unexpected_outputs", [])]


class LengthwiseStatusTrigger(BaseTrigger):
    """Polls `lengthwise status --json` in the triggerer every `poke_interval` seconds and fires
    once every shard is done, with the status as the event's payload. `argv` is the whole status
    command line, so the triggerer needs only this module, not the operator's settings."""

    def __init__(self, argv: list[str], poke_interval: float = 60.0) -> None:
        super().__init__()
        self.argv, self.poke_interval = list(argv), float(poke_interval)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return TRIGGER_PATH, {"argv": self.argv, "poke_interval": self.poke_interval}

    async def run(self):
        while True:
            code, stdout, stderr = await run_async(self.argv)
            status = parse_json_answer(stdout)
            if status_is_complete(code, status):
                yield TriggerEvent({"complete": True, "status": status})
                return
            self.log.info("not complete yet: %s", status_line(code, status, stderr))
            await asyncio.sleep(self.poke_interval)


async def run_async(argv: list[str]) -> tuple[int, str, str]:
    """Run a command without blocking the triggerer's event loop; its exit code, stdout and stderr.
    A cancelled wait (the trigger timed out or was removed) kills the command, leaving no orphan."""
    process = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        stdout, stderr = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return process.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace")


class LengthwiseCompleteSensor(_LengthwiseCommand, BaseSensorOperator):
    """Waits until `lengthwise status --output OUTPUT --json` counts every shard done (an output
    with no run yet, shards pending or failed: not yet) and returns that status (→ XCom).

    `deferrable=True` (the default) checks once, then defers to `LengthwiseStatusTrigger`, which
    polls in the triggerer and frees the worker slot; `deferrable=False` pokes in
    `mode="reschedule"` unless another mode is given."""

    template_fields: Sequence[str] = ("output_url", "storage_option")  # `output`: BaseOperator's XComArg
    ui_color = "#f0e8d0"

    def __init__(self, *, output: str, storage_option=None, executable: str | Sequence[str] | None = None,
                 deferrable: bool = True, kill_timeout: float = DEFAULT_KILL_TIMEOUT_S, **kwargs) -> None:
        if not deferrable:
            kwargs.setdefault("mode", "reschedule")
        super().__init__(**kwargs)
        self.output_url, self.storage_option, self.deferrable = output, storage_option, deferrable
        self.executable, self.kill_timeout = executable, kill_timeout

    def status_argv(self) -> list[str]:
        return [*command_prefix(self.executable), *status_arguments(self.output_url, self.storage_option)]

    def check(self) -> tuple[bool, dict | None]:
        """One `status --json`: whether it is complete, and the status."""
        completed = subprocess.run(self.status_argv(), stdin=subprocess.DEVNULL, capture_output=True, text=True)
        status = parse_json_answer(completed.stdout)
        self.log.info("%s", status_line(completed.returncode, status, completed.stderr))
        return status_is_complete(completed.returncode, status), status

    def poke(self, context) -> PokeReturnValue:
        complete, status = self.check()
        return PokeReturnValue(is_done=complete, xcom_value=status)

    def execute(self, context) -> Any:
        if not self.deferrable:
            return super().execute(context)
        complete, status = self.check()
        if complete:
            return status
        self.defer(trigger=LengthwiseStatusTrigger(self.status_argv(), self.poke_interval),
                   method_name="execute_complete", timeout=timedelta(seconds=self.timeout))

    def execute_complete(self, context, event: dict | None = None) -> dict:
        if not event or not event.get("complete"):
            raise AirflowException(f"the status trigger ended without a complete output: {event!r}")
        self.log.info("%s", status_line(0, event["status"]))
        return event["status"]
