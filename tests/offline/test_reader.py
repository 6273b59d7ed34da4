"""The shard reader process: a run's blocks are read by a process of its own and mapped, not decoded, by the
run's; the blocks and outputs equal those read in the run's process, failures included; its log lines reach
the run's log; a killed reader stops the run with a clear error (docs/performance.md, "The host feeds the
device")."""

import logging
import os
import socket
import threading
from multiprocessing.connection import Connection

import pyarrow as pa
import pytest

import pipeline.offline.reader as reader_module
import pipeline.offline.source as source
from pipeline.offline.reader import ReaderDied, ShardReader, ShardReaders, serve
from pipeline.offline.source import list_shards, read_blocks
from tests.conftest import run_to_table, write_shards


def as_rows(blocks) -> list[tuple]:
    return [(b.shard_index, b.first_row, b.is_last_of_shard, b.failure, b.ids.to_pylist(), b.texts.to_pylist(),
             None if b.errors is None else b.errors.to_pylist(), {k: v.to_pylist() for k, v in b.kept.items()})
            for b in blocks]


def test_a_run_reads_its_shards_in_another_process_with_the_same_outputs(tmp_path, rows_with_bad_ones,
                                                                         tiny_encoder_path, monkeypatch):
    """No shard is decoded by the run's process; the reader is a process of its own, stopped with the run; the
    outputs, kept columns included, equal those of a run that reads in its own process, cell for cell."""
    readers, read_here = [], []
    real_init, real_batches = ShardReader.__init__, source.record_batches

    def recording_init(self):
        real_init(self)
        readers.append(self)

    def recording_batches(url, *args, **kwargs):
        read_here.append(url)
        return real_batches(url, *args, **kwargs)

    table = rows_with_bad_ones.append_column("tag", pa.array([f"t{i % 7}" for i in range(200)]))
    monkeypatch.setattr(ShardReader, "__init__", recording_init)
    monkeypatch.setattr(source, "record_batches", recording_batches)
    here, _ = run_to_table(tmp_path, "here", table, [120, 80], model=tiny_encoder_path, max_length=32,
                           keep_columns=("tag",), window_rows=48)
    assert readers == [] and len(read_here) == 3  # 200 rows: fewer than a reader process pays for
    assert [url.rsplit("/", 1)[1] for url in read_here] == ["part-00000.parquet", "part-00000.parquet",
                                                            "part-00001.parquet"]  # the setup's sample, then the rows

    monkeypatch.setattr(reader_module, "READER_PROCESS_MIN_ROWS", 1)
    read_here.clear()
    there, summary = run_to_table(tmp_path, "there", table, [120, 80], model=tiny_encoder_path, max_length=32,
                                  keep_columns=("tag",), window_rows=48)
    assert [url.rsplit("/", 1)[1] for url in read_here] == ["part-00000.parquet"]  # the rows were read by the reader
    assert [r.process.pid != os.getpid() and r.process.returncode for r in readers] == [0]  # one, stopped
    assert summary["rows"] == 200 and summary["error_rows"] == 4
    assert there.equals(here)


def test_blocks_from_a_reader_equal_those_read_here_failures_and_kept_columns_included(tmp_path):
    table = pa.table({"id": [f"r{i}" for i in range(30)], "text": [None if i == 4 else f"text {i}" for i in range(30)],
                      "tag": [i % 3 for i in range(30)]})
    write_shards(tmp_path / "in", table, [10, 0, 20])
    (tmp_path / "in" / "part-00003.parquet").write_bytes(b"PAR1 not parquet PAR1")
    shards = list_shards([str(tmp_path / "in")], "id", "text", keep_columns=["tag"])
    expected = as_rows(read_blocks(shards, "id", "text", 7, keep_columns=["tag"]))
    reader = ShardReader()
    try:
        assert as_rows(reader.blocks(shards, "id", "text", 7, keep_columns=["tag"])) == expected
        assert reader.idle  # its stream ended: the next stream may use it
        assert as_rows(reader.blocks(shards[:1], "id", "text", 4, keep_columns=["tag"])) == \
            as_rows(read_blocks(shards[:1], "id", "text", 4, keep_columns=["tag"]))
    finally:
        reader.close()
    assert reader.process.returncode == 0
    assert [row[0] for row in expected] == [0, 0, 1, 2, 2, 2, 3]  # shards of 10, 0 and 20 rows in blocks of 7
    assert [bool(row[3]) for row in expected] == [False] * 6 + [True]  # the broken shard's failure


