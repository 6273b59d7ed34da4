"""--keep-columns, and Hugging Face `datasets` folders in and out."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from tests.conftest import read_outputs, write_shards


@pytest.fixture(scope="module")
def labelled(sample_table) -> pa.Table:
    rows = 90
    texts = sample_table["text"].to_pylist()[:rows]
    texts[7] = None
    return pa.table({"id": sample_table["id"].to_pylist()[:rows], "text": pa.array(texts, pa.string()),
                     "label": pa.array([i % 3 if i % 10 else None for i in range(rows)], pa.int8()),
                     "lang": pa.array([["en", "de"][i % 2] for i in range(rows)], pa.dictionary(pa.int32(),
                                                                                                pa.string())),
                     "meta": pa.array([{"source": f"s{i % 4}", "score": i / 10} for i in range(rows)])})


def run_cli(*args):
    return CliRunner().invoke(cli, ["run", "--tokenize-workers", "0", "--dtype", "float32", "--no-progress",
                                    "--max-length", "64", *map(str, args)])


@pytest.mark.slow
def test_kept_columns_come_through_unchanged_after_the_id(tmp_path, labelled, tiny_encoder_path):
    write_shards(tmp_path / "in", labelled, [50, 40])
    result = run_cli("--input", tmp_path / "in", "--output", tmp_path / "out", "--model", tiny_encoder_path,
                     "--keep-columns", "meta,label,lang", "--window-rows", "32")  # windows span both shards
    assert result.exit_code == 0, result.output
    output = read_outputs(tmp_path / "out")
    assert output.column_names == ["id", "meta", "label", "lang", "embedding", "truncated", "error"]
    for name in ("id", "meta", "label", "lang"):
        assert output.schema.field(name).type == labelled.schema.field(name).type
        assert output[name].to_pylist() == labelled[name].to_pylist()
    assert output["error"].to_pylist()[7] == "text is null" and output["label"][7].as_py() == 1
    recorded = json.loads((tmp_path / "out" / ".lengthwise" / "run.json").read_text())
    assert recorded["fingerprint"]["keep_columns"] == ["meta", "label", "lang"]


def test_a_missing_or_clashing_kept_column_is_a_usage_error(tmp_path, labelled, tiny_encoder_path):
    write_shards(tmp_path / "in", labelled, [90])
    missing = run_cli("--input", tmp_path / "in", "--output", tmp_path / "a", "--model", tiny_encoder_path,
                      "--keep-columns", "label,country")
    assert missing.exit_code == 2
    assert "has no column 'country' to keep (its columns: id, text, label, lang, meta); check --keep-columns" in \
        missing.output
    clash = run_cli("--input", tmp_path / "in", "--output", tmp_path / "b", "--model", tiny_encoder_path,
                    "--keep-columns", "id")
    assert clash.exit_code == 2 and "--keep-columns id: the output already has a column of that name" in clash.output
    assert not list((tmp_path / "b").glob("*.parquet"))


def test_a_saved_dataset_is_read_from_its_arrow_files(tmp_path, labelled, tiny_encoder_path):
    import datasets

    table = labelled.drop_columns(["lang"])
    datasets.Dataset(table).save_to_disk(str(tmp_path / "saved"), num_shards=2)
    result = run_cli("--input", tmp_path / "saved", "--output", tmp_path / "out", "--model", tiny_encoder_path,
                     "--keep-columns", "label", "--window-rows", "16")
    assert result.exit_code == 0, result.output
    files = sorted(p.name for p in (tmp_path / "out").glob("*.parquet"))
    assert files == ["data-00000-of-00002.parquet", "data-00001-of-00002.parquet"]
    output = read_outputs(tmp_path / "out")
    assert output["id"].to_pylist() == table["id"].to_pylist()
    assert output["label"].to_pylist() == table["label"].to_pylist()
    assert output["error"].null_count == table.num_rows - 1


def test_a_dataset_dict_needs_a_split(tmp_path, labelled, tiny_encoder_path):
    import datasets

    table = labelled.select(["id", "text"])
    datasets.DatasetDict({"train": datasets.Dataset(table.slice(0, 60)),
                          "test": datasets.Dataset(table.slice(60))}).save_to_disk(str(tmp_path / "dict"))
    unsplit = run_cli("--input", tmp_path / "dict", "--output", tmp_path / "a", "--model", tiny_encoder_path)
    assert unsplit.exit_code == 2 and "is a DatasetDict with splits train, test; choose one with --split" in \
        unsplit.output
    wrong = run_cli("--input", tmp_path / "dict", "--output", tmp_path / "a", "--model", tiny_encoder_path,
                    "--split", "validation")
    assert wrong.exit_code == 2 and "--split validation is not one of them" in wrong.output
    test_split = run_cli("--input", tmp_path / "dict", "--output", tmp_path / "b", "--model", tiny_encoder_path,
                         "--split", "test")
    assert test_split.exit_code == 0, test_split.output
    assert read_outputs(tmp_path / "b")["id"].to_pylist() == table["id"].to_pylist()[60:]
    status = CliRunner().invoke(cli, ["status", "--output", str(tmp_path / "b"), "--json"])
    assert json.loads(status.output)["rows_done"] == 30


def test_the_output_folder_loads_with_datasets_as_exactly_the_input_rows(tmp_path, labelled, tiny_encoder_path):
    import datasets

    write_shards(tmp_path / "in", labelled, [30, 30, 30])
    result = run_cli("--input", tmp_path / "in", "--output", tmp_path / "out", "--model", tiny_encoder_path,
                     "--keep-columns", "label", "--summary-json", tmp_path / "out" / ".summary.json")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / ".lengthwise" / "run.json").exists() and (tmp_path / "out" / ".summary.json").exists()
    loaded = datasets.load_dataset("parquet", data_dir=str(tmp_path / "out"), cache_dir=str(tmp_path / "cache"))
    assert list(loaded) == ["train"]
    assert loaded["train"]["id"] == labelled["id"].to_pylist()
    assert loaded["train"]["label"] == labelled["label"].to_pylist()
    assert pq.read_table(tmp_path / "out")["id"].to_pylist() == labelled["id"].to_pylist()  # pyarrow too


def test_an_output_recorded_in_the_old_manifest_folder_resumes_from_it(tmp_path, labelled, tiny_encoder_path):
    write_shards(tmp_path / "in", labelled, [45, 45])
    first = run_cli("--input", tmp_path / "in", "--output", tmp_path / "out", "--model", tiny_encoder_path)
    assert first.exit_code == 0, first.output
    (tmp_path / "out" / ".lengthwise").rename(tmp_path / "out" / "_lengthwise")  # as written before the rename
    (tmp_path / "out" / "_lengthwise" / "shards" / "part-00001.json").unlink()
    again = run_cli("--input", tmp_path / "in", "--output", tmp_path / "out", "--model", tiny_encoder_path)
    assert again.exit_code == 0, again.output
    assert "resumed         1 of 2 shards were already done" in again.output
    assert not (tmp_path / "out" / ".lengthwise").exists()
    assert json.loads((tmp_path / "out" / "_lengthwise" / "shards" / "part-00001.json").read_text())["status"] == "done"
