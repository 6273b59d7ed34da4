"""lengthwise `embed`, end to end, against SentenceTransformer.encode on the same rows.

lengthwise is timed from Parquet in to Parquet out (listing, model load, reading,
tokenizing, forward, writing: the wall time of the `lengthwise run` command); its memory plan
is probed and cached first, untimed, as a nightly run finds it in the cache. sentence-transformers is timed on
`encode(texts, batch_size=32)` only — its model load and the Parquet read are left out,
which favours it. Both use the same torch thread count, and the
outputs are compared row by row (cosine).

    .venv/bin/python benchmarks/embed_vs_sentence_transformers.py                  # all of imdb-reviews
    .venv/bin/python benchmarks/embed_vs_sentence_transformers.py --rows-per-shard 500 --shards 2
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.runtime.choice import default_model_path  # noqa: E402

DEFAULT_INPUT = str(ROOT.parent / "shared" / "data" / "imdb-reviews" / "*.parquet")


def prepare_input(pattern: str, shards: int | None, rows_per_shard: int | None, directory: Path) -> list[str]:
    """The benchmark's shards: the originals, or the first rows of each copied to `directory`."""
    paths = sorted(glob.glob(pattern))[:shards]
    if not paths:
        raise SystemExit(f"no shards match {pattern}")
    if rows_per_shard is None:
        return paths
    copies = []
    directory.mkdir(parents=True, exist_ok=True)
    for path in paths:
        copy = directory / Path(path).name
        pq.write_table(pq.read_table(path, columns=["id", "text"]).slice(0, rows_per_shard), copy)
        copies.append(str(copy))
    return copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", default=DEFAULT_INPUT, help="glob of Parquet shards with id and text")
    parser.add_argument("--shards", type=int, default=None, help="use only the first N shards")
    parser.add_argument("--rows-per-shard", type=int, default=None, help="use only the first N rows of each")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip-reference", action="store_true", help="time lengthwise only")
    parser.add_argument("--reference-dtypes", default="float32",
                        help="sentence-transformers is timed in each of these (comma-separated); the ratio is "
                             "against the first, cosines against float32")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        inputs = prepare_input(args.input, args.shards, args.rows_per_shard, scratch / "in")
        if args.rows_per_shard is not None:
            inputs = [str(scratch / "in")]
        # The real command, in its own process: its tokenizer workers then spawn from the small
        # CLI module, not from this script (spawn re-imports the parent's main module).
        lengthwise = str(Path(sys.executable).parent / "lengthwise")
        command = [lengthwise, "run", "--output", str(scratch / "out"),
                   "--job", "embed", "--max-length", str(args.max_length), "--dtype", args.dtype,
                   "--max-batch-tokens", str(args.max_batch_tokens), "--summary-json", str(scratch / "summary.json"),
                   "--no-progress"]
        for path in inputs:
            command += ["--input", path]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        # A nightly run finds its memory plan in the cache; probe it here, outside the timing.
        subprocess.run([lengthwise, "plan", "--job", "embed", "--max-length", str(args.max_length), "--dtype",
                        args.dtype, "--max-batch-tokens", str(args.max_batch_tokens)],
                       check=True, env=env, stdout=subprocess.DEVNULL)
        subprocess.run(command, check=True, env=env)
        summary = json.loads((scratch / "summary.json").read_text())
        outputs = sorted((scratch / "out").glob("*.parquet"))
        table = pa.concat_tables(pq.read_table(p) for p in outputs)
        from pipeline.core.device import native_bf16_feature

        results = {"threads": args.threads, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                   "native_bf16": native_bf16_feature(), "lengthwise": summary}

        if not args.skip_reference:
            from sentence_transformers import SentenceTransformer

            source_paths = sorted(glob.glob(str(Path(inputs[0]) / "*.parquet"))) if args.rows_per_shard else inputs
            texts = pa.concat_tables(pq.read_table(p, columns=["text"]) for p in source_paths)["text"].to_pylist()
            texts = [text or "" for text in texts]  # a null text is an error row in lengthwise, left out below
            vectors = table["embedding"].to_pylist()
            valid = np.array([v is not None for v in vectors])  # rows with an error (empty text) have none
            ours = np.array([v for v in vectors if v is not None], dtype=np.float32)
            results["sentence_transformers"] = {}
            for position, dtype in enumerate(args.reference_dtypes.split(",")):
                model = SentenceTransformer(default_model_path(), device="cpu",
                                            model_kwargs={"torch_dtype": getattr(torch, dtype)})
                model.max_seq_length = args.max_length
                started = time.perf_counter()
                reference = model.encode(texts, batch_size=32, convert_to_numpy=True, show_progress_bar=False)
                encode_s = time.perf_counter() - started
                reference = reference.astype(np.float32)[valid]
                cosine = (ours * reference).sum(axis=1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
                results["sentence_transformers"][dtype] = {"rows": len(texts), "encode_s": round(encode_s, 2),
                                                           "rows_per_s": round(len(texts) / encode_s, 1),
                                                           "cosine_min_vs_lengthwise": float(cosine.min())}
                if position == 0:
                    results["speedup_rows_per_s"] = round(summary['rows_per_s'] / (len(texts) / encode_s), 3)
                    results["cosine_min"] = float(cosine.min())
                print(f"sentence-transformers {dtype} encode(batch_size=32): {len(texts):,} rows in {encode_s:.1f}s = "
                      f"{len(texts) / encode_s:,.1f} rows/s; min cosine vs lengthwise {cosine.min():.6f}")
            print(f"lengthwise end to end: {summary['rows_per_s']:,.1f} rows/s = {results['speedup_rows_per_s']}x "
                  f"sentence-transformers {args.reference_dtypes.split(',')[0]}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
