"""The `lengthwise` command line.

Every option comes, in this order of precedence, from its flag, from its
LENGTHWISE_<NAME> environment variable, from the TOML file given with --config, or from
its default (defined once, in `pipeline/core/settings.py`; what each takes in `pipeline/core/values.py`;
each command's options declared in a table: `run`'s, `status`'s and `verify`'s in `pipeline/offline/options.py`,
`plan`'s, `sweep`'s and `loadtest`'s in `pipeline/tuning/options.py`). Exit codes: `pipeline/core/exit_codes.py`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

import click

from pipeline.cli.job_commands import plan, run, status, verify
from pipeline.cli.options import COMMANDS
from pipeline.cli.tuning_commands import loadtest, sweep
from pipeline.core.exit_codes import INTERRUPTED_BY_SIGINT, INTERRUPTING_SIGNALS
from pipeline.core.logs import configure_logging
from pipeline.core.redact import redact_text


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="lengthwise")
def cli() -> None:
    """Offline batch inference over Parquet shards, with length-bucketed batches."""
    configure_logging(logging.INFO)


for command in (run, plan, sweep, loadtest, status, verify):
    cli.add_command(command)
    COMMANDS[command.name] = command


class Interrupted(BaseException):
    """Raised in the main thread by SIGINT/SIGTERM so that cleanup runs (no partial output)."""

    def __init__(self, signal_number: int):
        super().__init__(signal.Signals(signal_number).name)
        self.exit_code = INTERRUPTING_SIGNALS[signal_number]


def _raise_interrupted(signal_number, frame) -> None:
    signal.signal(signal_number, signal.SIG_DFL)  # a second signal ends the process at once
    raise Interrupted(signal_number)


def _print_redacted_traceback(kind, value, trace) -> None:
    """An unexpected error's traceback (exit 1), without the credentials a URL in it may carry."""
    sys.stderr.write(redact_text("".join(traceback.format_exception(kind, value, trace))))


def main() -> None:
    sys.excepthook = _print_redacted_traceback
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local folders; never reach for a hub
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for signal_number in INTERRUPTING_SIGNALS:
        signal.signal(signal_number, _raise_interrupted)
    try:
        cli.main(standalone_mode=False)
    except Interrupted as interrupted:
        click.echo(f"interrupted by {interrupted}; committed shards are kept, no partial file is left", err=True)
        sys.exit(interrupted.exit_code)
    except click.exceptions.Abort:
        sys.exit(INTERRUPTED_BY_SIGINT)
    except click.ClickException as error:
        error.message = redact_text(error.message)
        error.show()
        sys.exit(error.exit_code)
