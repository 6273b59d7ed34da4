"""Which done markers a shard's output file still backs: checked from one listing of the output and, only
where a file's size is not the one its marker recorded, the file's footer; never the data (`verify` reads
the ids)."""

from __future__ import annotations

from collections.abc import Callable

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.offline.locations import shown_path
from pipeline.offline.source import Shard


def output_file_problem(marker: dict, found: dict | None, footer_rows: Callable[[], int]) -> str | None:
    """Why a done shard's output file does not hold what its marker recorded, or None; cheap enough for a
    `status` of 10,000 shards, and no audit (`verify` reads the ids). `found` is the file's entry in a
    listing of the output (fsspec's info: name as shown, type, size; None: not listed). Its size is checked
    against the `bytes` the marker recorded at the commit; only where they differ (a file rewritten since,
    or a marker from before sizes) is `footer_rows()` asked for the footer's row count, never the data. A
    file that is not Parquet (garbage, cut short, empty) or a folder in its place is a fault for a run to
    repair, never an exception."""
    if found is None:
        return "its output file is missing"
    if found["type"] != "file":
        return f"its output file {found['name']} is a folder, not a Parquet file"
    if marker.get("bytes") == found["size"]:
        return None
    try:
        rows = footer_rows()
    except pa.ArrowException as error:
        cause = str(error).splitlines()[0] if str(error) else "no message"
        return f"its output file {found['name']} is not readable Parquet ({type(error).__name__}: {cause})"
    if marker.get("rows") is not None and rows != marker["rows"]:
        return f"its output file has {rows:,} rows and the input shard {marker['rows']:,}"
    return None


def done_marker_problem(marker: dict, input_rows: int, found: dict | None, footer_rows: Callable[[], int]) -> str | None:
    """Why a done marker cannot be trusted, or None: it counts only with its output file, holding
    the input shard's rows (output_file_problem)."""
    if marker.get("rows") is not None and marker["rows"] != input_rows:
        return f"it records {marker['rows']:,} rows and the input shard now has {input_rows:,}"
    return output_file_problem({**marker, "rows": input_rows}, found, footer_rows)


def listed_outputs(fs: fsspec.AbstractFileSystem, output_dir: str) -> dict[str, dict]:
    """Shard stem → the listing's entry (fsspec's info) of each `STEM.parquet` below the output, a
    folder of that name included: one listing for every shard, no request per shard."""
    found = fs.find(output_dir, detail=True, withdirs=True)
    return {relative[:-len(".parquet")]: info for path, info in found.items()
            if (relative := path[len(output_dir) + 1:]).endswith(".parquet")
            and not relative.rsplit("/", 1)[-1].startswith(".")}


def footer_rows(fs: fsspec.AbstractFileSystem, path: str) -> int:
    """The row count in a Parquet file's footer (the data is not read)."""
    with fs.open(path, "rb") as f:
        return pq.ParquetFile(f).metadata.num_rows


def untrusted_done_markers(fs: fsspec.AbstractFileSystem, shards: list[Shard], markers: dict[str, dict],
                           listed: dict[str, dict]) -> dict[str, str]:
    """Stem → why its done marker is not backed by its output in `listed` (listed_outputs): a file
    deleted, cut short or replaced by hand, a folder in its place, an input shard rewritten since.
    Such a shard is not done: `status` counts it pending and a run redoes it."""
    problems = {}
    for shard in shards:
        marker = markers.get(shard.stem, {})
        if marker.get("status") != "done":
            continue
        found = listed.get(shard.stem)
        path = found["name"] if found else None
        shown = {**found, "name": shown_path(fs, path)} if found else None  # as the messages name it
        problem = done_marker_problem(marker, shard.num_rows, shown, lambda: footer_rows(fs, path))
        if problem:
            problems[shard.stem] = problem
    return problems
