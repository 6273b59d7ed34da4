"""Errors a user can fix (exit code 2), storage that refuses the output for good (exit code 4),
and what a storage call's error means."""

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
# By name, so that core needs no botocore (or google-auth) to tell them: no credentials to sign with…
MISSING_CREDENTIALS_ERRORS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                              "DefaultCredentialsError"}
# …and an object store that cannot be reached at all (botocore has retried the connection already)
UNREACHABLE_ERRORS = {"EndpointConnectionError", "ConnectTimeoutError", "ProxyConnectionError"}


def _names(error: BaseException) -> set[str]:
    return {kind.__name__ for kind in type(error).__mro__}


def _cause(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no message'}"


def as_credentials_error(error: BaseException, path: str) -> UsageError | None:
    """The usage error (exit 2) that `error`, raised reaching `path`, stands for when the object
    store client found no credentials; None for any other error."""
    if not _names(error) & MISSING_CREDENTIALS_ERRORS:
        return None
    return UsageError(f"{path}: no credentials for the object store ({_cause(error)}); set them in the environment "
                      "(for s3: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) or in the storage "
                      "options (--storage-option key=… --storage-option secret=…; anon=true for a public bucket)")


def as_storage_error(error: BaseException, path: str) -> StorageError | None:
    """The StorageError that `error`, raised writing `path`, stands for; None when it is not a
    storage fault (a bug, a bad row) and should pass as it is."""
    if isinstance(error, StorageError):
        return error
    cause = _cause(error)
    code = getattr(error, "errno", None)
    if code in NO_SPACE_ERRNOS:
        return StorageError(f"{path}: no space left ({cause}); free space there or choose another --output, "
                            f"{RERUN}")
    if isinstance(error, PermissionError) or code in DENIED_ERRNOS:
        return StorageError(f"{path}: permission denied ({cause}); make the output writable for this user (its "
                            f"mode, an immutable flag shown by `lsattr`, a read-only mount, the bucket policy) or "
                            f"choose another --output, {RERUN}")
    if _names(error) & UNREACHABLE_ERRORS:
        return StorageError(f"{path}: cannot reach the object store ({cause}); check its address (--storage-option "
                            f"endpoint_url=…) and the network, or wait for it to come back, {RERUN}")
    if is_transient(error):
        return StorageError(f"{path}: the object store kept failing through its retries ({cause}); wait for it to "
                            f"recover (or allow more retries, for s3: {MORE_S3_RETRIES}), {RERUN}")
    return None
