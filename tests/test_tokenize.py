"""The tokenizer pool: same ids as the Hugging Face tokenizer, in-process or on workers."""

import numpy as np
import pytest
from transformers import AutoTokenizer

from pipeline.tokenize import TokenizerPool, load_tokenizer_spec, row_error

TEXTS = ["A short one.", "word " * 400, None, "   ", "Ünïcödé and emoji 🙂 text", "", "last row"]


@pytest.fixture(scope="module")
def spec(minilm_path):
    return load_tokenizer_spec(minilm_path, max_length=32)


@pytest.mark.parametrize("workers", [0, 2])
def test_ids_match_the_hf_tokenizer_and_bad_rows_become_errors(spec, minilm_path, workers):
    reference = AutoTokenizer.from_pretrained(minilm_path)
    with TokenizerPool(spec, workers=workers, chunk_rows=2) as pool:
        encoded = pool.result(pool.submit(TEXTS))
    assert len(encoded) == len(TEXTS)
    assert encoded.errors == [None, None, "text is null", "text is empty or whitespace only", None,
                              "text is empty or whitespace only", None]
    for i, text in enumerate(TEXTS):
        ids = encoded.token_ids[encoded.offsets[i]:encoded.offsets[i + 1]].tolist()
        if encoded.errors[i] is None:
            assert ids == reference(text, truncation=True, max_length=32)["input_ids"]
        else:
            assert ids == []
    assert encoded.truncated.tolist() == [False, True, False, False, False, False, False]
    assert encoded.lengths.tolist()[1] == 32
    assert encoded.token_ids.dtype == np.int32
    assert encoded.encode_s > 0


def test_row_error_kinds():
    assert row_error("fine") is None
    assert row_error(None) == "text is null"
    assert row_error(3) == "text is a int, not a string"
    assert row_error("\n\t ") == "text is empty or whitespace only"


def test_spec_disables_padding_and_keeps_pad_id(spec):
    assert spec.max_length == 32 and spec.pad_token_id == 0
    assert '"padding":null' in spec.tokenizer_json.replace(" ", "")
