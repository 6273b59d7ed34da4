"""--job pair end to end on real Parquet: a cross-encoder's scores for a text and its pair against
transformers' own tokenizer(text, pair, truncation="longest_first") and model, padded and unpadded,
on BERT (token types) and XLM-R (none); resume after a kill, --reuse and dedupe keyed on both texts."""

import json
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.engines.local import run_job
from pipeline.offline.config import RunConfig
from tests.conftest import resume_after_a_kill_between_shards, write_shards

MAX_LENGTH = {"bert": 61, "xlmr": 127}  # odd budgets (58, 123): the longer text keeps the odd token


@pytest.fixture(scope="module")
def pairs_table(sample_table) -> pa.Table:
    """60 comments, each with a rule: long with short, short with long, both long; a null or blank in either."""
    texts = [t for t in sample_table["text"].to_pylist() if t]
    comments = texts[:60]
    rules = [texts[(i * 7 + 100) % len(texts)] if i % 3 else f"rule {i}: no spam, no insults" for i in range(60)]
    comments[5], rules[9], rules[13], comments[20] = None, None, "  ", "   "
    return pa.table({"id": [f"row-{i}" for i in range(60)], "comment": pa.array(comments, pa.string()),
                     "rule": pa.array(rules, pa.string())})


def model_path(model, request) -> str:
    return request.getfixturevalue("tiny_cross_encoder_path" if model == "bert" else "tiny_xlmr_reranker_path")