def test_a_reader_left_in_the_middle_of_its_stream_is_stopped_not_reused(tmp_path, monkeypatch):
    write_shards(tmp_path / "in", pa.table({"id": [f"r{i}" for i in range(40)], "text": ["x"] * 40}), [40])
    shards = list_shards([str(tmp_path / "in")], "id", "text")
    monkeypatch.setattr(reader_module, "READER_PROCESS_MIN_ROWS", 1)
    started = []
    real_init = ShardReader.__init__
    monkeypatch.setattr(ShardReader, "__init__", lambda self: (real_init(self), started.append(self))[0])
    readers = ShardReaders()
    assert sum(b.num_rows for b in readers.blocks(shards, "id", "text", 10)) == 40
    stream = readers.blocks(shards, "id", "text", 10)
    assert next(stream).num_rows == 10
    stream.close()
    assert len(started) == 1 and started[0].process.returncode == 0  # reused, then stopped when left
    assert sum(b.num_rows for b in readers.blocks(shards, "id", "text", 10)) == 40
    readers.close()
    assert len(started) == 2 and started[1].process.returncode == 0


def test_a_readers_log_lines_reach_the_runs_log(tmp_path, monkeypatch, caplog):
    """A transient error's retry, logged where the reading happens, is logged by the run's process (the
    protocol, served here in a thread)."""
    write_shards(tmp_path / "in", pa.table({"id": ["a", "b"], "text": ["x", "y"]}), [2])
    shards = list_shards([str(tmp_path / "in")], "id", "text")
    real_batches = source.record_batches

    def logging_batches(url, *args, **kwargs):
        source.log.warning(f"reading {url}: ConnectionError: reset; reopening after row 0 (retry 1/4 in 0.1s)")
        return real_batches(url, *args, **kwargs)

    monkeypatch.setattr(source, "record_batches", logging_batches)
    ours, theirs = socket.socketpair()
    server = threading.Thread(target=serve, args=(Connection(os.dup(theirs.fileno())), theirs))
    server.start()
    reader = ShardReader.__new__(ShardReader)
    reader._socket, reader._connection, reader.idle = ours, Connection(os.dup(ours.fileno())), True
    with caplog.at_level(logging.WARNING, logger="pipeline.offline.source"):
        blocks = list(reader.blocks(shards, "id", "text", 10))
    reader._connection.close()
    ours.close()
    server.join(timeout=10)
    assert [b.ids.to_pylist() for b in blocks] == [["a", "b"]]
    forwarded = [r for r in caplog.records if r.name == "pipeline.offline.source" and "reopening" in r.getMessage()]
    assert len(forwarded) == 2  # logged in the serving thread (this process) and again as forwarded


def test_a_killed_reader_stops_the_run_with_a_clear_error(tmp_path):
    write_shards(tmp_path / "in", pa.table({"id": [f"r{i}" for i in range(40)], "text": ["x"] * 40}), [40])
    shards = list_shards([str(tmp_path / "in")], "id", "text")
    reader = ShardReader()
    reader.process.kill()
    reader.process.wait()
    with pytest.raises(ReaderDied, match=r"the shard reader process \(pid \d+\) exited with code -9; the shards "
                                         r"not committed are redone by a rerun of the same command"):
        list(reader.blocks(shards, "id", "text", 10))
    reader.close()


