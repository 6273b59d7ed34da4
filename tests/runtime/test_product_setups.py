"""Each product opens the runtime from its own config, and settles what a run of the same input would:
the sweep splits long rows as the run does and keeps its recommendation per long-text mode; `plan --input`
runs --dtype auto's trial on the input's rows; the estimate and the sweep weigh --compile auto against the
input's work, as the run does."""

import json

import pyarrow as pa
import pytest
from click.testing import CliRunner

import pipeline.runtime.dtype_trial
from pipeline.cli import cli
from pipeline.engines.local import run_job
from pipeline.offline.config import RunConfig
from pipeline.tuning.config import SweepConfig
from pipeline.tuning.sweep import run_sweep
from tests.conftest import write_shards

LONG_TEXT = "The committee met on Tuesday to review the budget for the coming year. " * 12


@pytest.fixture
def long_rows(tmp_path):
    """40 rows, half of them far longer than --max-length 32."""
    write_shards(tmp_path / "in", pa.table({"id": list(range(40)), "text": [LONG_TEXT, "short text"] * 20}), [40])
    return str(tmp_path / "in")


@pytest.mark.slow
def test_a_moderate_sweep_splits_long_rows_and_its_recommendation_is_kept_for_split_runs(tmp_path, long_rows,
                                                                                         tiny_multilabel_path):
    """`--job moderate` splits by default: its sweep measures the segments, not the truncated rows, and a
    truncating run of the same model does not take the split sweep's recommendation (nor the reverse)."""
    from pipeline.runtime import open_runtime

    cache = str(tmp_path / "cache")
    common = {"input": (long_rows,), "model": tiny_multilabel_path, "job": "moderate", "device": "cpu",
              "dtype": "float32", "compile": "off", "max_length": 32, "tokenize_workers": 0, "plan_cache": cache}
    report = run_sweep(SweepConfig.of(vary="max-batch-tokens", values=(128, 256), out=str(tmp_path / "s.csv"),
                                      rows=30, warmup_rows=4, **common))
    assert report.settings["long_text"] == "split"
    assert report.settings["sample_truncated_share"] == 0.0  # every long row was cut into segments, none truncated
    assert report.saved_to is not None, report.not_saved

    def recommended(long_text: str) -> dict | None:
        config = RunConfig.of(output="", long_text=long_text, probe=False, **common)
        return open_runtime(config).saved_for["max-batch-tokens"]

    assert recommended("auto")["level"] == report.recommendation.level  # auto splits for moderate
    assert recommended("split")["level"] == report.recommendation.level
    assert recommended("truncate") is None


@pytest.fixture
def trials(monkeypatch):
    """The bf16 trials that ran (their trial batches; None: random ids), a native bf16 feature assumed."""
    monkeypatch.setattr(pipeline.runtime.dtype_trial, "native_bf16_feature", lambda: "avx512_bf16")
    ran, real_trial = [], pipeline.runtime.dtype_trial.bf16_trial

    def recorded(job, path, loading, trial, length):
        ran.append(trial)
        return real_trial(job, path, loading, trial, length)

    monkeypatch.setattr(pipeline.runtime.dtype_trial, "bf16_trial", recorded)
    return ran


@pytest.mark.slow
def test_plan_with_an_input_runs_the_dtype_trial_on_its_rows_as_the_run_does(tmp_path, long_rows, tiny_encoder_path,
                                                                             trials):
    result = CliRunner().invoke(cli, ["plan", "--input", long_rows, "--model", tiny_encoder_path, "--device", "cpu",
                                      "--max-length", "32", "--compile", "off", "--plan-cache",
                                      str(tmp_path / "cache"), "--json"])
    assert result.exit_code == 0, result.output
    trial, = trials
    assert trial is not None and trial.rows.endswith("of the input's rows (4–32 tokens)")
    run_job(RunConfig.of(input=(long_rows,), output=str(tmp_path / "out"), model=tiny_encoder_path, device="cpu",
                         max_length=32, compile="off", plan_cache=str(tmp_path / "cache"), tokenize_workers=0,
                         progress=False, probe=False))
    assert len(trials) == 1  # the run found the plan's verdict: the same trial, cached


@pytest.mark.slow
def test_the_estimate_and_the_sweep_settle_compile_as_the_run_does(tmp_path, long_rows, tiny_encoder_path):
    """No compile verdict is cached: the run weighs a compile trial against its 40 rows' tokens (too few);
    the estimate and the sweep of the same input decide the same, not `eager: no compile trial`."""
    cache = str(tmp_path / "cache")
    common = {"model": tiny_encoder_path, "device": "cpu", "dtype": "float32", "max_length": 32,
              "tokenize_workers": 0, "plan_cache": cache}
    summary = run_job(RunConfig.of(input=(long_rows,), output=str(tmp_path / "out"), progress=False, probe=False,
                                   **common))
    assert summary.compile.startswith("eager: ") and "tokens are too few to try a compile" in summary.compile
    report = run_sweep(SweepConfig.of(input=(long_rows,), vary="max-batch-tokens", values=(128,),
                                      out=str(tmp_path / "s.csv"), rows=30, warmup_rows=4, **common))
    assert report.settings["compile"] == summary.compile
    estimated = CliRunner().invoke(cli, ["plan", "--estimate", "--json", "--input", long_rows, "--sample-rows", "40",
                                         *[f"--{key.replace('_', '-')}={value}" for key, value in common.items()]])
    assert estimated.exit_code == 0, estimated.output
    assert json.loads(estimated.output[estimated.output.index("{"):])["estimate"]["rows"] == 40
    assert f"\n{summary.compile}\n" in estimated.output  # the setup's log line


def test_each_product_config_names_the_input_its_setup_reads(tmp_path, long_rows):
    """`open_runtime(config)` reads what `config.input_rows()` gives: a run's, `plan`'s and a sweep's whole input
    (every shard listed), none without an input or for the batcher and its load test (a service's requests)."""
    from pipeline.online.config import BatcherConfig
    from pipeline.tuning.config import OnlineLoadtestConfig

    write_shards(tmp_path / "two", pa.table({"id": list(range(10)), "text": ["a text"] * 10}), [4, 6])
    run_rows = RunConfig.of(input=(str(tmp_path / "two"),), output="").input_rows()
    assert [shard.num_rows for shard in run_rows.shards] == [4, 6]
    assert run_rows.texts() == ["a text"] * 4  # the trial's sample: the first readable shard's rows
    sweep_rows = SweepConfig.of(input=(long_rows,), vary="max-batch-tokens", values=(128,), out="s.csv").input_rows()
    assert [shard.num_rows for shard in sweep_rows.shards] == [40]
    assert RunConfig.of(output="").input_rows() is None  # `plan` without --input: random ids
    assert BatcherConfig().input_rows() is None
    assert OnlineLoadtestConfig.of(input=(long_rows,), vary="max-batch-size", values=(8,), out="l.csv").input_rows() \
        is None
