"""Errors a user can fix (exit code 2), storage that refuses the output for good (exit code 4),
and what a storage call's OSError means."""

from __future__ import annotations

import errno

from pipeline.core.retry import is_transient


class UsageError(Exception):
    """A configuration or input problem; the message says what to change."""


class StorageError(Exception):
    """Storage refused the run's output for good (no space, no permission, an object store that
    kept failing through its retries): the run stops; committed shards stay, no partial file is
    left and a rerun resumes. The message names the path, the cause and what to do."""


NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
DENIED_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}
MORE_S3_RETRIES = """--storage-option 'config_kwargs={"retries": {"max_attempts": 10, "mode": "adaptive"}}'"""
RERUN = "then rerun the same command: committed shards are kept and it resumes"


def as_storage_error(error: BaseException, path: str) -> StorageError | None:
    """The StorageError that `error`, raised writing `path`, stands for; None when it is not a
    storage fault (a bug, a bad row) and should pass as it is."""
    if isinstance(error, StorageError):
        return error
    cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no message'}"
    code = getattr(error, "errno", None)
    if code in NO_SPACE_ERRNOS:
        return StorageError(f"{path}: no space left ({cause}); free space there or choose another --output, "
                            f"{RERUN}")
    if isinstance(error, PermissionError) or code in DENIED_ERRNOS:
        return StorageError(f"{path}: permission denied ({cause}); make the output writable for this user (its "
                            f"mode, an immutable flag shown by `lsattr`, a read-only mount, the bucket policy) or "
                            f"choose another --output, {RERUN}")
    if is_transient(error):
        return StorageError(f"{path}: the object store kept failing through its retries ({cause}); wait for it to "
                            f"recover (or allow more retries, for s3: {MORE_S3_RETRIES}), {RERUN}")
    return None
