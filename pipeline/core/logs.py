"""The one logger setup: lengthwise's messages (pipeline.*, jobs.*) on stderr, bare, and without
the credentials a URL may carry. The CLI and `pipeline.api.run` (quiet=, verbose=) call it."""

from __future__ import annotations

import logging
import sys

from pipeline.core.redact import redact_text


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is logged (click's test runner swaps it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


class _RedactingFormatter(logging.Formatter):
    """Bare messages, with credentials in URLs (userinfo, signed query parameters) taken out."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))


def configure_logging(level: int) -> None:
    handler = _CurrentStderr()
    handler.setFormatter(_RedactingFormatter("%(message)s"))
    for name in ("pipeline", "jobs"):
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.setLevel(level)
        logger.propagate = False
