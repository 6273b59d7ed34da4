"""Tokenizing a long text from a prefix, so a row's memory is bounded by --max-length, not by its text.

The tokenizer keeps every piece truncation cuts off (~160 bytes per character): one 5 MB text
took a run from 0.58 to 1.86 GB. A text longer than `first_cut_chars` is tokenized from a
prefix instead, doubled until it provably keeps exactly the tokens full tokenization with
truncation keeps. Why a prefix can: normalizers and pre-tokenizers act locally and the model
turns each pre-token ("word") into tokens on its own, so a prefix's words and their tokens are
the full text's except near the cut, where it can change the last word (a word cut in two, a
whitespace run a regex sees end early) and the words of an added token it splits ("[SE" of
"[SEP]"). So once the prefix's tokens run two words past the last token truncation keeps, and
that token ends at least the longest added token's length before the cut, the kept tokens are
the full text's, and the text is truncated (more tokens follow). A tokenizer without words
(every token in word 0) never passes the check: it gets the whole text.

Runs of zero-token characters (10 MB of spaces, then words) would still take the whole run into
the prefix; for BERT-style tokenizers, where such a run only ever separates words, each run is
collapsed to one character first, which gives the same tokens (`collapses_runs`).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

# A run of what a BERT-style tokenizer turns into a word break (whitespace) or removes (NUL, control
# and format characters): any run of two or more gives the same tokens as one of its characters
BERT_WHITESPACE = " \t\n\r"
BERT_REMOVED = "\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u00ad\u200b-\u200f\u2060-\u2064\ufeff"
ZERO_TOKEN_RUN = re.compile(f"[{BERT_WHITESPACE}{BERT_REMOVED}]{{2,}}")
_WHITESPACE = re.compile(f"[{BERT_WHITESPACE}]")
WORD_SPLITTING_PRE_TOKENIZERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit"}
WORDS_PAST_THE_LAST_KEPT_TOKEN = 2  # the cut changes at most the prefix's last word; one more for safety
# texts whose tokens might fit this many are tokenized whole, so their length before truncation (the
# diagnosis's p99, what a --max-length covering the data needs) is exact up to the positions common encoders take
COUNTED_TOKENS = 512
LAST_CUT_SHARE = 8  # the longest prefix tokenized is this many first cuts: no row costs more, whatever its spacing


@dataclass(frozen=True)
class TextCut:
    """How a tokenizer's long texts are cut: `first_cut_chars`, the first prefix tried (texts this
    short or shorter are tokenized whole, as before); whether zero-token runs collapse; the
    longest added token, in characters; `last_cut_chars`, the longest prefix ever tokenized."""

    first_cut_chars: int
    collapse_runs: bool
    added_token_chars: int
    last_cut_chars: int


@functools.lru_cache(maxsize=8)
def text_cut_for(tokenizer_json: str, max_length: int) -> TextCut:
    """The cut of a tokenizer truncating at max_length: first prefix max(max_length,
    COUNTED_TOKENS) tokens of the vocabulary's longest token, and two more."""
    spec = json.loads(tokenizer_json)
    vocab = spec["model"].get("vocab") or {}
    tokens = [entry[0] for entry in vocab] if isinstance(vocab, list) else list(vocab)  # Unigram: [token, score]
    added = [added["content"] for added in spec.get("added_tokens") or []]
    longest = max((len(token) for token in tokens + added), default=1)
    first_cut = (max(max_length, COUNTED_TOKENS) + WORDS_PAST_THE_LAST_KEPT_TOKEN) * longest
    return TextCut(first_cut, collapses_runs(spec), max((len(token) for token in added), default=0),
                   LAST_CUT_SHARE * first_cut)


@dataclass(frozen=True)
class WordLimit:
    """WordPiece's limit: a word of more than `max_chars` characters becomes the one token `unk_id`."""

    unk_id: int
    max_chars: int


@functools.lru_cache(maxsize=8)
def word_limit_for(tokenizer_json: str) -> WordLimit | None:
    """The word limit of a WordPiece tokenizer (its max_input_chars_per_word); None for the
    other models, which read a word of any length (BPE, Unigram) or have no length limit (WordLevel)."""
    model = json.loads(tokenizer_json)["model"]
    unk_id = (model.get("vocab") or {}).get(model.get("unk_token")) if model.get("type") == "WordPiece" else None
    return None if unk_id is None else WordLimit(unk_id, model.get("max_input_chars_per_word", 100))