def test_a_reader_block_is_a_mapping_of_the_readers_memory_not_a_copy(tmp_path):
    texts = [f"{i:05d} " + "some text " * 10 for i in range(5000)]  # ~0.5 MB of text
    write_shards(tmp_path / "in", pa.table({"id": [f"r{i}" for i in range(5000)], "text": texts}), [5000])
    shards = list_shards([str(tmp_path / "in")], "id", "text")
    reader = ShardReader()
    try:
        allocated = pa.total_allocated_bytes()
        [block] = reader.blocks(shards, "id", "text", 10_000)
        assert pa.total_allocated_bytes() - allocated < 10_000  # its arrays are not in this process's Arrow memory
    finally:
        reader.close()
    assert not block.texts.buffers()[2].is_mutable  # a read-only mapping of what the reader process wrote
    assert block.texts.to_pylist() == texts


def test_two_streams_at_once_take_two_readers_both_kept_for_the_next(tmp_path, monkeypatch):
    """A Ray actor reads its next shard while the current one runs: each stream has a reader of its own."""
    write_shards(tmp_path / "in", pa.table({"id": [f"r{i}" for i in range(30)], "text": ["x"] * 30}), [10, 20])
    shards = list_shards([str(tmp_path / "in")], "id", "text")
    monkeypatch.setattr(reader_module, "READER_PROCESS_MIN_ROWS", 1)
    readers = ShardReaders()
    try:
        first, second = readers.blocks(shards[:1], "id", "text", 4), readers.blocks(shards[1:], "id", "text", 4)
        rows = [b.ids.to_pylist() for pair in zip(first, second) for b in pair]  # interleaved
        rows += [b.ids.to_pylist() for b in second]
        assert sorted(i for ids in rows for i in ids) == sorted(f"r{i}" for i in range(30))
        assert len(readers._idle) == 2
        pids = {reader.process.pid for reader in readers._idle}
        assert sum(b.num_rows for b in readers.blocks(shards, "id", "text", 8)) == 30
        assert {reader.process.pid for reader in readers._idle} == pids  # reused, no third started
    finally:
        readers.close()


def test_tokenizer_workers_map_a_readers_block_instead_of_taking_its_bytes(tmp_path, minilm_path):
    """A task of a block the reader read names where its texts and ids lie (core/shared_arrays.py); the worker
    maps them and gives the same tokens and row hashes as a task of the same texts as values."""
    from pipeline.core.shared_arrays import ArrayInMemory, chunk_of
    from pipeline.core.tokenize import TokenizerPool, load_tokenizer_spec

    texts = [None if i == 3 else f"row {i}: " + "a few words " * (i % 9) for i in range(300)]
    write_shards(tmp_path / "in", pa.table({"id": [f"r{i}" for i in range(300)], "text": texts}), [300])
    shards = list_shards([str(tmp_path / "in")], "id", "text")
    reader = ShardReader()
    try:
        [block] = reader.blocks(shards, "id", "text", 1000)
    finally:
        reader.close()
    piece = chunk_of(block.texts, 100, 50)
    assert isinstance(piece, ArrayInMemory) and piece.array().to_pylist() == texts[100:150]
    assert not isinstance(chunk_of(pa.array(texts), 100, 50), ArrayInMemory)  # an array of this process's own
    spec = load_tokenizer_spec(minilm_path, 32)
    with TokenizerPool(spec, workers=1, chunk_rows=64) as pool:
        mapped = pool.result(pool.submit(block.texts, block.ids))
        copied = pool.result(pool.submit(pa.array(texts), pa.array([f"r{i}" for i in range(300)])))
    assert mapped.token_ids.tolist() == copied.token_ids.tolist() and mapped.offsets.tolist() == copied.offsets.tolist()
    assert mapped.errors == copied.errors and mapped.errors[3] is not None
    assert mapped.hashes.text_hashes.tolist() == copied.hashes.text_hashes.tolist()
    assert mapped.hashes.id_hashes.tolist() == copied.hashes.id_hashes.tolist()
    assert len(set(mapped.hashes.id_hashes)) == 300
