"""Listing shards and streaming their rows, local and through fsspec."""

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import UsageError
from pipeline.offline.source import list_shards, read_blocks
from tests.conftest import write_shards

TABLE = pa.table({"id": [f"r{i}" for i in range(10)], "text": [f"text {i}" for i in range(10)],
                  "extra": list(range(10))})


def test_directory_glob_and_file_list_find_the_same_shards(tmp_path):
    paths = write_shards(tmp_path / "in", TABLE, [3, 3, 4])
    (tmp_path / "in" / "notes.txt").write_text("not a shard")
    (tmp_path / "in" / "_lengthwise").mkdir()
    by_dir = list_shards([str(tmp_path / "in")], "id", "text")
    by_glob = list_shards([str(tmp_path / "in" / "*.parquet")], "id", "text")
    by_files = list_shards([str(p) for p in paths], "id", "text")
    assert [s.stem for s in by_dir] == ["part-00000", "part-00001", "part-00002"]
    assert by_dir == by_glob == by_files
    assert [s.num_rows for s in by_dir] == [3, 3, 4]


def test_blocks_stream_every_row_in_order_with_only_two_columns(tmp_path):
    write_shards(tmp_path, TABLE, [7, 3])
    shards = list_shards([str(tmp_path)], "id", "text")
    blocks = list(read_blocks(shards, "id", "text", block_rows=4))
    assert [(b.shard_index, b.first_row, b.num_rows, b.is_last_of_shard) for b in blocks] == [
        (0, 0, 4, False), (0, 4, 3, True), (1, 0, 3, True)]
    assert [i for b in blocks for i in b.ids.to_pylist()] == TABLE["id"].to_pylist()
    assert [t for b in blocks for t in b.texts.to_pylist()] == TABLE["text"].to_pylist()


def test_empty_shard_yields_one_empty_last_block(tmp_path):
    pq.write_table(TABLE.slice(0, 0), tmp_path / "empty.parquet")
    shards = list_shards([str(tmp_path)], "id", "text")
    [block] = read_blocks(shards, "id", "text", block_rows=4)
    assert block.num_rows == 0 and block.is_last_of_shard and block.ids.type == pa.string()


def test_dictionary_encoded_id_and_text_columns_are_read_as_plain_strings(tmp_path):
    """pandas categoricals and Spark write dictionary<string> columns; they used to be refused
    ("text column 'text' is dictionary<values=string, …>, not a string")."""
    texts = ["same text", "same text", None, "other text", "same text"]
    ids = ["a", "b", "c", "d", "a"]
    pq.write_table(pa.table({"id": pa.array(ids).dictionary_encode(), "text": pa.array(texts).dictionary_encode()}),
                   tmp_path / "dict.parquet")
    assert pq.ParquetFile(tmp_path / "dict.parquet").schema_arrow.field("text").type == \
        pa.dictionary(pa.int32(), pa.string())
    [shard] = list_shards([str(tmp_path)], "id", "text")
    assert shard.problem is None and shard.num_rows == 5
    blocks = list(read_blocks([shard], "id", "text", block_rows=2))
    assert [b.ids.type for b in blocks] == [pa.string()] * 3 and [b.texts.type for b in blocks] == [pa.string()] * 3
    assert [i for b in blocks for i in b.ids.to_pylist()] == ids
    assert [t for b in blocks for t in b.texts.to_pylist()] == texts


def test_a_dictionary_of_large_strings_in_an_arrow_stream_is_read_as_plain_strings(tmp_path):
    from pipeline.offline.source import Shard, is_text_type

    texts = pa.array(["x", None, "x", "y"], pa.large_string()).dictionary_encode()
    table = pa.table({"id": [1, 2, 3, 4], "text": texts})
    path = tmp_path / "data-00000-of-00001.arrow"
    with pa.ipc.new_stream(path, table.schema) as writer:
        writer.write_table(table)
    assert is_text_type(table.schema.field("text").type) and not is_text_type(pa.dictionary(pa.int8(), pa.int64()))
    [block] = read_blocks([Shard(str(path), "data-00000-of-00001", 4)], "id", "text", block_rows=10)
    assert block.failure is None and block.texts.type == pa.large_string()
    assert block.texts.to_pylist() == ["x", None, "x", "y"]


def write_all_null_texts(path, writer: str) -> None:
    """A shard whose text column is all null, typed `null`: as pyarrow writes `pa.nulls(n)` and
    pandas an all-None object column."""
    if writer == "pandas":
        pandas = pytest.importorskip("pandas")
        pandas.DataFrame({"id": ["a", "b", "c"], "text": [None, None, None]}).to_parquet(path)
    else:
        pq.write_table(pa.table({"id": ["a", "b", "c"], "text": pa.nulls(3)}), path)


