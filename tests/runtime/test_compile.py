"""--compile: the verdict (pure), a compiled run that equals eager without a recompile storm,
the cached verdict, a resume that keeps the recorded choice, and a compiled forward that
disagrees falling back to eager."""

import os
import json

import pyarrow.parquet as pq
import pytest
import torch

import jobs.registry
import pipeline.runtime.compile_decision
from transformers.modeling_outputs import SequenceClassifierOutput

from jobs.classify import ClassifyJob
from pipeline.core.compile import CompileVerdict, job_pays_back, pick_compile, worth_a_trial
from pipeline.runtime.choice import choose_model
from pipeline.runtime.compile_decision import compiled_package_path
from pipeline.offline.config import RunConfig
from pipeline.engines.local import run_job
from tests.conftest import read_outputs, write_shards

FAST = CompileVerdict(speedup=1.5, agrees=True, agreement="min cosine 1.00000", eager_tokens_per_s=10_000.0,
                      compile_s=20.0)


def test_compiling_pays_back_when_the_forward_time_it_saves_beats_the_compile():
    # 1M tokens at 10k tokens/s is 100 s of forward; 1.5x saves a third of it, 33 s
    assert job_pays_back(1_000_000, 10_000.0, 1.5, compile_s=30.0)
    assert not job_pays_back(1_000_000, 10_000.0, 1.5, compile_s=40.0)
    assert not job_pays_back(1_000_000, 10_000.0, 1.0, compile_s=0.1)  # no gain, nothing saved
    assert job_pays_back(None, 10_000.0, 1.5, compile_s=1e9)  # a sweep or a service: long enough
    # a trial is worth it only if even a 2x gain could pay a cold compile back: 60 s of forward saves 30 s
    assert worth_a_trial(600_000, 10_000.0, cold_compile_s=29.0)
    assert not worth_a_trial(600_000, 10_000.0, cold_compile_s=31.0)
    assert not worth_a_trial(None, 10_000.0, cold_compile_s=1.0)


@pytest.mark.parametrize("setting, verdict, tokens, expected, why", [
    ("off", FAST, 1e9, False, "eager: --compile off"),
    ("on", None, 10, True, "compiled: --compile on"),
    ("auto", None, 1e9, False, "eager: no compile trial"),
    ("auto", CompileVerdict(1.5, False, "min cosine 0.99000", 1e4, 20.0), 1e9, False, "disagrees with eager"),
    ("auto", CompileVerdict(1.05, True, "min cosine 1.00000", 1e4, 20.0), 1e9, False, "only 1.05x as fast"),
    ("auto", FAST, 100_000, False, "too few to pay back a 20 s compile"),
    ("auto", FAST, 10_000_000, True, "compiled: 1.50x faster, min cosine 1.00000"),
])
def test_the_verdict_says_why(setting, verdict, tokens, expected, why):
    compiled, reason = pick_compile(setting, verdict, tokens, expected_compile_s=20.0)
    assert compiled is expected
    assert why in reason


@pytest.fixture
def shards(tmp_path, sample_table):
    write_shards(tmp_path / "in", sample_table.slice(0, 120), [60, 60])
    return tmp_path / "in"


def run(tmp_path, shards, model, output="out", **settings):
    settings = {"tokenize_workers": 0, "dtype": "float32", "max_length": 128, "max_batch_tokens": 512,
                "plan_cache": str(tmp_path / "cache"), **settings}
    summary = run_job(RunConfig.of(input=(str(shards),), output=str(tmp_path / output), model=model, progress=False,
                                   **settings))
    return read_outputs(tmp_path / output), json.loads(summary.to_json())


