"""Position limits from the architecture: the RoBERTa family (RoBERTa, XLM-R, MPNet) counts
positions from pad_token_id + 1, so a 514-position model takes 512 tokens; --max-length above
that is refused before any work, and a probe forward that fails other than by running out of
memory stops the run with one line."""

import shutil
from pathlib import Path

import pyarrow as pa
import pytest
import torch
import transformers
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.core.errors import UsageError
from pipeline.core.memory import fit_rows
from pipeline.runtime.choice import choose_model
from pipeline.runtime.model import load_model
from pipeline.core.positions import (
    PositionLimit,
    check_max_length,
    offset_position_limit,
    position_limit,
    position_limit_of_config,
)
from pipeline.core.probe import memory_plan_for
from pipeline.offline.config import RunConfig
from tests.conftest import TOKENIZER_FILES, read_outputs, write_shards

FAMILIES = {  # model_type: (config class, the job's model class, job)
    "roberta": (transformers.RobertaConfig, "RobertaForSequenceClassification", "classify"),
    "xlm-roberta": (transformers.XLMRobertaConfig, "XLMRobertaModel", "embed"),
    "mpnet": (transformers.MPNetConfig, "MPNetModel", "embed"),
}


def tiny_model(directory: Path, minilm_path: str, model_type: str, positions: int = 514) -> str:
    """A 2-layer, 32-wide model of the family with random weights and MiniLM's tokenizer."""
    config_class, architecture, _ = FAMILIES[model_type]
    config = config_class(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=64, max_position_embeddings=positions, num_labels=2)
    torch.manual_seed(0)
    getattr(transformers, architecture)(config).eval().save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(minilm_path) / name, directory / name)
    return str(directory)


@pytest.fixture(scope="module")
def family_paths(tmp_path_factory, minilm_path) -> dict[str, str]:
    return {kind: tiny_model(tmp_path_factory.mktemp(kind), minilm_path, kind) for kind in FAMILIES}


def test_an_offset_family_takes_its_positions_less_the_padding_index_and_one():
    assert offset_position_limit(514, 1) == 512
    assert offset_position_limit(130, 1) == 128
    assert offset_position_limit(514, 0) == 513


def test_the_refusal_names_the_real_limit_and_where_it_comes_from():
    roberta = PositionLimit(512, 514, 1)
    check_max_length(roberta, 512, "roberta")  # at the limit: fine
    with pytest.raises(UsageError) as refused:
        check_max_length(roberta, 513, "roberta")
    assert str(refused.value) == ("--max-length 513 is more than the 512 tokens this roberta model takes (514 "
                                  "positions, counted from its padding index 1 + 1, so 512 tokens); "
                                  "set --max-length 512 or less")
    with pytest.raises(UsageError, match=r"^--max-length 513 is more than the 512 tokens this bert model takes "
                                         r"\(512 positions\); set --max-length 512 or less$"):
        check_max_length(PositionLimit(512, 512), 513, "bert")
    check_max_length(None, 100_000, "modernbert")  # no position table: nothing to check


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_family_takes_512_of_514_positions_loaded_or_from_its_config_alone(family_paths, model_type):
    path = family_paths[model_type]
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.max_position_embeddings == 514
    assert position_limit_of_config(config) == PositionLimit(512, 514, 1)  # choose_model's check, before the trial
    model = getattr(transformers, FAMILIES[model_type][1]).from_pretrained(path)
    assert position_limit(model) == PositionLimit(512, 514, 1)


def test_bert_counts_positions_from_zero(tiny_encoder_path):
    model = transformers.AutoModel.from_pretrained(tiny_encoder_path)
    assert position_limit(model) == PositionLimit(512, 512, None)


@pytest.mark.parametrize("max_length", [513, 514])
def test_roberta_above_its_limit_exits_2_with_one_line_before_any_work(tmp_path, sample_table, family_paths,
                                                                      max_length):
    write_shards(tmp_path / "in", sample_table.slice(0, 4), [4])
    output = tmp_path / "out"
    result = CliRunner().invoke(cli, ["run", "--input", str(tmp_path / "in"), "--output", str(output),
                                      "--model", family_paths["roberta"], "--job", "classify", "--no-progress",
                                      "--tokenize-workers", "0", "--max-length", str(max_length)],
                                catch_exceptions=False)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if "more than" in line]
    assert len(errors) == 1 and errors[0].endswith(
        f"--max-length {max_length} is more than the 512 tokens this roberta model takes (514 positions, "
        "counted from its padding index 1 + 1, so 512 tokens); set --max-length 512 or less")
    assert "Traceback" not in result.output
    assert not [line for line in result.output.splitlines() if line.startswith("dtype ")]  # before the dtype trial
    assert not output.exists()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_row_longer_than_the_limit_runs_at_512_tokens(tmp_path, family_paths, model_type):
    """A 600-word row (over 600 tokens) and a short one, at --max-length 512: both scored, the long
    one truncated at the limit, no error."""
    from pipeline.engines.local import run_job

    table = pa.table({"id": [1, 2], "text": [" ".join(["moderation"] * 600), "a short row"]})
    write_shards(tmp_path / "in", table, [2])
    summary = run_job(RunConfig.of(input=(str(tmp_path / "in"),), output=str(tmp_path / "out"),
                                   model=family_paths[model_type], job=FAMILIES[model_type][2], max_length=512,
                                   dtype="float32", tokenize_workers=0, progress=False,
                                   plan_cache=str(tmp_path / "cache"), max_batch_tokens=1024, probe=False))
    outputs = read_outputs(tmp_path / "out")
    assert outputs["id"].to_pylist() == [1, 2]
    assert outputs["error"].to_pylist() == [None, None]
    assert outputs["truncated"].to_pylist() == [True, False]
    assert summary.rows == 2 and summary.truncated_rows == 1


def test_a_probe_forward_that_fails_other_than_out_of_memory_is_one_usage_error(tmp_path, family_paths):
    """The check bypassed: the probe's 600-token forward indexes past RoBERTa's position table.
    Today's fallback (log it, run on --max-batch-tokens) would have died at the first long row."""
    config = RunConfig.of(input=("unused",), output=str(tmp_path / "out"), model=family_paths["roberta"],
                          job="classify", max_length=512, dtype="float32", plan_cache=str(tmp_path / "cache"),
                          memory_budget=2**30, max_batch_tokens=4096)
    loaded = load_model(config.model, config.batch, choose_model(config.model, config.cache.plan_cache), cache=config.cache)
    with pytest.raises(UsageError) as stopped:
        memory_plan_for(config.batch, config.cache, "classify", 600, loaded.job, loaded.model, loaded.choice.path,
                        loaded.choice.device)
    rows, _ = fit_rows("cpu", 150, 600, loaded.model.config.hidden_size, 4, 4096)  # the grid's first 600-token batch
    assert str(stopped.value) == (f"the memory probe's forward of {rows} rows × 600 tokens failed with RuntimeError: "
                                  "index 514 is out of bounds for dimension 1 with size 514; every batch this "
                                  "long would fail the same way: check --max-length, --dtype and --model")
