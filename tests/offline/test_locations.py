"""Input and output never overlap, in either direction, and no location carries credentials:
refused with exit 2 before anything is written. Listing an input never reads an earlier output."""

import os

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline.core.errors import UsageError
from pipeline.offline.locations import check_locations, contains, location_parts, overlap_problem
from pipeline.offline.source import list_shards
from tests.conftest import write_shards
from tests.cli.test_usage_errors_write_nothing import tree_digest


def parts(url):
    return location_parts(url, {})


def test_containment_is_by_whole_path_parts(tmp_path):
    assert contains(parts(str(tmp_path / "d")), parts(str(tmp_path / "d" / "out")))
    assert contains(parts(str(tmp_path / "d")), parts(str(tmp_path / "d")))
    assert not contains(parts(str(tmp_path / "d")), parts(str(tmp_path / "d2")))
    assert not contains(parts(str(tmp_path / "d" / "out")), parts(str(tmp_path / "d")))


def test_symlinks_and_dot_dot_are_resolved(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "alias")
    assert overlap_problem([str(tmp_path / "real")], str(tmp_path / "alias"), {}).startswith("--output")
    assert "is the input" in overlap_problem([str(tmp_path / "real")], str(tmp_path / "alias"), {})
    dotted = str(tmp_path / "real" / "sub" / "..")
    assert "is the input" in overlap_problem([dotted], str(tmp_path / "real"), {})


@pytest.mark.parametrize("inputs, output, expected", [
    (["s3://bucket/in/"], "s3://bucket/in", "is the input"),
    (["s3://bucket/in/"], "s3://bucket/in/out/", "is inside the input"),
    (["s3://bucket/in/night/"], "s3://bucket/in/", "is inside --output"),
    (["s3://bucket/in/*.parquet"], "s3://bucket/in/out", "is inside the input"),
    (["s3://bucket/in/"], "s3://bucket/inside/", None),
    (["s3://bucket/in/"], "s3://other/in/", None),
    (["memory://in/"], "memory://in/out", "is inside the input"),
    (["memory://in/"], "s3://in/out", None),  # another store
])
def test_urls_compare_by_store_bucket_and_prefix(inputs, output, expected):
    problem = overlap_problem(inputs, output, {})
    assert (problem is None) if expected is None else (expected in problem), problem


def test_an_input_file_beside_the_output_is_fine_but_not_one_inside_it(tmp_path):
    assert overlap_problem([str(tmp_path / "d" / "a.parquet")], str(tmp_path / "d" / "out"), {}) is None
    assert "is inside --output" in overlap_problem([str(tmp_path / "d" / "a.parquet")], str(tmp_path / "d"), {})


def test_credentials_in_a_url_are_refused_without_being_repeated():
    with pytest.raises(UsageError) as refused:
        check_locations(["s3://AKID:hunter2@bucket/in/"], "s3://bucket/out/", {})
    assert str(refused.value) == ("--input s3://bucket/in/ carries credentials in its URL (user:password@); pass "
                                  "them through the environment or --storage-option instead")


@pytest.fixture
def shards(tmp_path, sample_table):
    write_shards(tmp_path / "d", sample_table.slice(0, 30), [10, 20])
    return tmp_path / "d"


@pytest.mark.parametrize("output, message", [
    ("d", "is the input"), ("d/out", "is inside the input"), ("d/../d/", "is the input"), (".", "is inside --output"),
])
def test_a_run_over_its_own_input_exits_2_and_writes_nothing(tmp_path, shards, tiny_encoder_path, monkeypatch,
                                                             output, message):
    from pipeline.cli import cli

    monkeypatch.chdir(tmp_path)
    before = tree_digest(tmp_path)
    result = CliRunner().invoke(cli, ["run", "--input", "d", "--output", output, "--model", tiny_encoder_path,
                                      "--no-progress", "--tokenize-workers", "0"], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert message in result.output and "choose an --output outside the input" in result.output
    assert tree_digest(tmp_path) == before  # the input shards untouched, no output folder made


def test_listing_skips_a_folder_that_holds_an_output(tmp_path, shards):
    """An output left inside the input by an earlier version (or made by hand) is not read as input,
    whether the input is a folder or a recursive glob; the input folder itself may be an output."""
    old_output = shards / "old-run"
    write_shards(old_output, pq.read_table(shards / "part-00000.parquet"), [10])
    (old_output / ".lengthwise").mkdir()
    (old_output / ".lengthwise" / "run.json").write_text("{}")
    expected = ["part-00000", "part-00001"]
    assert [s.stem for s in list_shards([str(shards)], "id", "text")] == expected
    assert [s.stem for s in list_shards([f"{shards}/**/*.parquet"], "id", "text")] == expected
    (shards / ".lengthwise").mkdir()
    (shards / ".lengthwise" / "run.json").write_text("{}")
    assert [s.stem for s in list_shards([str(shards)], "id", "text")] == expected
