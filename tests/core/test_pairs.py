"""Named inputs, pure and fast: a text and its pair encoded as transformers encodes them, their hash,
their token types through the collate, and the usage errors of --job pair."""

import numpy as np
import pytest
from tokenizers import Tokenizer

from pipeline.core.errors import UsageError
from pipeline.core.collate import collate
from pipeline.core.pairs import longest_first
from pipeline.core.row_hashes import hash_columns, pair_hash, text_hash
from pipeline.core.tokenize import encode_texts, load_tokenizer_spec
from pipeline.offline.config import check_named_inputs


def test_longest_first_keeps_what_the_tokenizers_library_keeps_on_a_grid(minilm_path):
    """Differential: our arithmetic against the library's own truncation of real pairs of every length."""
    spec = load_tokenizer_spec(minilm_path, 8)
    library = Tokenizer.from_str(spec.tokenizer_json)
    for max_length in (5, 8, 9, 16):
        library.enable_truncation(max_length)
        for first in range(0, 15):
            for second in range(0, 15):
                encoding = library.encode(" ".join(["the"] * first), " ".join(["the"] * second))
                kept = np.array([s for s in encoding.sequence_ids if s is not None])
                ours = longest_first(np.array([first]), np.array([second]), max_length - 3)
                assert (int(ours[0][0]), int(ours[1][0])) == (int((kept == 0).sum()), int((kept == 1).sum())), \
                    (max_length, first, second)


def pair_rows(sample_table):
    """Real texts in pairs: short with long, long with short, both long, one of 20,000 characters."""
    texts = [t for t in sample_table["text"].to_pylist() if t][:60]
    firsts, seconds = texts[:30], texts[30:60][::-1]
    firsts[3] = " ".join(texts) [:20000]  # past the text cut: read from a prefix
    seconds[7] = " ".join(texts[::-1])[:20000]
    return firsts, seconds


@pytest.mark.parametrize("max_length", [32, 61, 64])
@pytest.mark.parametrize("model", ["bert", "xlmr"])
def test_pairs_encode_as_transformers_longest_first_with_their_token_types(model, max_length, sample_table,
                                                                           minilm_path, request):
    from transformers import AutoTokenizer

    path = minilm_path if model == "bert" else request.getfixturevalue("tiny_xlmr_reranker_path")
    reference = AutoTokenizer.from_pretrained(path)
    spec = load_tokenizer_spec(path, max_length, pair=True)
    assert spec.pair_types is (model == "bert")  # XLM-R types every token 0: nothing to carry
    firsts, seconds = pair_rows(sample_table)
    encoded = encode_texts(firsts, Tokenizer.from_str(spec.tokenizer_json), spec, pairs=seconds)
    expected = reference(firsts, seconds, truncation="longest_first", max_length=max_length)
    whole = reference(firsts, seconds)
    for row in range(len(firsts)):
        tokens = slice(encoded.offsets[row], encoded.offsets[row + 1])
        assert encoded.token_ids[tokens].tolist() == expected["input_ids"][row], row
        if model == "bert":
            assert encoded.type_ids[tokens].tolist() == expected["token_type_ids"][row], row
        assert encoded.truncated[row] == (len(whole["input_ids"][row]) > max_length)
    assert encoded.type_ids is None or len(encoded.type_ids) == len(encoded.token_ids)
    assert encoded.truncated.sum() > 5
    exact = [row for row in range(len(firsts)) if row not in (3, 7)]  # the two read from a prefix are estimated
    assert encoded.full_lengths[exact].tolist() == [len(whole["input_ids"][row]) for row in exact]


def test_a_row_with_either_text_missing_is_a_row_error_never_dropped(minilm_path):
    spec = load_tokenizer_spec(minilm_path, 32, pair=True)
    texts = ["a comment", None, "a comment", "a comment", "\ufffd", "a comment"]
    pairs = ["a rule", "a rule", None, "   ", "a rule", "\ufffd"]
    encoded = encode_texts(texts, Tokenizer.from_str(spec.tokenizer_json), spec, pairs=pairs)
    assert encoded.errors == [None, "text is null", "pair text is null", "pair text is empty or whitespace only",
                              "text has no tokens", "pair text has no tokens"]
    assert encoded.lengths.tolist()[1:] == [0] * 5 and encoded.lengths[0] > 0
    assert len(encoded.type_ids) == len(encoded.token_ids) == encoded.lengths.sum()
    nothing = encode_texts([None, "a"], Tokenizer.from_str(spec.tokenizer_json), spec, pairs=["a rule", None])
    assert nothing.lengths.tolist() == [0, 0] and len(nothing.type_ids) == 0
    single = encode_texts(["a comment"], Tokenizer.from_str(spec.tokenizer_json), load_tokenizer_spec(minilm_path, 32))
    assert single.type_ids is None  # a one-text job carries no types


