"""A row's text and its pair as one sequence (a cross-encoder's input), truncated as transformers'
`tokenizer(text, pair, truncation="longest_first", max_length=…)` truncates it.

Each pair is encoded whole by the model's tokenizer with truncation off, so its template (BERT's
`[CLS] A [SEP] B [SEP]`, XLM-R's `<s> A </s></s> B </s>`) and token types are the tokenizer's own;
`longest_first` then says how many tokens of each text stay, as the `tokenizers` library decides
it (the longer text gives up tokens first; when both must give, each keeps half the budget and the
longer one the odd token), and the rest are dropped. Truncating after encoding keeps none of the
pieces the library's own truncation keeps (for a pair it keeps every combination of the two texts'
cut-off pieces: quadratic in their length).

A text longer than the text cut's first prefix is encoded from the prefix a single text would be
(pipeline/core/textcut.py), which keeps its first --max-length tokens; its full length, which
`longest_first` compares, is then estimated from the prefix's tokens per character. Only when both
texts must give up tokens, the budget is odd and one of them was read from a prefix can that estimate
hand the odd token to the other text than transformers would.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from pipeline.core.textcut import has_long_word, long_text_prefix, text_cut_for, word_limit_for


def longest_first(first: np.ndarray, second: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens kept of each first text, of each second text) when a pair of `first` + `second` content
    tokens may keep `budget` (max_length less the template's special tokens), as the `tokenizers`
    library's LongestFirst strategy keeps them (ties: the first text is the shorter)."""
    first, second = np.asarray(first, np.int64), np.asarray(second, np.int64)
    swapped = first > second
    shorter = np.minimum(first, second)
    longer = np.where(shorter > budget, shorter, np.maximum(shorter, budget - shorter))
    halved = shorter + longer > budget
    shorter = np.where(halved, budget // 2, shorter)
    longer = np.where(halved, budget // 2 + budget % 2, longer)
    kept_first, kept_second = np.where(swapped, longer, shorter), np.where(swapped, shorter, longer)
    fits = first + second <= budget
    return (np.where(fits, first, np.minimum(kept_first, first)),
            np.where(fits, second, np.minimum(kept_second, second)))


def prefix_of(tokenizer, text: str, cut) -> tuple[str, float]:
    """(the text or its prefix, the share of the text it is): a text longer than the cut's first
    prefix is read from the prefix that keeps its first --max-length tokens."""
    if len(text) <= cut.first_cut_chars:
        return text, 1.0
    prefix, _, share = long_text_prefix(tokenizer, text, cut)
    return prefix, share


def encode_pairs(tokenizer, whole, tokenizer_json: str, max_length: int, firsts: Sequence[str],
                 seconds: Sequence[str], with_types: bool) -> dict:
    """Encode pairs of prepared texts: `tokenizer` truncates at max_length (it finds long texts'
    prefixes), `whole` is the same with truncation off (`whole_tokenizer`). Returns flat `token_ids` (int32)
    and `type_ids` (int8, or None unless `with_types`), per pair `lengths`, `truncated`, `cut_tokens`
    (estimated tokens truncation dropped) and `first_tokens`/`second_tokens` (each text's content
    tokens before truncation: 0 is a text with no tokens)."""
    cut = text_cut_for(tokenizer_json, max_length)
    first_read = [prefix_of(tokenizer, text, cut) for text in firsts]
    second_read = [prefix_of(tokenizer, text, cut) for text in seconds]
    encodings = whole.encode_batch([(a, b) for (a, _), (b, _) in zip(first_read, second_read)]) \
        if len(firsts) else []
    rows = len(encodings)
    sizes = np.fromiter((len(e.ids) for e in encodings), np.int64, count=rows)
    total = int(sizes.sum())
    token_ids = np.fromiter((t for e in encodings for t in e.ids), np.int32, count=total)
    sequence = np.fromiter((-1 if s is None else s for e in encodings for s in e.sequence_ids), np.int8, count=total)
    type_ids = np.fromiter((t for e in encodings for t in e.type_ids), np.int8, count=total) if with_types else None
    row_of = np.repeat(np.arange(rows), sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    counts, ranks = [], []
    for side in (0, 1):  # each token's rank within its text, and each text's tokens
        mine = sequence == side
        seen = np.cumsum(mine)
        before = np.where(starts > 0, seen[np.maximum(starts - 1, 0)], 0) if total else np.zeros(rows, np.int64)
        ranks.append(seen - 1 - before[row_of])
        counts.append(np.bincount(row_of[mine], minlength=rows))
    shares = [np.array([share for _, share in read]) for read in (first_read, second_read)]
    # a prefix's text: its full length estimated from the prefix's tokens per character
    full = [np.rint(count / share).astype(np.int64) for count, share in zip(counts, shares)]
    budget = max_length - (sizes - counts[0] - counts[1])  # less the template's special tokens
    kept = longest_first(full[0], full[1], budget)
    keep = (sequence < 0) | ((sequence == 0) & (ranks[0] < kept[0][row_of])) | \
        ((sequence == 1) & (ranks[1] < kept[1][row_of]))
    cut_tokens = full[0] + full[1] - kept[0] - kept[1]
    truncated = cut_tokens > 0
    limit = word_limit_for(tokenizer_json)
    if limit is not None:  # a word WordPiece read as one [UNK] for its length: only rows with an [UNK] are looked at
        for row in np.unique(row_of[token_ids == limit.unk_id]).tolist():
            truncated[row] |= has_long_word(encodings[row], limit)
    return {"token_ids": token_ids[keep], "type_ids": None if type_ids is None else type_ids[keep],
            "lengths": np.bincount(row_of[keep], minlength=rows).astype(np.int64), "truncated": truncated,
            "cut_tokens": cut_tokens, "first_tokens": counts[0], "second_tokens": counts[1]}


def carries_pair_types(tokenizer) -> bool:
    """Whether a pair's token types travel with its batch: the model takes them (the transformers
    tokenizer's `model_input_names` say so, as transformers decides whether to return them; DistilBERT's
    do not) and the tokenizer gives the second text another type than the first (BERT's 0 and 1;
    RoBERTa's and XLM-R's templates type every token 0)."""
    if "token_type_ids" not in getattr(tokenizer, "model_input_names", ()):
        return False
    return any(whole_tokenizer(tokenizer.backend_tokenizer.to_str()).encode("a", "b").type_ids)


@functools.lru_cache(maxsize=4)
def whole_tokenizer(tokenizer_json: str):
    """The tokenizer with truncation off: a pair is truncated after it is encoded (`encode_pairs`)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.no_truncation()
    return tokenizer
