"""Keeping credentials out of what lengthwise records and prints.

A run's config is saved beside its outputs (`run.json`, readable by whoever reads the bucket) and
its messages go to logs that outlive the night. Storage options can carry secrets at any depth
(`client_kwargs={"aws_secret_access_key": …}`, an Azure `connection_string`, `headers`) and URLs
can carry them in their userinfo (`s3://KEY:SECRET@bucket`) or a signed query string. So a recorded
option keeps its value only under a key known to be harmless; every other value is replaced, and
URLs lose their userinfo and their signing parameters wherever they are shown.
"""

from __future__ import annotations

import re
import urllib.parse

REDACTED = "<redacted>"

# Storage option keys whose values are never secret (at any depth: s3fs's own, botocore's client config, the other
# fsspec backends' locations). A value under any other key is recorded as REDACTED.
HARMLESS_OPTION_KEYS = frozenset({
    "anon", "endpoint_url", "region_name", "region", "use_ssl", "verify", "requester_pays", "version_aware",
    "cache_regions", "default_block_size", "default_fill_cache", "default_cache_type", "max_concurrency",
    "fixed_upload_size", "skip_instance_cache", "use_listings_cache", "listings_expiry_time",
    "client_kwargs", "config_kwargs", "retries", "max_attempts", "mode", "total_max_attempts",
    "connect_timeout", "read_timeout", "max_pool_connections", "signature_version", "s3", "addressing_style",
    "project", "location", "account_name", "host", "port", "auto_mkdir", "timeout", "block_size",
})

# Query parameters of signed URLs (AWS SigV2/V4, GCS, Azure SAS) and generic credentials in a query string.
SECRET_QUERY_PARAMETER = re.compile(r"(signature|credential|token|secret|password|passwd|key|auth|^sig$)", re.I)
# scheme://user:password@host — in free text (an exception's message, a log line)
URL_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<userinfo>[^/\s@'\"]+@)")
URL_IN_TEXT = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^\s'\"]+")


def redact_url(url: str) -> str:
    """`url` without userinfo and without the query parameters that sign or authenticate it."""
    if "://" not in url:
        return url
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    query = urllib.parse.urlencode([(name, value) for name, value in
                                    urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
                                    if not SECRET_QUERY_PARAMETER.search(name)], safe="/:")
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> str:
    """Every URL in `text` (a message, an exception) redacted as `redact_url` does."""
    return URL_IN_TEXT.sub(lambda match: redact_url(match.group(0)), URL_USERINFO.sub(r"\g<scheme>", text))


def recordable_options(options):
    """Storage options as they may be recorded: the values of harmless keys kept (URLs redacted),
    tables walked key by key, every other value replaced by REDACTED."""
    if not isinstance(options, dict):
        return REDACTED
    recorded = {}
    for key, value in options.items():
        if isinstance(value, dict) and str(key) in HARMLESS_OPTION_KEYS:
            recorded[key] = recordable_options(value)
        elif str(key) in HARMLESS_OPTION_KEYS and not isinstance(value, (dict, list)):
            recorded[key] = redact_url(value) if isinstance(value, str) else value
        else:
            recorded[key] = REDACTED
    return recorded


def usable_recorded_options(recorded: dict) -> dict:
    """Recorded storage options with the redacted values left out, so that `status` and `verify`
    reach the same store (endpoint, region) with the caller's own credentials."""
    return {key: usable_recorded_options(value) if isinstance(value, dict) else value
            for key, value in recorded.items() if value != REDACTED}