@pytest.mark.parametrize("writer", ["pyarrow", "pandas"])
def test_a_text_column_of_type_null_is_read_as_null_strings(tmp_path, writer):
    """It was a shard problem (`text column 'text' is null, not a string`) on every rerun; null
    texts are row errors."""
    write_all_null_texts(tmp_path / "nulls.parquet", writer)
    assert pq.read_schema(tmp_path / "nulls.parquet").field("text").type == pa.null()
    [shard] = list_shards([str(tmp_path)], "id", "text")
    assert shard.problem is None and shard.num_rows == 3
    blocks = list(read_blocks([shard], "id", "text", block_rows=2))
    assert [(b.num_rows, b.texts.type, b.failure) for b in blocks] == [(2, pa.string(), None), (1, pa.string(), None)]
    assert [t for b in blocks for t in b.texts.to_pylist()] == [None] * 3
    assert [i for b in blocks for i in b.ids.to_pylist()] == ["a", "b", "c"]


def test_null_typed_columns_of_an_arrow_stream_are_read_as_nulls(tmp_path):
    from pipeline.offline.source import Shard

    path = tmp_path / "data-00000-of-00001.arrow"
    table = pa.table({"id": pa.nulls(2), "text": pa.nulls(2)})
    with pa.ipc.new_stream(path, table.schema) as writer:
        writer.write_table(table)
    [block] = read_blocks([Shard(str(path), "data-00000-of-00001", 2)], "id", "text", block_rows=10)
    assert block.failure is None and block.texts.type == pa.string() and block.texts.to_pylist() == [None, None]
    assert block.ids.type == pa.null() and block.ids.null_count == 2  # an id of any type; null ids are row errors


@pytest.mark.slow
def test_shards_with_null_typed_text_or_ids_commit_every_row_as_an_error(tmp_path, tiny_encoder_path):
    """A night's shard that pandas wrote from an all-None text column failed on every rerun; now
    each of its rows has `text is null`, a shard of null-typed ids `id is null`, and all commit."""
    from click.testing import CliRunner

    from pipeline.cli import cli

    source = tmp_path / "night-in"
    write_shards(source, TABLE, [10])
    write_all_null_texts(source / "part-00001.parquet", "pandas")
    pq.write_table(pa.table({"id": pa.nulls(2), "text": ["some text", "more text"]}), source / "part-00002.parquet")
    output = tmp_path / "night-out"
    summary = CliRunner().invoke(cli, ["run", "--input", str(source), "--output", str(output), "--model",
                                       tiny_encoder_path, "--tokenize-workers", "0", "--dtype", "float32",
                                       "--compile", "off", "--no-progress"])
    assert summary.exit_code == 0, summary.output
    nulls, null_ids = (pq.read_table(output / f"part-0000{i}.parquet") for i in (1, 2))
    assert nulls["id"].to_pylist() == ["a", "b", "c"] and nulls["error"].to_pylist() == ["text is null"] * 3
    assert null_ids["id"].null_count == 2 and null_ids["error"].to_pylist() == ["id is null"] * 2
    assert pq.read_table(output / "part-00000.parquet")["error"].to_pylist() == [None] * 10
    assert "15 rows in 3 done shard(s) (5 with errors" in summary.output, summary.output


@pytest.mark.slow
def test_a_run_over_dictionary_columns_writes_what_a_run_over_plain_ones_does(tmp_path, tiny_encoder_path):
    from tests.conftest import run_to_table

    texts = ["a text", "another text", "a text", None, "a text"]
    plain = pa.table({"id": [f"r{i}" for i in range(5)], "text": texts})
    encoded = pa.table({"id": plain["id"].combine_chunks().dictionary_encode(),
                        "text": plain["text"].combine_chunks().dictionary_encode()})
    expected, _ = run_to_table(tmp_path, "plain", plain, [5], model=tiny_encoder_path)
    got, summary = run_to_table(tmp_path, "dictionary", encoded, [5], model=tiny_encoder_path)
    assert got.schema.field("id").type == pa.string() and got.to_pylist() == expected.to_pylist()
    assert summary["error_rows"] == 1 and got["error"].to_pylist()[3] == "text is null"
    from click.testing import CliRunner

    from pipeline.cli import cli

    verified = CliRunner().invoke(cli, ["verify", "--input", str(tmp_path / "dictionary-in"), "--output",
                                        str(tmp_path / "dictionary-out")])
    assert verified.exit_code == 0 and "complete: 1 of 1 shards agree" in verified.output, verified.output


def test_fsspec_memory_filesystem():
    fs = fsspec.filesystem("memory")
    for name, part in (("a", TABLE.slice(0, 5)), ("b", TABLE.slice(5))):
        with fs.open(f"/lw-src/{name}.parquet", "wb") as f:
            pq.write_table(part, f)
    shards = list_shards(["memory://lw-src/*.parquet"], "id", "text")
    assert [s.url for s in shards] == ["memory:///lw-src/a.parquet", "memory:///lw-src/b.parquet"]
    rows = [i for b in read_blocks(shards, "id", "text", 100) for i in b.ids.to_pylist()]
    assert rows == TABLE["id"].to_pylist()


