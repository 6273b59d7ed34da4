"""Where a command reads and writes, checked before anything is written: input and output may not
overlap (an output inside its input is read back as input on the next run; an output equal to
its input renames every result over its input shard), no other path a command writes (a summary,
a CSV, a plot, a plan cache) lies in what it reads or in the output, and no location carries
credentials.

A location is compared as (store, path parts): local paths with symlinks and `..` resolved, URLs
by their filesystem and bucket/prefix, a glob by its folder before the first wildcard.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Iterable, Mapping

import fsspec
from fsspec.implementations.local import LocalFileSystem

from pipeline.core.errors import UsageError
from pipeline.core.redact import redact_url

GLOB_CHARACTERS = "*?["
MANIFEST_DIR = ".lengthwise"  # an output's manifest: hidden, so readers of the output folder (datasets, Spark) skip it
LEGACY_MANIFEST_DIR = "_lengthwise"  # where outputs made before the rename keep theirs


def location_parts(url: str, storage_options: dict, literal: bool = False) -> tuple[str, tuple[str, ...]]:
    """(store, path parts) of a directory, file or glob: what two locations are compared by.
    `literal`: a path to write, whose wildcard characters are part of its name, not a pattern."""
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    if not literal and any(ch in path for ch in GLOB_CHARACTERS):
        path = path[:min(path.index(ch) for ch in GLOB_CHARACTERS if ch in path)].rpartition("/")[0] or "/"
    if isinstance(fs, LocalFileSystem):
        path = os.path.realpath(path)
    store = type(fs).__module__ + "." + type(fs).__qualname__
    return store, tuple(part for part in path.replace("\\", "/").split("/") if part not in ("", "."))


def contains(outer: tuple[str, tuple[str, ...]], inner: tuple[str, tuple[str, ...]]) -> bool:
    """Whether location `inner` is `outer` or below it (whole path parts: `d2` is not in `d`)."""
    return outer[0] == inner[0] and inner[1][:len(outer[1])] == outer[1]


def overlap_problem(inputs: Iterable[str], output: str, storage_options: dict) -> str | None:
    """Why `output` may not be written with these inputs, or None when it is apart from all of them."""
    try:
        written = location_parts(output, storage_options)
    except (ImportError, ValueError, OSError):  # not a location fsspec knows: the output check says so
        return None
    for url in inputs:
        try:
            read = location_parts(url, storage_options)
        except (ImportError, ValueError, OSError):  # the listing says what is wrong with it
            continue
        if contains(read, written) and contains(written, read):
            return (f"--output {redact_url(output)} is the input {redact_url(url)}: its results would replace "
                    f"the input shards; choose an --output outside the input")
        if contains(read, written):
            return (f"--output {redact_url(output)} is inside the input {redact_url(url)}: the next run would read "
                    f"its results as input; choose an --output outside the input")
        if contains(written, read):
            return (f"the input {redact_url(url)} is inside --output {redact_url(output)}: its shards would be "
                    f"overwritten and listed as outputs; choose an --output outside the input")
    return None


def same_location(first: str, second: str, storage_options: dict) -> bool:
    """Whether two locations are one, through symlinks, `..` and a trailing slash (False when
    either is not a location fsspec knows: opening it says what is wrong)."""
    try:
        return location_parts(first, storage_options) == location_parts(second, storage_options)
    except (ImportError, ValueError, OSError):
        return False


def written_path_problem(flag: str, path: str, inputs: Mapping[str, Iterable[str]], output: str | None,
                         storage_options: dict) -> str | None:
    """Why `path`, which `flag` writes, may not be written: it is an input (by flag: --input, --reuse,
    --model, --compare), or lies inside one or inside `output`. The one place allowed inside the output
    is an entry directly in it whose name starts with `.` (readers of the output skip it), but not the
    manifest. None when the path is apart from all of them."""
    try:
        written = location_parts(path, storage_options, literal=True)
    except (ImportError, ValueError, OSError):  # not a location fsspec knows: writing it says so
        return None
    shown = f"{flag} {redact_url(path)}"
    for input_flag, urls in inputs.items():
        named = "the input" if input_flag == "--input" else input_flag
        for url in urls:
            try:
                read = location_parts(url, storage_options)
            except (ImportError, ValueError, OSError):  # reading it says what is wrong with it
                continue
            if read == written:
                return f"{shown} is {named} {redact_url(url)}: writing it would destroy it; choose a path outside it"
            if contains(read, written):
                return (f"{shown} is inside {named} {redact_url(url)}: it could replace what is read there, or be "
                        f"read as it; choose a path outside it")
    if output:
        try:
            out = location_parts(output, storage_options)
        except (ImportError, ValueError, OSError):  # the output check says so
            return None
        if contains(out, written) and not is_hidden_entry_of(out, written):
            where = "--output" if written == out else "inside --output"
            return (f"{shown} is {where} {redact_url(output)}: readers of the output, or the run's own "
                    f"records, would take it for theirs; choose a path outside it, or directly in it a name "
                    f"starting with `.` ({redact_url(output.rstrip('/'))}/.{hidden_name(flag, written, out)})")
    return None


def is_hidden_entry_of(output: tuple[str, tuple[str, ...]], written: tuple[str, tuple[str, ...]]) -> bool:
    """Whether `written` is directly in `output` with a name starting with `.`, other than the manifest's:
    where the output's readers (pyarrow, datasets, Spark) and `verify` look past it."""
    name = written[1][-1] if len(written[1]) == len(output[1]) + 1 else ""
    return name.startswith(".") and name != MANIFEST_DIR