@pytest.mark.slow
def test_auto_trials_once_caches_the_verdict_compiles_equal_to_eager_and_a_resume_keeps_the_recorded_choice(
        tmp_path, shards, tiny_encoder_path, monkeypatch):
    monkeypatch.setattr(pipeline.runtime.compile_decision, "COLD_COMPILE_S", 0.0)  # this small job counts as large enough
    # a damaged package where the compile will go (cut short by a full disk, say): compiled anew, not a failure
    settings = RunConfig.of(input=(str(shards),), output="", model=tiny_encoder_path, dtype="float32", max_length=128)
    damaged = compiled_package_path(tmp_path / "cache", settings.model,
                                    choose_model(settings.model, str(tmp_path / "cache")))
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"PK\x03\x04 not a whole package")
    _, first = run(tmp_path, shards, tiny_encoder_path, "first")
    cached = list((tmp_path / "cache").glob("compile-*.json"))
    assert len(cached) == 1
    verdict = json.loads(cached[0].read_text())
    assert verdict["agrees"] and verdict["speedup"] > 0 and verdict["compile_s"] > 0
    assert first["compile"].startswith("compiled" if verdict["speedup"] >= 1.1 else "eager")

    # the cached verdict is used as it is: here one that says compile, with the package the trial left loading free
    packages = list((tmp_path / "cache" / "compiled").glob("*.pt2"))
    assert packages == [damaged] and damaged.stat().st_size > 100_000  # the trial's package replaced the damaged one
    cached[0].write_text(json.dumps({**verdict, "speedup": 1.5, "last_load_s": 0.0}))

    def no_second_trial(*args):
        raise AssertionError("the cached verdict should have been used")

    monkeypatch.setattr(pipeline.runtime.compile_decision, "compile_trial", no_second_trial)
    compiled, second = run(tmp_path, shards, tiny_encoder_path, "second")
    eager, eager_summary = run(tmp_path, shards, tiny_encoder_path, "eager", compile="off")
    assert eager_summary["compile"] == "eager: --compile off"
    assert second["compile"].startswith("compiled: 1.50x faster") and second["compile_s"] > 0
    assert second["batches"] >= 4  # several bucket shapes ran …
    assert second["compiled_graphs"] == 1  # … on one exported graph, for one row or unpadded batches too
    assert compiled["id"].to_pylist() == eager["id"].to_pylist()
    a, b = torch.tensor(eager["embedding"].to_pylist()), torch.tensor(compiled["embedding"].to_pylist())
    assert float(torch.nn.functional.cosine_similarity(a, b).min()) >= 0.9999
    assert json.loads((tmp_path / "second" / ".lengthwise" / "run.json").read_text())["config"]["compile"] == "on"

    # a resume of an output keeps what it was made with, whatever auto would say now
    (tmp_path / "third-in").mkdir()
    pq.write_table(pq.read_table(shards / "part-00000.parquet"), tmp_path / "third-in" / "part-00000.parquet")
    _, made = run(tmp_path, tmp_path / "third-in", tiny_encoder_path, "third", compile="off")
    pq.write_table(pq.read_table(shards / "part-00001.parquet"), tmp_path / "third-in" / "part-00001.parquet")
    _, resumed = run(tmp_path, tmp_path / "third-in", tiny_encoder_path, "third")
    assert made["compile"] == "eager: --compile off"
    assert resumed["rows"] == 60 and resumed["compile"] == "eager: --compile off"


class DriftsWhenCompiled(torch.nn.Module):
    """A classifier whose compiled graph shifts its logits: a compiled forward that disagrees with eager."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids, attention_mask):
        logits = self.inner(input_ids=input_ids, attention_mask=attention_mask).logits
        if torch.compiler.is_compiling():
            logits = logits + torch.arange(logits.shape[1])
        return SequenceClassifierOutput(logits=logits)


class DriftingClassifyJob(ClassifyJob):
    name = "classify-drifts"

    def load(self, model_path, device, dtype, prompt_tokens=0, **loading):
        return DriftsWhenCompiled(super().load(model_path, device, dtype, prompt_tokens, **loading))


@pytest.mark.slow
def test_a_compiled_forward_that_disagrees_falls_back_to_eager(tmp_path, shards, tiny_classifier_path, monkeypatch):
    """Also the classify job's way through the compile: its call exported, compiled and run (the trial
    compares its outputs; a compile that failed would say so instead)."""
    monkeypatch.setitem(jobs.registry.JOBS, "classify-drifts", DriftingClassifyJob())
    monkeypatch.setattr(pipeline.runtime.compile_decision, "COLD_COMPILE_S", 0.0)
    eager, _ = run(tmp_path, shards, tiny_classifier_path, "eager", job="classify", compile="off")
    ours, summary = run(tmp_path, shards, tiny_classifier_path, "auto", job="classify-drifts")
    assert summary["compile"].startswith("eager: the compiled forward disagrees with eager (same top label on")
    assert "max |Δscore| 0.0000" not in summary["compile"]
    assert ours["scores"].to_pylist() == eager["scores"].to_pylist()
    assert ours["label"].to_pylist() == eager["label"].to_pylist()


def test_inductor_caches_go_under_the_plan_cache_unless_the_user_chose_a_directory(tmp_path, monkeypatch):
    """torch writes its default directory into the environment the first time it asks for it
    (importing a model's code can do that first): that default must not keep the caches in /tmp."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from pipeline.core.compile import inductor_cache_dir, use_inductor_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cache_dir()  # torch's own default, now in the environment
    use_inductor_cache(tmp_path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(inductor_cache_dir(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    use_inductor_cache(tmp_path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
