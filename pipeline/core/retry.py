"""Retries of named transient errors (object-store timeouts, throttling) with capped exponential backoff."""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


# EBUSY: what s3fs makes of SlowDown, ServiceUnavailable and OperationAborted
TRANSIENT_ERRNOS = {errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE,
                    errno.EAGAIN, errno.EBUSY}
# Names and messages of object-store errors that mean "try again later": throttling, 5xx, timeouts.
TRANSIENT_MARKERS = ("SlowDown", "Throttl", "RequestTimeout", "ServiceUnavailable", "InternalError",
                     "TooManyRequests", "(500)", "(502)", "(503)", "(504)", "timed out", "Timeout",
                     "Connection reset", "RemoteDisconnected", "reduce your request rate")


def is_transient(error: BaseException) -> bool:
    """A timeout, a dropped connection, throttling or a 5xx answer from an object store.
    A missing file, a permission problem or corrupt data is not: retrying cannot help."""
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(error, (TimeoutError, ConnectionError)):
        return True
    if isinstance(error, OSError) and error.errno in TRANSIENT_ERRNOS:
        return True
    text = f"{type(error).__name__}: {error}"
    return any(marker in text for marker in TRANSIENT_MARKERS)


def backoff_delay_s(attempt: int, base_delay_s: float = 0.5, max_delay_s: float = 20.0) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(max, base·2^(attempt−1))]."""
    return random.uniform(0, min(max_delay_s, base_delay_s * 2 ** (attempt - 1)))


def retry_transient(operation: Callable[[], T], what: str, attempts: int = 5, base_delay_s: float = 0.5,
                    max_delay_s: float = 20.0, sleep: Callable[[float], None] = time.sleep,
                    log: Callable[[str], None] | None = None) -> T:
    """Run `operation`, retrying transient errors with exponential backoff and full jitter,
    at most `attempts` times; any other error, or the last transient one, is raised."""
    for attempt in range(1, attempts + 1):
        try:
            return operation()
        except Exception as error:
            if attempt == attempts or not is_transient(error):
                raise
            delay = backoff_delay_s(attempt, base_delay_s, max_delay_s)
            if log:
                log(f"{what}: {type(error).__name__}: {error}; retry {attempt}/{attempts - 1} in {delay:.1f}s")
            sleep(delay)
    raise AssertionError("unreachable")
