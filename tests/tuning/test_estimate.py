"""`plan --estimate`: the arithmetic as pure functions, and one run on the shipped sample."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.tuning.estimate import (
    device_seconds,
    Estimate,
    mean_tokens_per_row,
    one_pass_estimate,
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


def test_the_host_bounds_the_wall_where_tokenizing_takes_longer_than_the_device():
    assert wall_seconds(90.0, 10.0, busy=0.9, host_s=50.0) == pytest.approx(110.0)  # the device binds
    assert wall_seconds(90.0, 10.0, busy=0.9, host_s=300.0) == pytest.approx(310.0)  # the host binds
    assert wall_seconds(90.0, 10.0, workers=3, busy=0.9, host_s=300.0) == pytest.approx(110.0)
    assert workers_for_window(90.0, 10.0, 110.0, busy=0.9, host_s=300.0) == 3
    # on a CPU the forward and the tokenizing share the cores: they add up, past the device's busy share
    assert wall_seconds(90.0, 10.0, busy=0.9, host_s=50.0, shared_cores=True) == pytest.approx(150.0)
    assert wall_seconds(90.0, 10.0, busy=0.9, host_s=5.0, shared_cores=True) == pytest.approx(110.0)
    estimate = summarize_estimate(
        rows=1_000, shards=1, lengths=np.array([10, 20, 30, 40]), tokens_per_s=1_000.0, basis="t", setup_s=0.0,
        window_s=None, reused=np.array([True, True, False, False]), sample_tokenize_s=2.0)
    assert estimate.host_seconds == pytest.approx(2.0 / 4 * 1_000 * 0.5)  # the sample's, scaled to the rows to compute
    assert estimate.predicted_seconds == pytest.approx(250.0)  # 17,500 tokens: 19 s of device, 250 s of tokenizing


def model_estimate_of(device_s: float, setup_s: float, host_s: float) -> Estimate:
    return Estimate(rows=1_000, shards=4, sample_rows=100, mean_tokens_per_row=20.0, tokens=20_000,
                    tokens_per_s=20_000 / device_s, basis="t", device_seconds=device_s, setup_seconds=setup_s,
                    predicted_seconds=wall_seconds(device_s, setup_s, host_s=host_s), host_seconds=host_s)


def test_one_pass_of_several_models_pays_their_device_and_setup_and_the_host_once():
    models = {"toxicity": model_estimate_of(45.0, 5.0, 100.0), "embed": model_estimate_of(27.0, 3.0, 100.0)}
    found = one_pass_estimate(models, window_s=None)
    one = found.one_pass
    assert (one.device_seconds, one.setup_seconds, one.host_seconds) == (72.0, 8.0, 100.0)
    assert one.predicted_seconds == pytest.approx(8.0 + 100.0)  # the host binds: 100 s against 80 s of device
    assert found.separate_seconds == pytest.approx(105.0 + 103.0)  # each run tokenizes every row again
    assert found.saved_seconds == pytest.approx(100.0)
    assert one.tokens_per_s == pytest.approx(20_000 / 72.0)
    assert "saves 100s (48%) over 2 separate runs (208s, each starting in 0.0s): it starts and tokenizes once" \
        in found.to_text()
    on_cpu = one_pass_estimate({name: dataclasses.replace(each, shared_cores=True, predicted_seconds=wall_seconds(
        each.device_seconds, each.setup_seconds, host_s=100.0, shared_cores=True)) for name, each in models.items()},
        window_s=None)
    assert on_cpu.one_pass.predicted_seconds == pytest.approx(8.0 + 72.0 + 100.0)
    assert on_cpu.saved_seconds == pytest.approx(100.0)  # the tokenizing of the second run
    assert found.to_text().startswith("model toxicity\n  tokens ")
    assert set(found.to_dict()) == {*one.to_dict(), "models", "separate_seconds", "saved_seconds", "start_seconds"}
    assert found.to_dict()["predicted_seconds"] == round(one.predicted_seconds, 2)  # the pass's, where one model's
    started = one_pass_estimate(models, window_s=None, start_s=4.0)  # the second run's process start and imports
    assert (started.separate_seconds, started.saved_seconds) == (pytest.approx(212.0), pytest.approx(104.0))
    # the --reuse index is built once; a 60 s window needs two workers: 100 s of host work, 54 s a worker past setup
    reused = one_pass_estimate(models, window_s=60.0, once_s=2.0)
    assert reused.one_pass.setup_seconds == 6.0 and reused.one_pass.workers == 2


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


@pytest.mark.slow
def test_plan_of_several_models_shows_each_plan_the_pass_rows_and_an_estimate_of_what_one_pass_saves(
        tmp_path, tiny_multilabel_path, tiny_encoder_path):
    """`plan --config` with [models] tables opens each model as the run of several does: its plan, the rows a
    batch of the pass takes (the fewest any plan allows), and with --estimate each model's figures and the pass's."""
    from tests.conftest import SAMPLE_DIR

    config = tmp_path / "night.toml"
    config.write_text(f'max_length = 32\ndtype = "float32"\ntokenize_workers = 0\nlong_text = "truncate"\n'
                      f'[models.toxicity]\njob = "moderate"\nmodel = "{tiny_multilabel_path}"\n'
                      f'thresholds = {{toxic = 0.5}}\n[models.embed]\njob = "embed"\nmodel = "{tiny_encoder_path}"\n')
    common = ["--config", str(config), "--plan-cache", str(tmp_path / "cache"), "--memory-budget", "64MiB"]
    planned = CliRunner().invoke(cli, ["plan", "--json", *common])
    assert planned.exit_code == 0, planned.output
    plans = json.loads(planned.output[planned.output.index("{"):])
    assert list(plans["models"]) == ["toxicity", "embed"]
    rows = {name: {bucket["length"]: bucket["probed_rows"] for bucket in plan["buckets"]}
            for name, plan in plans["models"].items()}
    assert plans["one_pass_rows"] == {str(length): min(rows["toxicity"][length], rows["embed"][length])
                                      for length in rows["embed"]}

    estimated = CliRunner().invoke(cli, ["plan", "--estimate", "--json", "--input", str(SAMPLE_DIR),
                                         "--sample-rows", "100", *common])
    assert estimated.exit_code == 0, estimated.output
    found = json.loads(estimated.output[estimated.output.index("{"):])["estimate"]
    models, one = found["models"], found  # the pass's figures at the top, as one model's estimate has them
    assert list(models) == ["toxicity", "embed"] and one["rows"] == 400
    for each in models.values():
        assert each["tokens"] == one["tokens"] > 400 and each["host_seconds"] == one["host_seconds"] > 0
        assert each["memory_plan"].startswith("from cache")  # the plans `plan` just made, as the run will take them
    assert one["device_seconds"] == pytest.approx(sum(each["device_seconds"] for each in models.values()), abs=0.02)
    assert found["separate_seconds"] == pytest.approx(sum(each["predicted_seconds"] for each in models.values())
                                                      + found["start_seconds"], abs=0.05)  # the second run's start
    assert found["saved_seconds"] == pytest.approx(found["separate_seconds"] - one["predicted_seconds"], abs=0.05)
    assert found["saved_seconds"] >= found["start_seconds"] > 0  # this process's start, paid once

    swept = CliRunner().invoke(cli, ["sweep", "--config", str(config), "--input", str(SAMPLE_DIR)])
    assert swept.exit_code == 2 and "`sweep` takes one model and" in swept.output, swept.output
    both = CliRunner().invoke(cli, ["plan", "--model", tiny_encoder_path, *common])
    assert both.exit_code == 2 and "--model and a [models] table both set it" in both.output, both.output