def test_a_rows_pair_hash_is_its_text_and_its_pair_and_a_single_texts_hash_is_unchanged():
    assert pair_hash("ab", "c") != pair_hash("a", "bc")
    assert pair_hash("a", "b") != pair_hash("b", "a")
    assert pair_hash("a", None) is None and pair_hash(None, "b") is None
    assert pair_hash("a", "b") == pair_hash(b"a", b"b")
    single = hash_columns(["r1", "r2"], ["x", None])
    assert single.text_hashes.tolist() == [text_hash("x"), 0] and single.has_text_hash.tolist() == [True, False]
    paired = hash_columns(["r1", "r2", "r3"], ["x", "x", "x"], ["rule 1", "rule 2", None])
    assert paired.text_hashes[0] != paired.text_hashes[1]  # same text, another pair: another row
    assert paired.has_text_hash.tolist() == [True, True, False]
    assert paired.id_hashes.tolist() == hash_columns(["r1", "r2", "r3"], ["x"] * 3).id_hashes.tolist()


def test_token_types_are_collated_beside_the_ids_and_zero_at_padding():
    token_ids = np.array([101, 7, 102, 8, 102, 101, 9, 102, 10, 11, 102], np.int32)
    type_ids = np.array([0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1], np.int8)
    offsets = np.array([0, 5, 11])
    ids, mask, types = collate(token_ids, offsets, np.array([1, 0]), 8, 0, type_ids)
    assert ids.tolist() == [[101, 9, 102, 10, 11, 102, 0, 0], [101, 7, 102, 8, 102, 0, 0, 0]]
    assert types.tolist() == [[0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0, 0, 0]]
    assert mask.sum() == 11
    assert len(collate(token_ids, offsets, np.array([0]), 8, 0)) == 2  # one text: ids and mask only


@pytest.mark.parametrize("job, pair_column, long_text, message", [
    ("pair", None, "auto", "--job pair scores a text with its pair: set --pair-column"),
    ("moderate", "rule", "auto", "--pair-column is for --job pair, not --job moderate"),
    ("pair", "rule", "split", "--long-text split cuts one text into segments, which a pair cannot be"),
])
def test_named_inputs_that_do_not_fit_the_job_are_usage_errors(job, pair_column, long_text, message):
    with pytest.raises(UsageError, match=message):
        check_named_inputs(job, pair_column, long_text)
    check_named_inputs("pair", "rule", "truncate")
    check_named_inputs("embed", None, "split")


def test_an_out_of_memory_split_cuts_token_types_with_their_rows():
    import torch

    from pipeline.core.forward import forward_splitting_on_oom

    def forward(ids, mask, types):
        if ids.shape[0] > 3:
            raise torch.OutOfMemoryError("out of memory")
        assert (types == ids % 2).all()  # each part's types are its own rows'
        return {"sum": (ids + 10 * types).float()}

    ids = torch.arange(10).reshape(10, 1)
    result = forward_splitting_on_oom(forward, ids, torch.ones_like(ids), torch.device("cpu"), max_rows=8,
                                      token_type_ids=ids % 2)
    assert result.outputs["sum"][:, 0].tolist() == [i + 10 * (i % 2) for i in range(10)]
    assert result.splits == 3 and not result.failed.any()  # 8 → 4+4 → (2+2)+(2+2): three halvings; 2 left run whole


def test_types_travel_only_where_the_model_takes_them_and_they_differ(minilm_path, tiny_xlmr_reranker_path):
    from transformers import AutoTokenizer

    from pipeline.core.pairs import carries_pair_types

    assert carries_pair_types(AutoTokenizer.from_pretrained(minilm_path))  # BERT: 0 and 1
    assert not carries_pair_types(AutoTokenizer.from_pretrained(tiny_xlmr_reranker_path))  # every token 0
    distilbert_like = AutoTokenizer.from_pretrained(minilm_path, model_input_names=["input_ids", "attention_mask"])
    assert not carries_pair_types(distilbert_like)  # DistilBERT's forward takes no token_type_ids
