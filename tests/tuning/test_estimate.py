"""`plan --estimate`: the arithmetic as pure functions, and one run on the shipped sample."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.tuning.estimate import (
    device_seconds,
    mean_tokens_per_row,
    scored_tokens_per_row,
    summarize_estimate,
    wall_seconds,
    workers_for_window,
)


def test_device_and_wall_seconds():
    assert device_seconds(1_000_000, 2_000.0) == 500.0
    assert wall_seconds(900.0, 30.0, workers=1, busy=0.9) == pytest.approx(1030.0)
    assert wall_seconds(900.0, 30.0, workers=4, busy=0.9) == pytest.approx(280.0)
    with pytest.raises(ValueError):
        device_seconds(10, 0.0)


def test_workers_for_window_is_the_fewest_that_fit():
    # 36,000 device seconds at 90% busy = 40,000 s of work; a 4 h window less 400 s setup holds 14,000 s a worker
    assert workers_for_window(36_000.0, 400.0, 4 * 3600, busy=0.9) == 3
    assert wall_seconds(36_000.0, 400.0, workers=3, busy=0.9) <= 4 * 3600 < wall_seconds(36_000.0, 400.0, 2, 0.9)
    assert workers_for_window(10.0, 5.0, 3600) == 1
    assert workers_for_window(10.0, 3600.0, 3600) is None


def test_summarize_estimate_scales_the_sample_to_the_rows_and_says_when_shards_are_too_few():
    lengths = np.array([10, 20, 0, 30])  # an error row sends no tokens
    assert mean_tokens_per_row(lengths) == 15.0
    estimate = summarize_estimate(rows=1_000_000, shards=2, lengths=lengths, tokens_per_s=1_500.0, basis="test",
                                  setup_s=60.0, window_s=3600.0)
    assert estimate.tokens == 15_000_000 and estimate.device_seconds == pytest.approx(10_000.0)
    assert estimate.predicted_seconds == pytest.approx(60.0 + 10_000.0 / 0.9)
    assert estimate.workers == 4 and "only 2 shard(s)" in estimate.note
    assert set(estimate.to_dict()) >= {"rows", "tokens", "predicted_seconds", "basis", "workers"}


@pytest.mark.slow
def test_plan_estimate_on_the_shipped_sample(tiny_encoder_path):
    from tests.conftest import SAMPLE_DIR

    result = CliRunner().invoke(cli, ["plan", "--input", str(SAMPLE_DIR), "--estimate", "--window", "4h", "--json",
                                      "--model", tiny_encoder_path, "--dtype", "float32", "--sample-rows", "100",
                                      "--tokenize-workers", "0"])
    assert result.exit_code == 0, result.output
    estimate = json.loads(result.output[result.output.index("{"):])["estimate"]
    assert estimate["rows"] == 400 and estimate["shards"] == 2 and estimate["sample_rows"] == 100
    assert estimate["tokens"] > 400 and estimate["tokens_per_s"] > 0
    assert estimate["predicted_seconds"] > estimate["device_seconds"] > 0
    assert estimate["workers"] == 1 and "measured here on" in estimate["basis"]


def test_estimate_needs_an_input_and_window_needs_estimate():
    assert CliRunner().invoke(cli, ["plan", "--estimate"]).exit_code == 2
    result = CliRunner().invoke(cli, ["plan", "--window", "4h", "--available", "1GiB", "--per-sample", "1MiB"])
    assert result.exit_code == 2


def test_an_estimate_with_reuse_counts_only_the_rows_to_compute():
    lengths = np.array([10, 20, 30, 40])
    reused = np.array([True, False, True, True])
    estimate = summarize_estimate(rows=1_000, shards=1, lengths=lengths, tokens_per_s=100.0, basis="test",
                                  setup_s=0.0, window_s=None, reused=reused)
    assert (estimate.reused_share, estimate.computed_rows, estimate.tokens) == (0.75, 250, 5_000)
    assert "75.0% of the sampled rows are in the --reuse output: 250 rows to compute" in estimate.to_text()
    assert summarize_estimate(1_000, 1, lengths, 100.0, "t", 0.0, None).computed_rows is None


@pytest.mark.slow
def test_plan_estimate_with_reuse_predicts_the_computed_rows_and_caches_the_plan_for_the_run(tmp_path,
                                                                                              tiny_encoder_path):
    """Night 2 is the sample with a quarter of the texts edited: the estimate finds about 3/4 of its sample in
    night 1's output, probes the memory plan once and caches it; the --reuse run takes the plan from the cache
    (the estimate runs with the run's --torch-threads: the plan's key has them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.offline.config import RunConfig
    from pipeline.engines.local import run_job
    from tests.conftest import SAMPLE_DIR

    plan_cache = str(tmp_path / "plans")
    common = {"model": tiny_encoder_path, "dtype": "float32", "max_length": 128, "tokenize_workers": 0,
              "progress": False, "plan_cache": plan_cache, "torch_threads": 1}
    run_job(RunConfig.of(input=(str(SAMPLE_DIR),), output=str(tmp_path / "out1"), **common, probe=False))
    (tmp_path / "night2").mkdir()
    for path in sorted(SAMPLE_DIR.glob("*.parquet")):
        table = pq.read_table(path)
        texts = [text + " (edited)" if i % 4 == 0 else text for i, text in enumerate(table["text"].to_pylist())]
        pq.write_table(table.set_column(table.schema.get_field_index("text"), "text", pa.array(texts)),
                       tmp_path / "night2" / f"renamed-{path.name}")
    import torch

    torch.set_num_threads(2)  # what a fresh `plan` process starts with here, not the run's --torch-threads 1
    result = CliRunner().invoke(cli, ["plan", "--input", str(tmp_path / "night2"), "--estimate", "--json",
                                      "--reuse", str(tmp_path / "out1"), "--model", tiny_encoder_path, "--dtype",
                                      "float32", "--max-length", "128", "--sample-rows", "400",
                                      "--tokenize-workers", "0", "--torch-threads", "1", "--plan-cache", plan_cache])
    assert result.exit_code == 0, result.output
    estimate = json.loads(result.output[result.output.index("{"):])["estimate"]
    assert estimate["rows"] == 400 and estimate["computed_rows"] == 100  # all 400 sampled: exactly the edited
    assert estimate["reused_share"] == 0.75 and estimate["memory_plan"].startswith("probed in")
    summary = run_job(RunConfig.of(input=(str(tmp_path / "night2"),), output=str(tmp_path / "out2"),
                                   reuse=str(tmp_path / "out1"), **common))
    assert summary.computed_rows == 100 and summary.batch_plan.startswith("from cache")
    bad = CliRunner().invoke(cli, ["plan", "--reuse", str(tmp_path / "out1")])
    assert bad.exit_code == 2 and "--reuse goes with --estimate" in bad.output


@pytest.mark.slow
def test_plan_estimate_and_run_settle_the_same_cuda_budget_through_the_one_setup(tmp_path, tiny_encoder_path,
                                                                                  monkeypatch):
    """Each product settles its batch limits in `open_runtime`, with the loaded model's size: what a CUDA
    device would get is recorded from the run's and the estimate's own calls (the drift this replaced: the
    estimate resolved without the model's config, and predicted a run at 32,768 tokens the run never used)."""
    import pipeline.runtime
    from pipeline.core.settings import cuda_batch_tokens
    from pipeline.sample_data import SAMPLE_DIR

    real, on_cuda = pipeline.runtime.resolve_batch_setting, []

    def resolve(batch, device_type, saved_for, fields, model_config=None):
        on_cuda.append(real(batch, "cuda", saved_for, fields, model_config=model_config)[0].max_batch_tokens)
        return real(batch, device_type, saved_for, fields, model_config=model_config)

    monkeypatch.setattr(pipeline.runtime, "resolve_batch_setting", resolve)
    common = ["--input", str(SAMPLE_DIR), "--model", tiny_encoder_path, "--dtype", "float32", "--compile", "off",
              "--tokenize-workers", "0", "--plan-cache", str(tmp_path / "cache"), "--max-length", "64"]
    estimated = CliRunner().invoke(cli, ["plan", "--estimate", "--sample-rows", "100", *common])
    assert estimated.exit_code == 0, estimated.output
    ran = CliRunner().invoke(cli, ["run", "--output", str(tmp_path / "out"), *common])
    assert ran.exit_code == 0, ran.output
    assert json.loads((tmp_path / "out" / ".lengthwise" / "run.json").read_text())["config"]["max_length"] == 64
    from transformers import AutoConfig

    shape = AutoConfig.from_pretrained(tiny_encoder_path)
    assert on_cuda == [cuda_batch_tokens(shape.hidden_size, shape.num_hidden_layers)] * 2


def test_a_split_row_costs_its_segments_tokens_and_a_row_that_fits_its_own():
    lengths = np.array([10, 32, 0, 32])  # row 1 and 3 were cut into segments of 32, 32, 20 and 32, 5
    assert scored_tokens_per_row(lengths).tolist() == [10, 32, 0, 32]
    assert scored_tokens_per_row(lengths, np.array([1, 1, 1, 3, 3]), np.array([32, 32, 20, 32, 5])).tolist() == \
        [10, 84, 0, 37]


@pytest.mark.slow
def test_plan_estimate_counts_the_segments_of_long_text_split(tmp_path, tiny_multilabel_path):
    """A moderate run splits (`--long-text auto`): the estimate predicts the segments' tokens, not the
    truncated rows' (what a classify run of the same model computes)."""
    import pyarrow as pa

    from tests.conftest import write_shards

    long_text = "The committee met on Tuesday to review the budget for the coming year. " * 12
    write_shards(tmp_path / "in", pa.table({"id": list(range(20)), "text": [long_text, "short"] * 10}), [20])

    def tokens(job: str) -> int:
        result = CliRunner().invoke(cli, ["plan", "--estimate", "--json", "--input", str(tmp_path / "in"), "--job",
                                          job, "--model", tiny_multilabel_path, "--dtype", "float32",
                                          "--max-length", "32", "--tokenize-workers", "0",
                                          "--plan-cache", str(tmp_path / "cache")])
        assert result.exit_code == 0, result.output
        return json.loads(result.output[result.output.index("{"):])["estimate"]["tokens"]

    truncated, split = tokens("classify"), tokens("moderate")
    assert truncated == 10 * 32 + 10 * 3  # [CLS] short [SEP]
    assert split > 4 * truncated
