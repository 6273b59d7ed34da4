"""Long texts tokenized from a prefix: the same tokens and truncated flag as full tokenization,
with memory bounded by --max-length, not by the text."""

from __future__ import annotations

import random

import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from pipeline.core.textcut import (
    TextCut,
    WordLimit,
    collapse_runs,
    encode_long_text,
    text_cut_for,
    text_prefix,
    word_limit_for,
)
from tests.conftest import run_one_huge_row
from pipeline.core.tokenize import encode_texts, load_tokenizer_spec, prepare_text

CORPUS = ["the quick brown fox jumps over the lazy dog, don't it's 12345 naïve café 東京 🙂"] * 50
PIECES = ["the", "quick", "supercalifragilistic", "naïve", "Ünïcödé", "東京", "🙂", ".", ",", "!!", "'s", " ", "  ",
          "\n\n", "\t", "\x00", "\u200b", "\u00ad", "\ufffd", "e\u0301", "don't", "12345", "x-y", "a" * 150,
          "   \n \x00 \u200b  ", "[SEP]", "[CLS]", "[MASK]", "<|endoftext|>", "<s>"]


def byte_level_tokenizer() -> Tokenizer:
    """GPT-2 style: byte-level BPE, whitespace runs are tokens, an added token of 13 characters."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A <|endoftext|>",
                                                             special_tokens=[("<|endoftext|>", 0)])
    return tokenizer


def metaspace_tokenizer() -> Tokenizer:
    """SentencePiece style: Unigram over Metaspace words, a normalizer that collapses double spaces."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace("  ", " ")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=100, unk_token="<unk>",
                                                                  special_tokens=["<s>", "</s>", "<unk>"]))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                             special_tokens=[("<s>", 0), ("</s>", 1)])
    return tokenizer


@pytest.fixture(scope="module")
def minilm_tokenizer(minilm_path) -> Tokenizer:
    return Tokenizer.from_str(load_tokenizer_spec(minilm_path, 8).tokenizer_json)


@pytest.mark.parametrize("family", ["bert", "byte-level", "metaspace"])
def test_a_prefix_keeps_exactly_the_tokens_of_full_tokenization(family, minilm_tokenizer):
    """Differential: random texts of words, punctuation, whitespace runs, removed characters and
    added tokens, every one cut from a first prefix of 1 to 40 characters (so the cut lands
    everywhere), against the whole text tokenized with truncation."""
    tokenizer = {"bert": lambda: minilm_tokenizer, "byte-level": byte_level_tokenizer,
                 "metaspace": metaspace_tokenizer}[family]()
    rng = random.Random(family)
    cut_rows = 0
    for max_length in (4, 8, 16):
        tokenizer.enable_truncation(max_length)
        real = text_cut_for(tokenizer.to_str(), max_length)
        for first_cut in (1, 3, 10, 40):
            cut = TextCut(first_cut, real.collapse_runs, real.added_token_chars, last_cut_chars=10 ** 6)
            for _ in range(120):
                text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 40)))
                encoding, share = encode_long_text(tokenizer, text, cut)
                full = tokenizer.encode(text)
                assert (encoding.ids, bool(encoding.overflowing)) == (full.ids, bool(full.overflowing)), repr(text)
                cut_rows += share < 1
    assert cut_rows > 500  # most texts were tokenized from a prefix, not whole


def test_the_cut_settings_of_the_tokenizer_families(minilm_tokenizer):
    # "telecommunications", 18 characters; [MASK]; at least COUNTED_TOKENS tokens whole
    assert text_cut_for(minilm_tokenizer.to_str(), 256) == TextCut(514 * 18, True, 6, 8 * 514 * 18)
    assert text_cut_for(minilm_tokenizer.to_str(), 1024).first_cut_chars == 1026 * 18
    byte_level = text_cut_for(byte_level_tokenizer().to_str(), 8)
    metaspace = text_cut_for(metaspace_tokenizer().to_str(), 8)
    assert not byte_level.collapse_runs and byte_level.added_token_chars == 13  # spaces are tokens there
    assert not metaspace.collapse_runs and metaspace.added_token_chars == 5


