"""Arrow IPC stream shards: the files of a Hugging Face `Dataset.save_to_disk` folder (its
`state.json` lists them; `DatasetDict.save_to_disk` has one such folder per split)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pyarrow as pa

from pipeline.core.errors import UsageError
from pipeline.offline.readers.base import Columns, ShardFacts

NAME = "an Arrow stream"
SUFFIXES = (".arrow",)
IN_FOLDERS = False  # a shard only as a file its `datasets` folder lists (a folder's loose .arrow files are caches)
COUNTED_BY = "the footer"


def is_saved_dataset(fs, path: str) -> bool:
    """A folder `Dataset.save_to_disk` or `DatasetDict.save_to_disk` wrote."""
    return fs.isdir(path) and (fs.exists(f"{path}/state.json") or fs.exists(f"{path}/dataset_dict.json"))


def saved_dataset_files(fs, path: str, pattern: str, split: str | None) -> list[str]:
    """The Arrow files of a `Dataset.save_to_disk` folder (state.json lists them), or of one
    split of a `DatasetDict.save_to_disk` folder (dataset_dict.json lists the splits)."""
    if fs.exists(f"{path}/dataset_dict.json"):
        with fs.open(f"{path}/dataset_dict.json", "r") as f:
            splits = json.load(f)["splits"]
        if split not in splits:
            raise UsageError(f"{pattern!r} is a DatasetDict with splits {', '.join(splits)}; "
                             f"{'choose one with --split' if split is None else f'--split {split} is not one of them'}")
        path, split = f"{path}/{split}", None
    if split is not None:
        raise UsageError(f"{pattern!r} is a single Dataset, not a DatasetDict; drop --split {split}")
    with fs.open(f"{path}/state.json", "r") as f:
        return [f"{path}/{item['filename']}" for item in json.load(f)["_data_files"]]


def count_rows(f, url: str, columns: Columns) -> ShardFacts:
    """An IPC stream has no footer: its batches are counted, read through once."""
    stream = pa.ipc.open_stream(f)
    return ShardFacts(sum(batch.num_rows for batch in stream), {field.name: field.type for field in stream.schema})


def open_batches(f, url: str, columns: Columns, block_rows: int) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """The stream's schema and its record batches of the named columns, at most `block_rows` rows each."""
    stream = pa.ipc.open_stream(f)

    def batches() -> Iterator[pa.RecordBatch]:
        for batch in stream:
            batch = batch.select(columns.names)
            for start in range(0, batch.num_rows, block_rows):
                yield batch.slice(start, block_rows)

    return stream.schema, batches()