@pytest.mark.parametrize("column, flag", [("id", "--id-column"), ("text", "--text-column")])
def test_missing_column_names_the_flag(tmp_path, column, flag):
    pq.write_table(TABLE.drop_columns([column]), tmp_path / "x.parquet")
    with pytest.raises(UsageError, match=f"has no column '{column}'.*set {flag}"):
        list_shards([str(tmp_path)], "id", "text")


def test_unreadable_inputs_say_what_to_change(tmp_path):
    with pytest.raises(UsageError, match="does not exist; check --input"):
        list_shards([str(tmp_path / "nope")], "id", "text")
    with pytest.raises(UsageError, match="matches no Parquet files"):
        list_shards([str(tmp_path / "*.parquet")], "id", "text")
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet")
    with pytest.raises(UsageError, match="cannot read .*bad.parquet as Parquet"):
        list_shards([str(tmp_path)], "id", "text")


def test_two_shards_with_the_same_stem_are_refused(tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        pq.write_table(TABLE, tmp_path / sub / "same.parquet")
    with pytest.raises(UsageError, match="would both write same.parquet"):
        list_shards([str(tmp_path / "a"), str(tmp_path / "b")], "id", "text")


class BreaksOnceAfter(pq.ParquetFile):
    """A Parquet file whose stream raises a transient error after `after_batches` record
    batches, the first time it is opened (a dropped connection to an object store)."""

    after_batches = 3
    opened = 0

    def iter_batches(self, *args, **kwargs):
        BreaksOnceAfter.opened += 1
        for count, batch in enumerate(super().iter_batches(*args, **kwargs)):
            if BreaksOnceAfter.opened == 1 and count == self.after_batches:
                raise TimeoutError("Read timed out (injected)")
            yield batch


def test_a_dropped_connection_mid_shard_reopens_and_carries_on_without_gaps(tmp_path, monkeypatch):
    import pipeline.offline.readers.parquet as parquet_reader
    import pipeline.offline.source as source

    big = pa.table({"id": [f"r{i}" for i in range(500)], "text": [f"text {i}" for i in range(500)]})
    pq.write_table(big, tmp_path / "big.parquet", row_group_size=50)
    shards = list_shards([str(tmp_path)], "id", "text")
    BreaksOnceAfter.opened = 0
    monkeypatch.setattr(parquet_reader.pq, "ParquetFile", BreaksOnceAfter)
    monkeypatch.setattr(source, "backoff_delay_s", lambda attempt: 0.0)
    blocks = list(read_blocks(shards, "id", "text", block_rows=40))
    assert BreaksOnceAfter.opened == 2, "the error was not injected or the file was not reopened"
    assert all(b.failure is None for b in blocks)
    assert [i for b in blocks for i in b.ids.to_pylist()] == big["id"].to_pylist()
    assert [b.is_last_of_shard for b in blocks].count(True) == 1


def test_a_corrupt_shard_is_not_retried_and_fails_alone(tmp_path):
    write_shards(tmp_path, TABLE, [5, 5])
    data = (tmp_path / "part-00001.parquet").read_bytes()
    shards = list_shards([str(tmp_path)], "id", "text")
    (tmp_path / "part-00001.parquet").write_bytes(data[:8] + b"\0" * (len(data) - 16) + data[-8:])
    blocks = list(read_blocks(shards, "id", "text", block_rows=100))
    assert [b.num_rows for b in blocks if b.failure is None] == [5]
    assert "reading" in blocks[-1].failure and blocks[-1].shard_index == 1


def test_output_names_come_only_from_the_path_below_the_input_root(tmp_path):
    from pipeline.offline.source import output_stem, partition_values, relative_name

    assert output_stem(relative_name("bucket/in/dt=2026-11-29/part-1.parquet", "bucket/in")) == "dt=2026-11-29/part-1"
    assert output_stem(relative_name("bucket/elsewhere/x.parquet", "bucket/in")) == "x"  # not below: its file name
    assert output_stem(relative_name("bucket/in/data-00000-of-00002.arrow", "bucket/in")) == "data-00000-of-00002"
    assert partition_values("dt=2026-11-29/lang=de/part-1") == {"dt": "2026-11-29", "lang": "de"}
    assert partition_values("part-1") == {} and partition_values("batch/part-1") == {}
    pq.write_table(TABLE, tmp_path / "...parquet")  # its stem would be "..": refused, nothing written
    with pytest.raises(UsageError, match="no usable file name"):
        list_shards([str(tmp_path / "...parquet")], "id", "text")