def reference_scores(path: str, firsts: list, seconds: list, max_length: int, zero_types: bool = False) -> np.ndarray:
    """transformers' scores: its tokenizer's longest_first truncation, its model in float32, sigmoid
    (a multi-label model, a one-logit reranker)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    inputs = tokenizer(firsts, seconds, truncation="longest_first", max_length=max_length, padding=True,
                       return_tensors="pt")
    if zero_types:
        inputs["token_type_ids"] = torch.zeros_like(inputs["token_type_ids"])
    with torch.inference_mode():
        return model(**inputs).logits.float().sigmoid().numpy()


def run_cli(*arguments: str):
    return CliRunner().invoke(cli, ["run", "--job", "pair", "--dtype", "float32", "--tokenize-workers", "0",
                                    "--no-probe", "--no-progress", *arguments])


def read_output(output) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted(output.glob("*.parquet")))


@pytest.mark.slow
@pytest.mark.parametrize("unpad", ["off", "on"])
@pytest.mark.parametrize("model", ["bert", "xlmr"])
def test_pair_scores_agree_with_transformers_within_1e_5(model, unpad, tmp_path, pairs_table, request):
    path = model_path(model, request)
    write_shards(tmp_path / "in", pairs_table, [25, 35])
    result = run_cli("--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--model", path,
                     "--text-column", "comment", "--pair-column", "rule", "--max-length", str(MAX_LENGTH[model]),
                     "--unpad", unpad, "--summary-json", str(tmp_path / "out" / ".summary.json"))
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / ".summary.json").read_text())
    assert summary["unpad"].startswith("unpadded" if unpad == "on" else "padded"), summary["unpad"]
    output = read_output(tmp_path / "out")
    assert output["id"].to_pylist() == pairs_table["id"].to_pylist()
    errors = output["error"].to_pylist()
    assert [errors[i] for i in (5, 9, 13, 20)] == ["text is null", "pair text is null",
                                                   "pair text is empty or whitespace only",
                                                   "text is empty or whitespace only"]
    good = [i for i, error in enumerate(errors) if error is None]
    assert len(good) == 56
    comments, rules = pairs_table["comment"].to_pylist(), pairs_table["rule"].to_pylist()
    expected = reference_scores(path, [comments[i] for i in good], [rules[i] for i in good], MAX_LENGTH[model])
    labels = list(output.schema.field("scores").type)
    scores = output["scores"].to_pylist()
    ours = np.array([[scores[i][label.name] for label in labels] for i in good])
    assert expected.std() > 0.02  # scores spread: a wrong token or type would show
    np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
    truncated = output["truncated"].to_pylist()
    assert 10 < sum(truncated[i] for i in good) < len(good)  # longest_first was at work on many rows
    if model == "bert":  # the pair's token types matter: zeroed, transformers' own scores move
        zeroed = reference_scores(path, [comments[i] for i in good], [rules[i] for i in good], MAX_LENGTH[model],
                                  zero_types=True)
        assert np.abs(zeroed - expected).max() > 1e-3
        assert summary["compile"].startswith("eager: a pair's token type ids")


@pytest.mark.slow
def test_named_inputs_that_do_not_fit_are_usage_errors_that_write_nothing(tmp_path, pairs_table,
                                                                          tiny_cross_encoder_path):
    write_shards(tmp_path / "in", pairs_table, [60])
    common = ("--input", str(tmp_path / "in"), "--model", tiny_cross_encoder_path, "--text-column", "comment")
    no_pair = run_cli(*common, "--output", str(tmp_path / "a"))
    split = run_cli(*common, "--output", str(tmp_path / "b"), "--pair-column", "rule", "--long-text", "split")
    missing = run_cli(*common, "--output", str(tmp_path / "c"), "--pair-column", "rules")
    assert (no_pair.exit_code, split.exit_code, missing.exit_code) == (2, 2, 2)
    assert "set --pair-column" in no_pair.output
    assert "--long-text split cuts one text into segments" in split.output
    assert "has no column 'rules'" in missing.output and "set --pair-column" in missing.output
    assert not any((tmp_path / name).exists() and any((tmp_path / name).iterdir()) for name in "abc")


def run_pairs(input_dir, output, model, **settings) -> dict:
    config = RunConfig.of(input=(str(input_dir),), output=str(output), model=model, job="pair", text_column="comment",
                          pair_column="rule", max_length=61, dtype="float32", tokenize_workers=0, progress=False,
                          probe=False, max_batch_rows=1, **settings)
    return json.loads(run_job(config).to_json())


@pytest.mark.slow
def test_reuse_keys_on_both_texts_and_a_changed_pair_is_recomputed(tmp_path, pairs_table, tiny_cross_encoder_path):
    write_shards(tmp_path / "night1", pairs_table, [30, 30])
    run_pairs(tmp_path / "night1", tmp_path / "out1", tiny_cross_encoder_path)
    rows = pairs_table.to_pylist()
    rows[3]["rule"] = "another rule tonight"  # the pair changed, the comment did not
    rows[40]["comment"] += " (edited)"  # the comment changed, the pair did not
    rows.append({"id": "row-new", "comment": "a comment added tonight", "rule": "no spam"})
    night2 = pa.Table.from_pylist(rows, schema=pairs_table.schema)
    write_shards(tmp_path / "night2", night2, [30, 31])
    reused = run_pairs(tmp_path / "night2", tmp_path / "out2", tiny_cross_encoder_path, reuse=str(tmp_path / "out1"))
    run_pairs(tmp_path / "night2", tmp_path / "full", tiny_cross_encoder_path)
    no_hash = 2  # a null comment or pair has no hash: computed again (the blank ones are reused with their error)
    assert (reused["reused_rows"], reused["computed_rows"]) == (60 - 2 - no_hash, 2 + 1 + no_hash)
    assert read_output(tmp_path / "out2").equals(read_output(tmp_path / "full")), "reuse must equal a full run"
    before, after = read_output(tmp_path / "out1")["scores"].to_pylist(), read_output(tmp_path / "out2")["scores"]
    assert after[3].as_py() != before[3] and after[4].as_py() == before[4]


@pytest.mark.slow
def test_dedupe_runs_a_text_once_per_pair_not_once_per_text(tmp_path, tiny_cross_encoder_path):
    comments = ["the same comment"] * 8
    rules = ["rule A"] * 4 + ["rule B", "rule C", "rule D", "rule A"]
    table = pa.table({"id": list(range(8)), "comment": comments, "rule": rules})
    write_shards(tmp_path / "in", table, [8])
    summary = run_pairs(tmp_path / "in", tmp_path / "out", tiny_cross_encoder_path)
    assert summary["deduplicated_rows"] == 4  # rows 1, 2, 3 and 7 copy row 0; B, C and D run
    scores = [tuple(s.values()) for s in read_output(tmp_path / "out")["scores"].to_pylist()]
    assert scores[0] == scores[1] == scores[2] == scores[3] == scores[7]
    assert len({scores[0], scores[4], scores[5], scores[6]}) == 4


@pytest.mark.slow
def test_a_killed_pair_run_resumes_to_the_rows_of_an_uninterrupted_one(tmp_path, pairs_table,
                                                                        tiny_cross_encoder_path):
    write_shards(tmp_path / "in", pairs_table, [20, 20, 20])
    command = [sys.executable, "-m", "pipeline.cli", "run", "--job", "pair", "--input", str(tmp_path / "in"),
               "--model", tiny_cross_encoder_path, "--text-column", "comment", "--pair-column", "rule",
               "--max-length", "61", "--dtype", "float32", "--tokenize-workers", "0", "--no-probe", "--no-progress",
               "--max-batch-rows", "1", "--window-rows", "10"]
    resume_after_a_kill_between_shards(command, tmp_path / "out", tmp_path / "whole", 3)
    assert read_output(tmp_path / "out").equals(read_output(tmp_path / "whole"))
