"""Evasion by length, measured: texts a moderation model flags on their own, with benign text put
in front of them, moderated with `--long-text truncate` and `--long-text split` (docs/jobs.md).

Takes test-split tweets of ../shared/data/tweets, moderates them alone, keeps the first --texts
flagged ones, puts --benign-tokens tokens of benign prose (the packaged sample's Python
documentation) before each, and moderates the padded texts both ways; also the benign prose alone,
split, to show it raises no flag of its own. Needs a moderation head
(benchmarks/train_tweet_moderation_head.py). Prints a JSON report:

    .venv/bin/python benchmarks/long_text_evasion.py --model models/tweet-moderation
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from pipeline import api
from pipeline.core.tokenize import load_tokenizer_spec

SAMPLE = Path(__file__).resolve().parents[1] / "pipeline" / "sample_data"
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tweets"


def benign_prose(model: str, tokens: int) -> str:
    """Whole sentences of the sample's documentation texts, the fewest that make `tokens` tokens."""
    tokenizer = Tokenizer.from_str(load_tokenizer_spec(model, 100_000).tokenizer_json)
    texts = pq.read_table(sorted(SAMPLE.glob("*.parquet"))[0])["text"].to_pylist()
    prose = ""
    for text in texts:
        prose = f"{prose} {' '.join(text.split())}".strip()
        if len(tokenizer.encode(prose).ids) - 2 >= tokens:
            break
    sentences = [sentence + "." for sentence in prose.split(". ") if sentence]
    while len(tokenizer.encode(" ".join(sentences[:-1])).ids) - 2 >= tokens:
        sentences.pop()
    return " ".join(sentences) + " "


def moderate(texts: list[str], ids: list[str], folder: Path, name: str, **options) -> pa.Table:
    source = folder / f"{name}-in"
    source.mkdir()
    pq.write_table(pa.table({"id": ids, "text": texts}), source / "part-00000.parquet")
    summary = api.run(str(source), str(folder / name), job="moderate", progress=False, **options)
    table = pq.read_table(folder / name / "part-00000.parquet")
    return table, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="A moderation model folder (multi-label sigmoid head).")
    parser.add_argument("--data", default=str(DATA), help="TweetEval Parquet shards (id, text, task, label).")
    parser.add_argument("--texts", type=int, default=50, help="Flagged texts to pad.")
    parser.add_argument("--benign-tokens", type=int, default=460, help="Tokens of benign prose put before each.")
    parser.add_argument("--max-length", type=int, default=256, help="--max-length of the runs.")
    parser.add_argument("--candidates", type=int, default=1000, help="Test tweets moderated to find flagged ones.")
    parser.add_argument("--segment-lengths", default="256,128,64", help="--segment-length of the split runs.")
    args = parser.parse_args()
    tweets = pa.concat_tables(pq.read_table(path) for path in sorted(glob.glob(f"{args.data}/*.parquet")))
    tweets = tweets.filter(pa.array(["/test/" in row_id for row_id in tweets["id"].to_pylist()]))
    tweets = tweets.slice(0, args.candidates)
    options = dict(model=args.model, max_length=args.max_length, dtype="float32", tokenize_workers=0,
                   compile="off")
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        alone, _ = moderate(tweets["text"].to_pylist(), tweets["id"].to_pylist(), folder, "alone",
                            long_text="truncate", **options)
        flagged = alone.filter(pa.array([bool(f) for f in alone["flagged"].to_pylist()])).slice(0, args.texts)
        ids = flagged["id"].to_pylist()
        texts = dict(zip(tweets["id"].to_pylist(), tweets["text"].to_pylist()))
        prose = benign_prose(args.model, args.benign_tokens)
        padded = [prose + texts[row_id] for row_id in ids]
        report = {"model": args.model, "max_length": args.max_length, "candidates": tweets.num_rows,
                  "flagged_alone": sum(bool(f) for f in alone["flagged"].to_pylist()), "padded_texts": len(ids),
                  "benign_chars": len(prose)}
        benign, _ = moderate([prose], ["benign"], folder, "benign", long_text="split", **options)
        report["benign_alone_split"] = {"flagged": benign["flagged"][0].as_py(), "scores": benign["scores"][0].as_py(),
                                        "segments": benign["segments"][0].as_py()}
        runs = [("truncate", {})] + [(f"split {length}", {"long_text": "split", "segment_length": length})
                                     for length in map(int, args.segment_lengths.split(","))]
        for name, settings in runs:
            table, summary = moderate(padded, ids, folder, name.replace(" ", "-"),
                                      **{"long_text": "truncate", **settings}, **options)
            flags = [bool(f) for f in table["flagged"].to_pylist()]
            report[name] = {"flagged": sum(flags), "truncated": sum(table["truncated"].to_pylist()),
                            "rows_per_s": round(summary["rows_per_s"], 1), "real_tokens": summary["real_tokens"]}
            if settings:
                rows = [row or [] for row in table["flag_spans"].to_pylist()]
                spans = [span for row in rows for span in row]
                report[name].update(segments=summary["segments"], flag_spans=len(spans),
                                    flag_spans_on_the_tweet=sum(span["end"] > len(prose) for span in spans),
                                    flagged_by_the_tweet=sum(any(span["end"] > len(prose) for span in row)
                                                             for row in rows),
                                    flagged_by_the_prose_only=sum(bool(row) and all(span["end"] <= len(prose)
                                                                                    for span in row) for row in rows))
        report["example"] = {"text": padded[0][len(prose) - 60:], "tweet_starts_at": len(prose),
                             **{key: value for key, value in table.to_pylist()[0].items() if key != "id"}}
    print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