def test_zero_token_runs_collapse_so_a_prefix_reaches_the_words():
    """10 MB of spaces, then words: the prefix tried holds the words, not the spaces."""
    text = " \t" * 5_000_000 + "\x00\u200b\x00 words after the run"
    assert collapse_runs("a  b\x00\x00c \x00\n d\u200b\u200be") == "a b\x00c d\u200be"
    assert text_prefix(text, 12, collapse=True) == (" words after", False)
    assert text_prefix(text, 100, collapse=True) == (" words after the run", True)
    assert text_prefix(text, 12, collapse=False) == (" \t" * 6, False)


def test_rows_near_the_first_cut_give_the_ids_of_uncut_tokenization(minilm_path):
    """Through encode_texts with the real settings (max_length 32: first cut 514 × 18 characters):
    rows just under, at and over it, far over it, and behind a whitespace run."""
    spec = load_tokenizer_spec(minilm_path, max_length=32, prompt="query: ")
    first_cut = text_cut_for(spec.tokenizer_json, 32).first_cut_chars
    assert first_cut == 514 * 18
    words = "Longer words, a comma; naïve café — and 東京 too. " * 4000
    texts = [words[:first_cut - len(spec.prompt) + d] for d in (-1, 0, 1, 2, 50)]
    texts += [words, "\n \t" * 20_000 + words, "!" * first_cut * 3, "x" * first_cut * 3]
    reference = Tokenizer.from_str(spec.tokenizer_json)
    encoded = encode_texts(texts, reference, spec)
    for row, text in enumerate(texts):
        full = reference.encode(prepare_text(spec, text))
        assert encoded.token_ids[encoded.offsets[row]:encoded.offsets[row + 1]].tolist() == full.ids, row
        long_word = text.startswith("x")  # one [UNK] for the whole word: marked, though nothing overflowed
        assert encoded.truncated[row] == (bool(full.overflowing) or long_word) and encoded.errors[row] is None
    assert encoded.truncated.tolist() == [True] * 9  # the last: a 27,756-character word, one [UNK]
    # a cut row's length before truncation is estimated from its prefix: within 2% for an even text
    full = reference.encode(prepare_text(spec, words))
    full_length = 2 + sum(len(piece.ids) - sum(piece.special_tokens_mask) for piece in [full, *full.overflowing])
    assert abs(encoded.full_lengths[5] - full_length) / full_length < 0.02


@pytest.mark.slow
def test_a_50_mb_text_runs_under_a_memory_cap(tmp_path, tiny_encoder_path):
    """One 50 MB row among short ones through a real `lengthwise run`, capped at 6 GiB of address
    space: the tokenizer used to keep ~160 bytes per character of it (~8 GB more). Its row gets a
    result, truncated, and costs the run's peak resident set under 512 MiB (309 MiB measured)."""
    words = ("lorem ipsum dolor sit amet consectetur " * 1_300_000)[:50_000_000]
    finished, peak_rss_kib = run_one_huge_row(tmp_path, tiny_encoder_path, words)
    assert peak_rss_kib < 512 << 10, f"the row cost {peak_rss_kib / 2 ** 10:.0f} MiB of peak resident set"
    output = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    assert output["id"].to_pylist() == [1, 2, 3] and output["error"].to_pylist() == [None, None, None]
    assert output["truncated"].to_pylist() == [False, True, False]


RUNS_WITHOUT_SPACES = {"ascii": "a", "emoji": "\U0001f642", "cjk": "\u6771"}  # BERT: one word, one word, a word each


@pytest.mark.parametrize("kind", list(RUNS_WITHOUT_SPACES))
def test_a_run_without_spaces_is_tokenized_from_at_most_the_last_cut_and_marked(kind, minilm_path):
    """2 MB of one character and no space: the prefix check never passes for one word, so it was
    tokenized whole (~85 bytes a character for ASCII, ~340 for emoji; 20 MB took 2 GB and a
    minute) and came back one [UNK], `truncated = false`. Now it stops at the last cut, truncated."""
    spec = load_tokenizer_spec(minilm_path, max_length=128)
    tokenizer = Tokenizer.from_str(spec.tokenizer_json)
    cut = text_cut_for(spec.tokenizer_json, 128)
    assert cut.last_cut_chars == 8 * cut.first_cut_chars == 74_016
    text = RUNS_WITHOUT_SPACES[kind] * 2_000_000
    encoding, share = encode_long_text(tokenizer, text, cut)
    assert round(share * len(text)) <= cut.last_cut_chars
    encoded = encode_texts(["first", text, "last"], tokenizer, spec)
    assert encoded.truncated.tolist() == [False, True, False] and encoded.errors == [None, None, None]
    assert encoded.lengths.tolist()[1] == (3 if kind != "cjk" else 128)  # [CLS] [UNK] [SEP], or 126 characters


