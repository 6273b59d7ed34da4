"""Pairs: a cross-encoder's scores for a text and its pair (a query and a passage, a comment and a
rule: "does this comment break rule X?"), one score per label, flagged as `moderate` flags.

The row's two texts (`--text-column`, `--pair-column`) are encoded as one sequence by the model's
tokenizer and truncated as transformers' `longest_first` truncates them (pipeline/core/pairs.py); their
token types go to the model where its tokenizer gives the texts different ones (BERT). Scores,
thresholds, flag labels and output columns are `moderate`'s; a pair is never split into segments
(`--long-text split` is refused: a segment of one text without the rest of the pair is no pair).
"""

from __future__ import annotations

from jobs.moderate import ModerateJob


class PairJob(ModerateJob):
    name = "pair"
    inputs = ("text", "pair")
