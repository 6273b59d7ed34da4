"""Output writer speed: rows/s that one thread on one core encodes into Parquet, for the embed
job's rows (an id, a 384-float embedding, truncated, error), by dictionary encoding and
compression; best of --repeats passes per case, the cases interleaved.

    .venv/bin/python benchmarks/writer.py --rows 200000 --json benchmarks/results/writer.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.offline.encoder import parquet_writer_options


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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    # one core, as the run's one writer thread has: Arrow's own thread pools would otherwise lend it more
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    table = embed_rows(args.rows, args.width)
    chosen = parquet_writer_options(table.schema)
    cases = {"dictionary on every column, zstd": {"compression": "zstd"},
             "dictionary on text columns, zstd (before)": {"compression": "zstd",
                                                           "use_dictionary": chosen["use_dictionary"]},
             "chosen: dictionary on text columns, zstd but float vectors": chosen,
             "no dictionary, zstd": {"compression": "zstd", "use_dictionary": False},
             # the element's path: the list column's own name leaves its floats unsplit
             "no dictionary, byte stream split, zstd": {"compression": "zstd", "use_dictionary": False,
                                                        "use_byte_stream_split": ["embedding.list.element"]},
             "no dictionary, lz4": {"compression": "lz4", "use_dictionary": False},
             "no dictionary, snappy": {"compression": "snappy", "use_dictionary": False},
             "no dictionary, no compression": {"compression": "none", "use_dictionary": False}}
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, options in cases.items():
            figures = write_figures(table, args.block_rows, **options)
            if name not in best or figures["rows_per_s"] > best[name]["rows_per_s"]:
                best[name] = figures
    results = [{"case": name, **figures} for name, figures in best.items()]
    for result in results:
        print(f"{result['case']:62s} {result['rows_per_s']:>10,} rows/s {result['bytes_per_row']:>8} bytes/row")
    if args.json:
        args.json.write_text(json.dumps({"rows": args.rows, "width": args.width, "repeats": args.repeats,
                                         "cpu": cpu_model(), "pyarrow": pa.__version__, "load_average": os.getloadavg(),
                                         "results": results}, indent=1) + "\n")


def cpu_model() -> str:
    """The CPU's model name (lscpu's), for the figure's record."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
