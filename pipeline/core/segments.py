"""`--long-text split`: a row longer than --max-length cut into segments, each tokenized as its own row.

A segment is a character span of the row's text, tokenized alone (the prompt, the specials, the
truncation, all as for a row of that text), so its scores are those the span gets as a row of its
own. Segments end at a sentence boundary when the sentences before it fit in --segment-length
tokens; a sentence longer than that is cut into token windows at word boundaries that overlap by
an eighth of the segment (SEGMENT_OVERLAP_SHARE), so no token is judged only at a window's edge.
The text is read a bounded prefix at a time (`chunk_chars`: the text cut's first prefix, a few
segments' worth), so a 5 MB text costs a segment's memory, never the text's; a row gets at most
MAX_SEGMENTS_PER_ROW segments and stays `truncated` beyond them, or beyond the characters that many
chunks span (a text without spaces, a run of zero-token characters: its time is bounded too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

MAX_SEGMENTS_PER_ROW = 256  # ≈ 131k tokens at 512 per segment (≈ 500 KB of English); the rest is not judged
SEGMENT_OVERLAP_SHARE = 8  # token windows inside one long sentence overlap by segment_length // 8 tokens
# a sentence ends after . ! ? (and their CJK forms, an ellipsis), closing quotes or brackets, then whitespace;
# a line break ends one too
SENTENCE_END = re.compile(r"[.!?\u3002\uff01\uff1f\u2026][\"'\u201d\u2019)\]]*\s+|\n\s*")
VISIBLE = re.compile(r"\S")


@dataclass
class RowSegments:
    """The segments of consecutive rows, flattened in row order: tokens as EncodedRows keeps
    them, the row each belongs to and its span of that row's text; `row_chars`: every row's
    text length in characters (0 for a row with an error), what a row that fit spans."""

    token_ids: np.ndarray  # int32
    offsets: np.ndarray  # int64, segments + 1
    row: np.ndarray  # int64, the row (position among the chunk's rows) of each segment
    spans: np.ndarray  # int32 (segments, 2): [start, end) characters of the row's text
    row_chars: np.ndarray  # int64, one per row

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.row)


def empty_segments(rows: int) -> RowSegments:
    return RowSegments(np.zeros(0, np.int32), np.zeros(1, np.int64), np.zeros(0, np.int64),
                       np.zeros((0, 2), np.int32), np.zeros(rows, np.int64))


def concat_segments(parts: list[RowSegments]) -> RowSegments:
    """The segments of consecutive chunks of rows as one, their rows counted from the first chunk's."""
    rows_before = np.cumsum([0] + [len(p.row_chars) for p in parts[:-1]])
    lengths = np.concatenate([p.lengths for p in parts])
    return RowSegments(np.concatenate([p.token_ids for p in parts]), np.concatenate([[0], np.cumsum(lengths)]),
                       np.concatenate([p.row + first for p, first in zip(parts, rows_before)]),
                       np.concatenate([p.spans for p in parts]).reshape(-1, 2),
                       np.concatenate([p.row_chars for p in parts]))


