"""Rebuild the shipped sample dataset from the Python standard library's docstrings.

The docstrings are real English prose written by people, licensed under the PSF License
(which allows redistribution), and their lengths run from one line to several pages —
the spread that length bucketing is about. Run once with the interpreter whose docs you
want; the committed shards were built with CPython 3.11.7:

    python pipeline/sample_data/make_sample.py
"""

import hashlib
import importlib
import inspect
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

MODULES = [
    "abc", "argparse", "array", "asyncio", "base64", "bisect", "calendar", "collections",
    "concurrent.futures", "configparser", "contextlib", "copy", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email.message", "enum", "fractions", "functools",
    "gzip", "hashlib", "heapq", "hmac", "html", "http.client", "inspect", "ipaddress",
    "itertools", "json", "logging", "math", "mimetypes", "multiprocessing", "operator",
    "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "secrets", "selectors",
    "shlex", "shutil", "socket", "sqlite3", "statistics", "string", "struct", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "time", "tomllib", "typing",
    "unittest", "urllib.parse", "uuid", "weakref", "zipfile",
]
ROWS = 400
SHARD_SIZES = (240, 160)


def collect_docstrings() -> dict[str, str]:
    """Public functions, classes and methods of MODULES, keyed by dotted name."""
    docs: dict[str, str] = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, value in sorted(vars(module).items()):
            if name.startswith("_") or getattr(value, "__module__", "") != module.__name__:
                continue
            members = [(f"{module_name}.{name}", value)]
            if inspect.isclass(value):
                members += [(f"{module_name}.{name}.{attr}", member)
                            for attr, member in sorted(vars(value).items()) if not attr.startswith("_")]
            for key, member in members:
                text = inspect.getdoc(member) if callable(member) or inspect.isclass(member) else None
                if text and len(text) >= 20:
                    docs.setdefault(key, text)
    return docs


def main() -> None:
    docs = collect_docstrings()
    seen: set[str] = set()
    unique = [(key, text) for key, text in sorted(docs.items()) if not (text in seen or seen.add(text))]
    by_length = sorted(unique, key=lambda item: (len(item[1]), item[0]))
    step = len(by_length) / ROWS
    picked = [by_length[int(i * step)] for i in range(ROWS)]
    picked.sort(key=lambda item: hashlib.sha1(item[0].encode()).hexdigest())
    out_dir = Path(__file__).parent
    start = 0
    for shard_index, size in enumerate(SHARD_SIZES):
        rows = picked[start:start + size]
        start += size
        table = pa.table({
            "id": [f"python-stdlib/{key}" for key, _ in rows],
            "text": [text for _, text in rows],
        })
        pq.write_table(table, out_dir / f"stdlib-docs-{shard_index:05d}.parquet", compression="zstd")
    print(f"{len(unique)} unique docstrings, wrote {ROWS} rows in {len(SHARD_SIZES)} shards to {out_dir}")


if __name__ == "__main__":
    main()
