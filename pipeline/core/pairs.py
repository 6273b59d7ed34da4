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


def encode_pairs(tokenizer, whole_tokenizer, tokenizer_json: str, max_length: int, firsts: Sequence[str],
                 seconds: Sequence[str], with_types: bool) -> dict:
    """Encode pairs of prepared texts: `tokenizer` truncates at max_length (it finds long texts'
    prefixes), `whole_tokenizer` is the same with truncation off. Returns flat `token_ids` (int32)
    and `type_ids` (int8, or None unless `with_types`), per pair `lengths`, `truncated`, `cut_tokens`
    (estimated tokens truncation dropped) and `first_tokens`/`second_tokens` (each text's content
    tokens before truncation: 0 is a text with no tokens)."""
    cut = text_cut_for(tokenizer_json, max_length)
    first_read = [prefix_of(tokenizer, text, cut) for text in firsts]
    second_read = [prefix_of(tokenizer, text, cut) for text in seconds]
    encodings = whole_tokenizer.encode_batch([(a, b) for (a, _), (b, _) in zip(first_read, second_read)]) \
        if len(firsts) else []
    limit = word_limit_for(tokenizer_json)
    rows = len(encodings)
    lengths, truncated = np.zeros(rows, np.int64), np.zeros(rows, bool)
    cut_tokens, first_tokens, second_tokens = (np.zeros(rows, np.int64) for _ in range(3))
    token_parts, type_parts = [], []
    for row, encoding in enumerate(encodings):
        sequence = np.array([-1 if s is None else s for s in encoding.sequence_ids], np.int8)
        counts = np.array([(sequence == 0).sum(), (sequence == 1).sum()], np.int64)
        shares = np.array([first_read[row][1], second_read[row][1]])
        full = np.rint(counts / shares).astype(np.int64)  # a prefix's text: estimated from its tokens per character
        budget = max_length - int((sequence < 0).sum())
        kept = np.array([k[0] for k in longest_first(full[:1], full[1:], budget)])
        rank = np.where(sequence == 0, np.cumsum(sequence == 0), np.cumsum(sequence == 1)) - 1
        keep = (sequence < 0) | ((sequence == 0) & (rank < kept[0])) | ((sequence == 1) & (rank < kept[1]))
        token_parts.append(np.array(encoding.ids, np.int32)[keep])
        if with_types:
            type_parts.append(np.array(encoding.type_ids, np.int8)[keep])
        lengths[row] = int(keep.sum())
        first_tokens[row], second_tokens[row] = counts
        cut_tokens[row] = int((full - kept).sum())
        truncated[row] = cut_tokens[row] > 0 or (limit is not None and has_long_word(encoding, limit))
    concat = np.concatenate
    return {"token_ids": concat(token_parts) if token_parts else np.zeros(0, np.int32),
            "type_ids": (concat(type_parts) if type_parts else np.zeros(0, np.int8)) if with_types else None,
            "lengths": lengths, "truncated": truncated, "cut_tokens": cut_tokens, "first_tokens": first_tokens,
            "second_tokens": second_tokens}


def pair_types_differ(whole_tokenizer) -> bool:
    """Whether the tokenizer gives a pair's second text another token type than its first (BERT's 0
    and 1; RoBERTa's and XLM-R's templates type every token 0): only then do types travel with a batch."""
    return any(whole_tokenizer.encode("a", "b").type_ids)