def segment_cut(token_spans: list[tuple[int, int]], token_words: list, budget: int, chunk_end: int,
                text_end: int, text: str, start: int, overlap: int) -> tuple[int, int]:
    """(end of this segment, start of the next; characters of `text`) for a segment from `start`
    whose prefix `text[start:chunk_end]` has these content tokens (character spans in `text`,
    word ids), of which `budget` fit. The rest of the text fits: it ends at `text_end`. Else it
    ends after the last sentence boundary the fitting whole words reach, the next one starting
    there; else after the last whole word that fits (one word longer than the segment: where
    its tokens stop), the next one starting `overlap` tokens earlier at a word's first token."""
    if len(token_spans) <= budget and chunk_end >= text_end:
        return text_end, text_end
    fit = min(budget, len(token_spans))
    if fit == 0:  # a prefix of zero-token characters: skip it
        return chunk_end, chunk_end
    # the word of the first token that does not fit (or the prefix's last word, which may go on past it)
    open_word = token_words[fit] if fit < len(token_spans) else token_words[fit - 1]
    cut = fit
    while cut > 0 and token_words[cut - 1] is not None and token_words[cut - 1] == open_word:
        cut -= 1
    cut = cut or fit
    reach = token_spans[cut - 1][1]
    boundary = None
    for match in SENTENCE_END.finditer(text, start, reach + 1):
        if match.start() < reach:
            boundary = match.end()
    if boundary is not None:
        return boundary, boundary
    following = max(cut - overlap, (cut + 1) // 2)
    word_start = following  # the next segment starts at a word's first token, unless that word began this one
    while 0 < word_start < cut and token_words[word_start] is not None and \
            token_words[word_start] == token_words[word_start - 1]:
        word_start -= 1
    following = word_start or following
    return reach, max(token_spans[following][0] if following < cut else reach, start + 1)


def content_tokens(encoding, shift: int) -> tuple[list, list]:
    """(character spans shifted by `shift`, word ids) of an encoding's non-special tokens, the
    overflowing pieces' after the kept ones."""
    spans, words = [], []
    for piece in (encoding, *encoding.overflowing):
        for special, (a, b), word in zip(piece.special_tokens_mask, piece.offsets, piece.word_ids):
            if not special:
                spans.append((a + shift, b + shift))
                words.append(word)
    return spans, words


def split_text(tokenizer, prepare, text: str, segment_length: int, chunk_chars: int,
               overhead_tokens: int) -> tuple[list, list[tuple[int, int]], bool]:
    """(encodings, character spans, whether MAX_SEGMENTS_PER_ROW stopped it) of the segments of
    `text`. `prepare(span)` is the string the tokenizer sees for a span (its prompt put first);
    `overhead_tokens`: the special and prompt tokens every segment has."""
    budget = max(1, segment_length - overhead_tokens)
    overlap = segment_length // SEGMENT_OVERLAP_SHARE
    read_chars = MAX_SEGMENTS_PER_ROW * chunk_chars  # what 256 segments can span; also bounds zero-token runs
    encodings, spans = [], []
    start = _next_visible(text, 0)
    while start < len(text):
        if len(encodings) == MAX_SEGMENTS_PER_ROW or start >= read_chars:
            return encodings, spans, True
        chunk_end = min(len(text), start + chunk_chars)
        token_spans, words = content_tokens(tokenizer.encode(text[start:chunk_end]), start)
        while True:
            end, following = segment_cut(token_spans, words, budget, chunk_end, len(text), text, start, overlap)
            encoding = tokenizer.encode(prepare(text[start:end])) if end > start else None
            if encoding is None or len(encoding.ids) <= segment_length or budget == 1:
                break
            budget -= len(encoding.ids) - segment_length  # alone, the span took more tokens than in the text
        if encoding is not None and len(encoding.ids) > sum(encoding.special_tokens_mask):
            encodings.append(encoding)
            spans.append((start, end))
        start = _next_visible(text, following)
    return encodings, spans, False


def _next_visible(text: str, position: int) -> int:
    found = VISIBLE.search(text, position)
    return found.start() if found else len(text)


def segment_groups(row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the rows that have segments, where each one's segments start) for segments in row order."""
    if not len(row):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.flatnonzero(np.concatenate([[True], row[1:] != row[:-1]]))
    return row[starts], starts


def max_per_group(values: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the maximum of each group of consecutive rows of `values` (groups begin at `starts`), per
    column; the row of `values` it came from, per column: the first such row)."""
    if not len(starts):
        return values[:0], np.zeros((0, *values.shape[1:]), np.int64)
    ends = np.append(starts[1:], len(values))
    best = np.stack([start + np.argmax(values[start:end], axis=0) for start, end in zip(starts, ends)])
    return np.maximum.reduceat(values, starts, axis=0), best


def weighted_mean_per_group(values: np.ndarray, weights: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The `weights`-weighted mean of each group of consecutive rows of `values` (float64 sums)."""
    if not len(starts):
        return values[:0]
    totals = np.add.reduceat(values.astype(np.float64) * weights[:, None], starts, axis=0)
    return (totals / np.add.reduceat(weights.astype(np.float64), starts)[:, None]).astype(values.dtype)
