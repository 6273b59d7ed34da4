"""Per-row work happens where the strings are: the tokenizer workers hash ids and texts, the main
process handles columns (docs/performance.md, "The host feeds the device")."""

import numpy as np
import pyarrow as pa
import pytest

from pipeline.core.row_hashes import hash_columns, id_hash, text_hash
from pipeline.core.tokenize import TokenizerPool, concat_encoded, load_tokenizer_spec
from pipeline.offline.reuse import RETRYABLE_ERRORS, error_statuses
from pipeline.offline.reuse_index import OK, PERMANENT_ERROR, RETRYABLE_ERROR


def test_hash_columns_are_the_hashes_of_each_value():
    ids, texts = [1, None, "1", 7], ["a", "b", None, b"\xff"]
    columns = hash_columns(ids, texts)
    assert columns.id_hashes.tolist() == [id_hash(1), 0, id_hash("1"), id_hash(7)]
    assert columns.has_text_hash.tolist() == [True, False, False, True]  # a null id or text has none
    assert columns.text_hashes.tolist() == [text_hash("a"), 0, 0, text_hash(b"\xff")]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_pool_hashes_arrow_chunks_as_the_main_process_would(minilm_path, workers):
    spec = load_tokenizer_spec(minilm_path, 32)
    texts = pa.array([f"row {i} " * (i % 5) if i % 7 else None for i in range(700)])
    ids = pa.array([None if i == 3 else f"id-{i}" for i in range(700)])
    with TokenizerPool(spec, workers, chunk_rows=64) as pool:
        hashed = pool.result(pool.submit(texts, ids))
        plain = pool.result(pool.submit(texts.to_pylist()))
    expected = hash_columns(ids.to_pylist(), texts.to_pylist())
    np.testing.assert_array_equal(hashed.hashes.id_hashes, expected.id_hashes)
    np.testing.assert_array_equal(hashed.hashes.text_hashes, expected.text_hashes)
    np.testing.assert_array_equal(hashed.hashes.has_text_hash, expected.has_text_hash)
    assert plain.hashes is None
    np.testing.assert_array_equal(hashed.token_ids, plain.token_ids)  # Arrow in, the same tokens out
    assert hashed.errors == plain.errors and hashed.errors[7] == "text is null"


def test_a_run_hashes_no_row_in_the_main_process(tmp_path, rows_with_bad_ones, tiny_encoder_path, monkeypatch):
    """Dedupe and the text-hash file take the workers' hashes: the main process's hash_rows never runs."""
    import pipeline.offline.windows as windows
    from tests.conftest import run_to_table

    def refuse(*args):
        raise AssertionError("hash_rows ran in the main process")

    monkeypatch.setattr(windows, "hash_rows", refuse)
    output, summary = run_to_table(tmp_path, "run", rows_with_bad_ones, [120, 80], model=tiny_encoder_path,
                                   max_length=32, tokenize_workers=1)
    assert output["id"].to_pylist() == rows_with_bad_ones["id"].to_pylist() and summary["rows"] == 200


def test_error_statuses_are_each_rows_status_column_wise():
    errors = pa.array([None, f"{RETRYABLE_ERRORS[0]} even alone at padded length 64", "text is null",
                       f"{RETRYABLE_ERRORS[1]} (nan or inf) in bfloat16", None])
    assert error_statuses(errors).to_pylist() == [OK, RETRYABLE_ERROR, PERMANENT_ERROR, RETRYABLE_ERROR, OK]
    assert error_statuses(pa.chunked_array([errors[:2], errors[2:]])).to_pylist() == \
        [OK, RETRYABLE_ERROR, PERMANENT_ERROR, RETRYABLE_ERROR, OK]
    assert error_statuses(pa.nulls(3, pa.string())).to_pylist() == [OK] * 3


def test_token_ids_come_back_through_a_slot_not_the_pools_pipe(minilm_path):
    """A task's result carries no token ids: the worker wrote them into the run's slot; the pool's result has
    the same tokens, row for row, as tokenizing in this process."""
    spec = load_tokenizer_spec(minilm_path, 32)
    texts = pa.array([f"row {i} " * (i % 9) if i % 11 else None for i in range(500)])
    with TokenizerPool(spec, 1, chunk_rows=128) as pool:
        pending = pool.submit(texts)
        sent = [slot.read(pool._pool.result(task)) for task, slot in pending]
        through_slots = concat_encoded(sent, [slot for _, slot in pending])
    here = TokenizerPool(spec, 0, chunk_rows=128)
    expected = here.result(here.submit(texts))
    assert [len(part.token_ids) for part in sent] == [0, 0, 0, 0]
    assert sum(int(part.offsets[-1]) for part in sent) == len(expected.token_ids) > 1000
    assert through_slots.token_ids.tolist() == expected.token_ids.tolist()
    assert through_slots.offsets.tolist() == expected.offsets.tolist() and through_slots.errors == expected.errors


def test_a_slot_too_small_for_a_tasks_tokens_leaves_them_in_the_result():
    from pipeline.core.shared_arrays import InSlot, TokenSlot, into_slot
    from pipeline.core.tokenize import EncodedRows

    def task_of(token_ids):  # a task's result of one row of 5 tokens, its ids with it or not
        return EncodedRows(token_ids, np.array([0, 5], np.int32), np.zeros(1, bool), ["an error kept"], 0.0)

    slot = TokenSlot(capacity=4)
    reply = into_slot(slot.path, slot.capacity, task_of(np.arange(5, dtype=np.int32)))
    left = slot.read(reply)
    assert isinstance(reply, InSlot) and reply.offset == 16 and left.token_ids.tolist() == [0, 1, 2, 3, 4]
    out = np.zeros(7, np.int32)
    slot.copy_into(left, out[1:6])
    fits = TokenSlot(capacity=6)
    read = fits.read(into_slot(fits.path, fits.capacity, task_of(np.arange(5, dtype=np.int32) + 10)))
    assert read.token_ids.tolist() == [] and read.errors == ["an error kept"] and read.offsets.tolist() == [0, 5]
    into_window = np.zeros(7, np.int32)
    fits.copy_into(read, into_window[1:6])  # read from the slot into its place
    assert out.tolist() == [0, 0, 1, 2, 3, 4, 0] and into_window.tolist() == [0, 10, 11, 12, 13, 14, 0]
