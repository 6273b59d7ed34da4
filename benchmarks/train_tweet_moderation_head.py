"""Build the worked example's moderation model: all-MiniLM-L6-v2 with a two-label classifier
head (`offensive`, `hate`, multi-label sigmoid) trained on the TweetEval train split of
../shared/data/tweets. No moderation model ships with this machine and none can be downloaded,
so this is an honest stand-in: a frozen MiniLM encoder and pooler with a linear head trained
for a few hundred steps, saved as a Hugging Face folder (safetensors) that `--job moderate`
loads like any other. It is a demonstration model, not a production classifier; its test-split
accuracy is printed and written to --report (default: training_report.json in the model folder).
--rows trains and tests on a slice (the first N rows of each split) without editing the script.

Each tweet carries one task's label only (OffensEval or HatEval), so the loss of a row counts
only the label it has. Run once before `configs/nightly_moderation.toml`:

    .venv/bin/python benchmarks/train_tweet_moderation_head.py --out models/tweet-moderation
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import AutoTokenizer, BertForSequenceClassification

from pipeline.runtime.choice import default_model_path

LABELS = ("offensive", "hate")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def read_tweets(data: str) -> pa.Table:
    return pa.concat_tables(pq.read_table(path) for path in sorted(glob.glob(f"{data}/*.parquet")))


def targets(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(rows, 2) 0/1 targets and a mask of the one label each row has."""
    target = np.zeros((table.num_rows, len(LABELS)), np.float32)
    known = np.zeros_like(target)
    for row, (task, label) in enumerate(zip(table["task"].to_pylist(), table["label"].to_pylist())):
        column = LABELS.index(task)
        known[row, column] = 1
        target[row, column] = float(label == task)
    return target, known


@torch.no_grad()  # plain tensors: the head trains on them
def pooled_features(model, tokenizer, texts: list[str], max_length: int, batch_rows: int = 128) -> torch.Tensor:
    """The BERT pooler output the classifier head reads, longest rows first."""
    order = np.argsort([-len(t) for t in texts], kind="stable")
    features = torch.empty(len(texts), model.config.hidden_size)
    for start in range(0, len(texts), batch_rows):
        rows = order[start:start + batch_rows]
        batch = tokenizer([texts[i] for i in rows], padding=True, truncation=True, max_length=max_length,
                          return_tensors="pt")
        features[torch.as_tensor(rows)] = model.bert(**batch).pooler_output
    return features


def split_of(table: pa.Table, split: str) -> pa.Table:
    keep = [f"/{split}/" in row_id for row_id in table["id"].to_pylist()]
    return table.filter(pa.array(keep))


def accuracy(logits: torch.Tensor, target: np.ndarray, known: np.ndarray) -> dict:
    predicted = (logits.sigmoid().numpy() >= 0.5).astype(np.float32)
    report = {}
    for column, label in enumerate(LABELS):
        rows = known[:, column] == 1
        truth, guess = target[rows, column], predicted[rows, column]
        true_positive = float((truth * guess).sum())
        precision = true_positive / max(float(guess.sum()), 1.0)
        recall = true_positive / max(float(truth.sum()), 1.0)
        report[label] = {"rows": int(rows.sum()), "accuracy": round(float((truth == guess).mean()), 3),
                         "precision": round(precision, 3), "recall": round(recall, 3),
                         "f1": round(2 * precision * recall / max(precision + recall, 1e-9), 3)}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[1].parent / "shared/data/tweets"),
                        help="Folder of TweetEval Parquet shards: id (with /train/ or /test/), text, task, label.")
    parser.add_argument("--out", required=True, help="The model folder to write (safetensors, config, tokenizer).")
    parser.add_argument("--report", default=None,
                        help="Where the accuracy report (JSON) goes. Default: OUT/training_report.json.")
    parser.add_argument("--rows", type=int, default=None,
                        help="Use only the first ROWS rows of each split (train, test), e.g. to build a head from "
                             "a slice. Default: all.")
    parser.add_argument("--max-length", type=int, default=128, help="Tokens per tweet; longer ones are truncated.")
    parser.add_argument("--steps", type=int, default=400, help="Full-batch Adam steps of the linear head.")
    args = parser.parse_args()
    if args.rows is not None and args.rows < 1:
        parser.error("--rows must be at least 1")
    torch.manual_seed(0)
    base = default_model_path()
    model = BertForSequenceClassification.from_pretrained(
        base, num_labels=len(LABELS), problem_type="multi_label_classification",
        id2label=dict(enumerate(LABELS)), label2id={label: i for i, label in enumerate(LABELS)}).eval()
    tokenizer = AutoTokenizer.from_pretrained(base)
    tweets = read_tweets(args.data)
    train, test = (split_of(tweets, split).slice(0, args.rows) for split in ("train", "test"))
    started = time.perf_counter()
    train_x = pooled_features(model, tokenizer, train["text"].to_pylist(), args.max_length)
    test_x = pooled_features(model, tokenizer, test["text"].to_pylist(), args.max_length)
    features_s = time.perf_counter() - started
    train_y, train_known = targets(train)
    test_y, test_known = targets(test)
    head = model.classifier
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    target, known = torch.from_numpy(train_y), torch.from_numpy(train_known)
    started = time.perf_counter()
    for _ in range(args.steps):  # full-batch: the features fit in memory many times over
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(head(train_x), target, weight=known)
        loss = loss * known.numel() / known.sum()
        loss.backward()
        optimizer.step()
    train_s = time.perf_counter() - started
    with torch.inference_mode():
        report = {"train": accuracy(head(train_x), train_y, train_known),
                  "test": accuracy(head(test_x), test_y, test_known)}
    out = Path(args.out)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(base) / name, out / name)
    report.update(base=base, train_rows=train.num_rows, test_rows=test.num_rows, max_length=args.max_length,
                  steps=args.steps, features_s=round(features_s, 1), train_s=round(train_s, 1),
                  final_loss=round(float(loss.detach()), 4), torch_threads=torch.get_num_threads())
    print(json.dumps(report, indent=2))
    results = Path(args.report) if args.report else out / "training_report.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(report, indent=2) + "\n")
    print(f"model: {out}  report: {results}")


if __name__ == "__main__":
    main()