def hidden_name(flag: str, written: tuple[str, tuple[str, ...]], output: tuple[str, tuple[str, ...]]) -> str:
    """The name, without its leading `.`, that a refusal suggests for `written` in the output: its own
    (`_summary.json` → `summary.json`), else the flag's where it has none apart from the output or the manifest's."""
    name = written[1][-1].lstrip("_.") if written != output else ""
    return name if name and name != MANIFEST_DIR.lstrip(".") else flag.lstrip("-")


def check_written_paths(written: Iterable[tuple[str, str | None]], inputs: Mapping[str, Iterable[str | None]],
                        output: str | None, storage_options: dict) -> None:
    """Refuse (UsageError, before anything is written) the first path a command would write that is an
    input, lies inside one or inside the output (`written_path_problem`). `written`: (flag, path) of each
    path the command writes, None where it is not given; `inputs`: flag → what it reads."""
    named_inputs = {flag: [url for url in urls if url] for flag, urls in inputs.items()}
    for flag, path in written:
        problem = path and written_path_problem(flag, str(path), named_inputs, output, storage_options)
        if problem:
            raise UsageError(problem)


def has_userinfo(url: str) -> bool:
    return "://" in url and "@" in urllib.parse.urlsplit(url).netloc


def check_locations(inputs: Iterable[str], output: str, storage_options: dict,
                    reuse: str | None = None) -> None:
    """Refuse (UsageError, before anything is written) an output that overlaps an input, and URLs
    that carry credentials (they would end up in logs and run.json; fsspec's object stores take
    them from the environment or --storage-option)."""
    inputs = list(inputs)
    for flag, url in [*(("--input", u) for u in inputs), ("--output", output), ("--reuse", reuse)]:
        if url and has_userinfo(url):
            raise UsageError(f"{flag} {redact_url(url)} carries credentials in its URL (user:password@); pass them "
                             "through the environment or --storage-option instead")
    problem = overlap_problem(inputs, output, storage_options)
    if problem:
        raise UsageError(problem)


def outside_outputs(fs: fsspec.AbstractFileSystem, paths: list[str], root: str,
                    listed: Iterable[str] | None = None) -> list[str]:
    """`paths` (found below the input's `root`) without those in a folder below the root that holds
    an output's manifest: an earlier run's results are not input. `listed`: every file under the
    root where the listing already has them (a directory's find), else each folder is looked up."""
    if listed is not None:
        markers = {f"/{name}/run.json" for name in (MANIFEST_DIR, LEGACY_MANIFEST_DIR)}
        outputs = {path.rsplit("/", 2)[0] for path in listed if any(path.endswith(m) for m in markers)}
    else:
        folders = {folder for path in paths for folder in _folders_between(root, path)}
        outputs = {folder for folder in folders
                   if any(fs.exists(f"{folder}/{name}/run.json") for name in (MANIFEST_DIR, LEGACY_MANIFEST_DIR))}
    outputs.discard(root)  # the input itself may be an earlier run's output (a second job over its results)
    return [path for path in paths if not any(path.startswith(folder + "/") for folder in outputs)]


def _folders_between(root: str, path: str) -> list[str]:
    """The folders strictly below `root` that hold `path`."""
    below = path[len(root) + 1:].split("/")[:-1] if path.startswith(root + "/") else []
    return [f"{root}/{'/'.join(below[:depth])}" for depth in range(1, len(below) + 1)]


def shown_path(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """`path` as the user wrote it: with its protocol (s3://…) unless it is a local file."""
    return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)
