"""Hive-partitioned inputs (`dt=2026-11-29/part-00000.parquet`, the same file name in every partition)."""

import json

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline.cli import cli

DAYS = ("2026-11-28", "2026-11-29", "2026-11-30")


@pytest.fixture()
def partitioned(tmp_path, sample_table) -> tuple:
    """Three days × part-00000 (and a second part on the last day), 20 rows each."""
    root = tmp_path / "posts"
    tables = []
    for day in DAYS:
        for part in range(1 + (day == DAYS[-1])):
            table = sample_table.select(["id", "text"]).slice(20 * len(tables), 20)
            table = table.append_column("lang", pa.array([("en", "de")[len(tables) % 2]] * 20))
            (root / f"dt={day}").mkdir(parents=True, exist_ok=True)
            pq.write_table(table, root / f"dt={day}" / f"part-{part:05d}.parquet")
            tables.append((f"dt={day}/part-{part:05d}", day, table))
    return root, tables


def run_cli(*args):
    return CliRunner().invoke(cli, ["run", "--tokenize-workers", "0", "--dtype", "float32", "--no-progress",
                                    "--max-length", "64", *map(str, args)])


def test_each_partition_is_mirrored_under_the_output(tmp_path, partitioned, tiny_encoder_path):
    root, tables = partitioned
    out = tmp_path / "out"
    result = run_cli("--input", root, "--output", out, "--model", tiny_encoder_path, "--keep-columns", "dt,lang")
    assert result.exit_code == 0, result.output
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.parquet"))
    assert written == sorted(f"{stem}.parquet" for stem, _, _ in tables)
    for stem, day, table in tables:
        output = pq.read_table(out / f"{stem}.parquet")
        assert output["id"].to_pylist() == table["id"].to_pylist()
        assert output["dt"].to_pylist() == [day] * 20 and output["lang"].to_pylist() == table["lang"].to_pylist()
    markers = {p.relative_to(out / ".lengthwise" / "shards").as_posix()
               for p in (out / ".lengthwise" / "shards").rglob("*.json")}
    assert markers == {f"{stem}.json" for stem, _, _ in tables}
    status = json.loads(CliRunner().invoke(cli, ["status", "--output", str(out), "--json"]).output)
    assert (status["shards"], status["done"], status["rows_done"]) == (4, 4, 80)

    hive = ds.dataset(out, format="parquet", partitioning="hive").to_table()  # pyarrow reads it back
    assert sorted(hive["id"].to_pylist()) == sorted(i for _, _, t in tables for i in t["id"].to_pylist())


@pytest.mark.slow
def test_the_partitioned_output_loads_with_datasets_and_resumes_by_relative_path(tmp_path, partitioned,
                                                                                  tiny_encoder_path):
    import datasets

    root, tables = partitioned
    out = tmp_path / "out"
    assert run_cli("--input", root, "--output", out, "--model", tiny_encoder_path).exit_code == 0
    loaded = datasets.load_dataset("parquet", data_dir=str(out), cache_dir=str(tmp_path / "cache"))["train"]
    assert sorted(loaded["id"]) == sorted(i for _, _, t in tables for i in t["id"].to_pylist())

    (out / f"dt={DAYS[1]}" / "part-00000.parquet").unlink()
    (out / ".lengthwise" / "shards" / f"dt={DAYS[1]}" / "part-00000.json").unlink()
    stale = out / f"dt={DAYS[1]}" / ".part-00000.parquet.0123456789ab.tmp"  # a killed attempt's file
    stale.write_bytes(b"partial")
    again = run_cli("--input", root, "--output", out, "--model", tiny_encoder_path)
    assert again.exit_code == 0, again.output
    assert "resumed         3 of 4 shards were already done" in again.output
    assert not stale.exists()
    assert pq.read_table(out / f"dt={DAYS[1]}" / "part-00000.parquet")["id"].to_pylist() == \
        tables[1][2]["id"].to_pylist()


def test_a_missing_partition_key_is_named_with_the_columns(tmp_path, partitioned, tiny_encoder_path):
    root, _ = partitioned
    result = run_cli("--input", root, "--output", tmp_path / "out", "--model", tiny_encoder_path,
                     "--keep-columns", "country")
    assert result.exit_code == 2
    assert "has no column 'country' to keep (its columns: id, text, lang, dt (partition))" in result.output
