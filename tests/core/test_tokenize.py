"""The tokenizer pool: same ids as the Hugging Face tokenizer, in-process or on workers."""

import os
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from transformers import AutoTokenizer

from pipeline.core.tokenize import TokenizerPool, check_text, load_tokenizer_spec, rows_without_error

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


def test_check_text_kinds():
    assert check_text("fine") == ("fine", None)
    assert check_text("naïve".encode()) == ("naïve", None)
    assert check_text(None) == (None, "text is null")
    assert check_text(3) == (None, "text is a int, not a string")
    assert check_text("\n\t ") == (None, "text is empty or whitespace only")
    assert check_text("\u200b\x00\u00ad\ufeff") == (None, "text has no visible characters")
    assert check_text("\u200bx") == ("\u200bx", None)
    text, error = check_text(b"ok \xff\xfe bytes")
    assert text is None and error.startswith("text is not valid UTF-8 (byte 3")


INVISIBLE = ["\u200b", "\u200c\u200d", "\u2060", "\ufeff", "\x00", "\x00\x00 \x00", "\u00ad", "\u200b \ufeff\n"]


def test_texts_of_only_invisible_characters_are_row_errors(spec, minilm_path):
    """Zero-width characters, NUL and soft hyphens survive strip() but are no text: before, they
    got the embedding of [CLS][SEP] and no error."""
    reference = AutoTokenizer.from_pretrained(minilm_path)
    with TokenizerPool(spec, workers=0) as pool:
        encoded = pool.result(pool.submit(INVISIBLE + ["a\u200bb", "soft\u00adhyphen"]))
    assert encoded.errors == ["text has no visible characters"] * len(INVISIBLE) + [None, None]
    assert encoded.lengths.tolist()[:len(INVISIBLE)] == [0] * len(INVISIBLE)
    assert encoded.token_ids.tolist() == reference("a\u200bb")["input_ids"] + reference("soft\u00adhyphen")["input_ids"]


@pytest.mark.parametrize("post_processor", [True, False])
def test_text_with_only_special_tokens_is_a_row_error(spec, post_processor):
    """U+FFFD and private-use characters are visible, but the BERT normalizer removes them: the
    row's only tokens would be [CLS] and [SEP] (or none, without a post-processor)."""
    import dataclasses
    import json

    tokenizer = json.loads(spec.tokenizer_json)
    if not post_processor:
        tokenizer["post_processor"] = None
    with TokenizerPool(dataclasses.replace(spec, tokenizer_json=json.dumps(tokenizer)), workers=0) as pool:
        encoded = pool.result(pool.submit(["\ufffd", "\ue000 \ufffd", "word"]))
    assert encoded.errors == ["text has no tokens", "text has no tokens", None]
    assert encoded.lengths.tolist() == [0, 0, 3 if post_processor else 1]
    assert encoded.truncated.tolist() == [False, False, False] and len(encoded.token_ids) == encoded.lengths.sum()


def test_a_prompt_alone_is_not_a_text(minilm_path):
    """With a prompt every row has the prompt's tokens; a row with no more has no text tokens."""
    spec = load_tokenizer_spec(minilm_path, max_length=32, prompt="query: ")
    with TokenizerPool(spec, workers=0) as pool:
        encoded = pool.result(pool.submit(["\ufffd", "word"]))
    assert encoded.errors == ["text has no tokens", None]
    assert encoded.lengths.tolist() == [0, 5]  # [CLS] query : word [SEP]


def test_spec_disables_padding_and_keeps_pad_id(spec):
    assert spec.max_length == 32 and spec.pad_token_id == 0
    assert '"padding":null' in spec.tokenizer_json.replace(" ", "")


def test_a_pool_started_without_waiting_comes_up_on_first_use(spec):
    """The run starts the pool before it loads the model; the processes come up meanwhile."""
    with TokenizerPool(spec, workers=2, wait=False) as pool:
        first_wait = pool.ready()
        assert first_wait >= 0.0 and pool.ready() == 0.0  # seen up once, never waited for again
        encoded = pool.result(pool.submit(["one", "two"]))
    assert encoded.errors == [None, None] and len(encoded) == 2


def test_once_every_worker_is_up_no_spec_file_is_left_and_the_run_process_holds_no_pool_thread(spec):
    """What a SIGKILL of the parent would leave behind is gone as soon as the pool is up; results are read by the
    caller's own thread (no executor feeder or manager thread), and large tasks and results travel whole."""
    threads_before = {thread.ident for thread in threading.enumerate()}
    with TokenizerPool(spec, workers=2, wait=False) as pool:
        spec_file = Path(pool._spec_file)
        assert spec_file.exists()
        pool.ready()
        assert not spec_file.exists()
        texts = [f"row {index} " + "word " * 20 for index in range(3000)]  # tasks and results over the inline limit
        encoded = pool.result(pool.submit(texts, ids=pa.array([f"id-{index}" for index in range(3000)])))
        assert {thread.ident for thread in threading.enumerate()} == threads_before
    here = TokenizerPool(spec, workers=0)
    reference = here.result(here.submit(texts))
    assert len(encoded) == 3000 and encoded.errors == [None] * 3000
    assert np.array_equal(encoded.token_ids, reference.token_ids) and np.array_equal(encoded.offsets, reference.offsets)
    assert len(encoded.hashes.text_hashes) == 3000


def test_a_worker_killed_mid_task_fails_the_waiting_result_instead_of_hanging(spec):
    with TokenizerPool(spec, workers=2) as pool:
        worker = pool._pool.processes[0]
        pending = pool.submit(["word " * 30] * 20000)
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(BrokenProcessPool, match="exit code -9"):
            pool.result(pending)
        assert time.monotonic() - started < 30
        with pytest.raises(BrokenProcessPool):
            pool.submit(["after"])  # the pool stays broken: the killed worker's task is lost
        workers = pool._pool
        pool.close()
        with pytest.raises(BrokenProcessPool, match="closed"):
            workers.result(0)


def test_setup_steps_add_up_to_the_setup_time():
    from pipeline.core.clock import SetupClock

    clock = SetupClock()
    clock.add("model load", 0.5)
    clock.add("batch plan", 0.25)
    clock.add("model load", 0.25)  # a step timed twice adds up
    assert clock.breakdown(1.2) == {"model load": 0.75, "batch plan": 0.25, "other": 0.2}
    assert clock.breakdown(0.5)["other"] == 0.0  # never negative


def test_pool_tasks_spread_each_submit_over_the_workers_within_their_bounds():
    from pipeline.core.tokenize import chunk_rows_for

    assert chunk_rows_for(65_536, 13) == 1_261  # a GPU window: 4 tasks a worker
    assert chunk_rows_for(8_192, 2) == 1_024  # a CPU window on 2 cores
    assert chunk_rows_for(8_192, 16) == 256  # never so small that handing results over costs much a row
    assert chunk_rows_for(1_000_000, 2) == 2_048
    assert chunk_rows_for(10, 0) == 256


def test_rows_without_error_marks_each_row_whose_error_is_none():
    assert rows_without_error([None, "empty text", None, "not a string"]).tolist() == [True, False, True, False]
    assert rows_without_error([None] * 3).tolist() == [True] * 3
    assert rows_without_error([]).tolist() == []