def collapses_runs(spec: dict) -> bool:
    """Whether runs of ZERO_TOKEN_RUN characters can be collapsed without changing a token: the
    BERT normalizer with clean_text (whitespace becomes a space, controls are removed), a
    pre-tokenizer that splits words at whitespace, and no added token with such a character."""
    normalizer, pre_tokenizer = spec.get("normalizer") or {}, spec.get("pre_tokenizer") or {}
    run_character = re.compile(f"[{BERT_WHITESPACE}{BERT_REMOVED}]")
    return (normalizer.get("type") == "BertNormalizer" and bool(normalizer.get("clean_text"))
            and pre_tokenizer.get("type") in WORD_SPLITTING_PRE_TOKENIZERS
            and not any(run_character.search(added["content"]) for added in spec.get("added_tokens") or []))


def collapse_runs(text: str) -> str:
    """Each run of two or more zero-token characters as one: a space if it has whitespace
    (a word break), else its first character (removed by the normalizer, as the run is)."""
    return ZERO_TOKEN_RUN.sub(lambda run: " " if _WHITESPACE.search(run.group()) else run.group()[0], text)


def text_prefix(text: str, chars: int, collapse: bool) -> tuple[str, bool]:
    """(the first `chars` characters of `text`, or of its collapsed form when `collapse`;
    whether that is the whole text). Only as much of the text as that needs is collapsed; a
    run the raw cut splits can end the prefix unlike the collapsed whole would, which the word
    check tolerates (it is in the last word)."""
    if not collapse:
        return text[:chars], chars >= len(text)
    end = chars
    while True:
        prefix = collapse_runs(text[:end])
        if end >= len(text) and len(prefix) <= chars:
            return prefix, True
        if len(prefix) >= chars:
            return prefix[:chars], False
        end *= 2


def keeps_full_tokens(encoding, prefix_chars: int, added_token_chars: int) -> bool:
    """Whether a prefix's truncated encoding kept the full text's tokens: it overflowed, its
    tokens run WORDS_PAST_THE_LAST_KEPT_TOKEN words past the last kept one, and that one ends
    before any added token the cut may have split."""
    if not encoding.overflowing:
        return False
    kept = [(word, end) for word, (_, end) in zip(encoding.word_ids, encoding.offsets) if word is not None]
    later_words = [word for piece in encoding.overflowing for word in piece.word_ids if word is not None]
    if not kept or not later_words:
        return False
    last_word, last_end = kept[-1]
    return max(later_words) >= last_word + WORDS_PAST_THE_LAST_KEPT_TOKEN and \
        last_end <= prefix_chars - added_token_chars


def encode_long_text(tokenizer, text: str, cut: TextCut):
    """(encoding, the share of the text it was tokenized from) of a text longer than
    cut.first_cut_chars: a prefix of it once that keeps full tokenization's tokens, else the
    whole (collapsed) text, share 1.0; but never more than cut.last_cut_chars of it, where a
    text the check cannot pass (one word, a run of zero-token characters) is cut, share below 1:
    a truncated row, whether or not its tokens overflow."""
    prefix, encoding, share = long_text_prefix(tokenizer, text, cut)
    return encoding, share


def long_text_prefix(tokenizer, text: str, cut: TextCut):
    """(the prefix, its encoding, its share of the text) that `encode_long_text` settles on: a pair
    job encodes the pair from its texts' prefixes (pipeline/core/pairs.py)."""
    chars = cut.first_cut_chars
    while True:
        prefix, whole = text_prefix(text, chars, cut.collapse_runs)
        encoding = tokenizer.encode(prefix)
        if whole or chars >= cut.last_cut_chars or keeps_full_tokens(encoding, len(prefix), cut.added_token_chars):
            return prefix, encoding, 1.0 if whole else len(prefix) / len(text)
        chars = min(2 * chars, cut.last_cut_chars)


def has_long_word(encoding, limit: WordLimit) -> bool:
    """Whether a word of more than limit.max_chars characters became one unknown token in
    `encoding`: WordPiece gives such a word one [UNK] spanning all of it (an [UNK] for a short
    word it cannot piece spans that word, no more)."""
    ids = encoding.ids
    return limit.unk_id in ids and any(token == limit.unk_id and end - start > limit.max_chars
                                       for token, (start, end) in zip(ids, encoding.offsets))


# anything but whitespace, control characters (NUL, …) and invisible format characters (zero-width
# spaces and joiners, word joiner, byte-order mark, soft hyphen, direction marks)
VISIBLE_CHARACTER = re.compile(r"[^\s\x00-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u202a-\u202e"
                               r"\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb]")


def check_text(value) -> tuple[str | None, str | None]:
    """(the text to tokenize, None) or (None, why this value cannot be tokenized).
    Bytes (a binary text column) are decoded as UTF-8."""
    if value is None:
        return None, "text is null"
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as error:
            return None, f"text is not valid UTF-8 (byte {error.start}: {value[error.start:error.start + 4]!r})"
    if not isinstance(value, str):
        return None, f"text is a {type(value).__name__}, not a string"
    if not value.strip():
        return None, "text is empty or whitespace only"
    if not VISIBLE_CHARACTER.search(value):
        return None, "text has no visible characters"
    return value, None