def test_a_text_with_no_tokens_in_its_last_cut_says_how_far_it_was_read(minilm_path):
    """U+FFFD gives BERT no token and is no whitespace to collapse: past the last cut it is not read on."""
    spec = load_tokenizer_spec(minilm_path, max_length=128)
    texts = ["\ufffd" * 200_000, "\ufffd" * 100_000 + " words after it", "\ufffd"]
    encoded = encode_texts(texts, Tokenizer.from_str(spec.tokenizer_json), spec)
    assert encoded.errors == ["text has no tokens in its first 74,016 characters, the most a row is read"] * 2 + \
        ["text has no tokens"]
    assert encoded.lengths.tolist() == [0, 0, 0] and encoded.truncated.tolist() == [False, False, False]


def test_a_word_wordpiece_reads_as_one_unk_for_its_length_marks_its_row_truncated(minilm_path, sample_table):
    """BERT's WordPiece makes a word of more than 100 characters (max_input_chars_per_word) one
    [UNK]: the row's result would silently miss it. An [UNK] for a short unknown word is not
    marked, nor are CJK characters (a word each), nor any row of the shipped sample."""
    spec = load_tokenizer_spec(minilm_path, max_length=128)
    tokenizer = Tokenizer.from_str(spec.tokenizer_json)
    assert word_limit_for(spec.tokenizer_json) == WordLimit(tokenizer.token_to_id("[UNK]"), 100)
    texts = ["a fine row", "see " + "x" * 101 + " here", "see " + "x" * 100 + " here", "\U0001f642" * 101,
             "hello\U0001f642world, \U0001f642", "\u6771" * 120, "caf\u00e9 " + "na\u00efve" * 20,
             "caf\u00e9 " + "na\u00efve" * 21]  # 100 and 105 characters, as the normalizer leaves them
    encoded = encode_texts(texts, tokenizer, spec)
    assert encoded.truncated.tolist() == [False, True, False, True, False, False, False, True]
    assert encoded.errors == [None] * len(texts)
    sample = sample_table["text"].to_pylist()
    overflowed = [bool(tokenizer.encode(text).overflowing) for text in sample]
    assert encode_texts(sample, tokenizer, spec).truncated.tolist() == overflowed and 0 < sum(overflowed)
    assert word_limit_for(byte_level_tokenizer().to_str()) is None  # BPE and Unigram read a word of any length
    assert word_limit_for(metaspace_tokenizer().to_str()) is None


@pytest.mark.slow
def test_a_20_mb_run_without_spaces_costs_under_256_mib(tmp_path, tiny_encoder_path):
    """20 MB of one character and no space through a real `lengthwise run`: it peaked at 1.9-2.0 GB
    (~1.4 GB over the same run without it) and took 60-190 s, and its row got a meaningless result
    with `truncated = false`. The tokenizer worker now stays under 100 MiB; the row costs the run's peak
    ~160 MiB, the main process holding the text (once the texts went to the workers as Arrow buffers)."""
    kind = "emoji"  # multi-byte; tests/offline/test_long_text.py runs an ASCII one, split
    text = RUNS_WITHOUT_SPACES[kind] * (20_000_000 // len(RUNS_WITHOUT_SPACES[kind].encode()))
    finished, peak_rss_kib = run_one_huge_row(tmp_path, tiny_encoder_path, text)
    assert peak_rss_kib < 256 << 10, f"the row cost {peak_rss_kib / 2 ** 10:.0f} MiB of peak resident set"
    output = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    assert output["error"].to_pylist() == [None, None, None]
    assert output["truncated"].to_pylist() == [False, True, False]
