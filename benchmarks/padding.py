"""The batch planner's padding efficiency on real token lengths, at CPU and CUDA budgets.

Tokenizes the texts of a data set with the default model's tokenizer (no truncation, lengths
capped at --max-length), shuffles them, cuts them into windows and plans each window as a run
does (`plan_batches`), with the planner's padding rule and without it (max_padding 1: a batch
fills to its limits whatever the length spread). Pure planning: no model, no device.

    .venv/bin/python benchmarks/padding.py ../shared/data/tweets ../shared/data/imdb-reviews \\
        --json benchmarks/results/padding.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import tokenizers

from pipeline.core.buckets import MAX_BATCH_PADDING, bucket_bounds, padding_efficiency, plan_batches
from pipeline.runtime.choice import default_model_path

BUDGETS = [(2048, 512), (32768, 4096), (262144, 4096)]  # (padded tokens, rows): CPU, CUDA for BERT-base, MiniLM
WINDOWS = [8192, 65536]


def token_lengths(folder: Path, max_length: int) -> np.ndarray:
    tokenizer = tokenizers.Tokenizer.from_file(str(Path(default_model_path()) / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    texts = [t for path in sorted(folder.glob("*.parquet")) for t in pq.read_table(path, columns=["text"])["text"]
             .to_pylist() if t]
    return np.minimum([len(encoding.ids) for encoding in tokenizer.encode_batch(texts)], max_length)


def plan_figures(lengths: np.ndarray, window_rows: int, tokens: int, rows: int, max_padding: float,
                 max_length: int) -> dict:
    bounds = bucket_bounds(max_length)
    real = padded = batches = 0
    for start in range(0, len(lengths), window_rows):
        window = lengths[start:start + window_rows]
        for batch in plan_batches(window, tokens, rows, bounds, max_padding=max_padding):
            real += int(window[batch.rows].sum())
            padded += batch.padded_tokens
            batches += 1
    return {"padding_efficiency": round(padding_efficiency(real, padded), 3), "batches": batches,
            "mean_padded_tokens": round(padded / max(batches, 1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = []
    for folder in args.folders:
        lengths = np.random.default_rng(0).permutation(token_lengths(folder, args.max_length))
        for window_rows in WINDOWS:
            for tokens, rows in BUDGETS:
                for rule, max_padding in (("none", 1.0), (f"{MAX_BATCH_PADDING:.3f}", MAX_BATCH_PADDING)):
                    figures = plan_figures(lengths, window_rows, tokens, rows, max_padding, args.max_length)
                    results.append({"data": folder.name, "rows": len(lengths), "window_rows": window_rows,
                                    "max_batch_tokens": tokens, "max_batch_rows": rows, "max_padding": rule,
                                    **figures})
                    print(" ".join(f"{key}={value}" for key, value in results[-1].items()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
