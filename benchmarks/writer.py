"""Output writer speed: rows/s that one thread encodes into Parquet, for the embed job's rows
(an id, a 384-float embedding, truncated, error), by dictionary encoding and compression.

    .venv/bin/python benchmarks/writer.py --rows 200000 --json benchmarks/results/writer.json
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.offline.sink import parquet_writer_options


def embed_rows(rows: int, width: int) -> pa.Table:
    rng = np.random.default_rng(0)
    values = rng.standard_normal((rows, width), dtype=np.float32)
    values /= np.linalg.norm(values, axis=1, keepdims=True)
    return pa.table({"id": pa.array([f"row-{i:09d}" for i in range(rows)]),
                     "embedding": pa.FixedSizeListArray.from_arrays(pa.array(values.ravel()), width),
                     "truncated": pa.array(np.zeros(rows, bool)), "error": pa.nulls(rows, pa.string())})


def write_figures(table: pa.Table, block_rows: int, **options) -> dict:
    sink = io.BytesIO()
    started = time.perf_counter()
    with pq.ParquetWriter(sink, table.schema, **options) as writer:
        for start in range(0, table.num_rows, block_rows):
            writer.write_table(table.slice(start, block_rows))
    seconds = time.perf_counter() - started
    return {"rows_per_s": round(table.num_rows / seconds), "bytes_per_row": round(sink.tell() / table.num_rows, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--block-rows", type=int, default=8192)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    table = embed_rows(args.rows, args.width)
    chosen = parquet_writer_options(table.schema)
    cases = {"dictionary on every column, zstd (before)": {"compression": "zstd"},
             "dictionary on every column, no compression": {"compression": "none"},
             f"chosen: {chosen}": chosen,
             "no dictionary, zstd": {"compression": "zstd", "use_dictionary": False},
             "no dictionary, zstd level 1": {"compression": "zstd", "compression_level": 1, "use_dictionary": False},
             "no dictionary, byte stream split, zstd level 1": {"compression": "zstd", "compression_level": 1,
                                                                "use_dictionary": False,
                                                                "use_byte_stream_split": ["embedding"]},
             "no dictionary, lz4": {"compression": "lz4", "use_dictionary": False},
             "no dictionary, snappy": {"compression": "snappy", "use_dictionary": False},
             "no dictionary, no compression": {"compression": "none", "use_dictionary": False}}
    results = []
    for name, options in cases.items():
        figures = write_figures(table, args.block_rows, **options)
        results.append({"case": name, **figures})
        print(f"{name:60s} {figures['rows_per_s']:>10,} rows/s {figures['bytes_per_row']:>8} bytes/row")
    if args.json:
        args.json.write_text(json.dumps({"rows": args.rows, "width": args.width, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
