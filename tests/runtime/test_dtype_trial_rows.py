"""The bf16 trial of --dtype auto runs on the job's own rows: tokenized as the run will, spread
over their lengths; the summary says on how many rows and what it measured; for moderate a
flag that flips fails the trial even when every score stays within 0.01."""

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

import pipeline.runtime.dtype_trial
from jobs.registry import get_job
from pipeline.core.settings import ModelSettings
from pipeline.runtime.choice import choose_model
from pipeline.runtime.dtype_trial import TRIAL_ROWS, spread_over_lengths
from pipeline.offline.config import RunConfig
from pipeline.core.tokenize import encode_texts, load_tokenizer_spec
from tests.conftest import write_shards


def test_the_trial_rows_spread_over_the_lengths_shortest_to_longest():
    lengths = np.array([0, 5, 3, 9, 1, 7, 0, 2])
    assert spread_over_lengths(lengths, 3).tolist() == [4, 2, 3]  # lengths 1, 3, 9: both ends and the middle
    assert spread_over_lengths(lengths, 10).tolist() == [4, 7, 2, 1, 5, 3]  # every row with text, by length
    assert spread_over_lengths(np.zeros(4, dtype=np.int64), 3).tolist() == []


@pytest.fixture
def trials(monkeypatch):
    """The trials that ran: (job, path, loading, trial batches, length) each; the real trial runs.
    A native bf16 feature is assumed so that the trial runs on any CPU (emulated bf16 is only slower)."""
    monkeypatch.setattr(pipeline.runtime.dtype_trial, "native_bf16_feature", lambda: "avx512_bf16")
    ran, real_trial = [], pipeline.runtime.dtype_trial.bf16_trial

    def recorded(*args):
        ran.append(args)
        return real_trial(*args)

    monkeypatch.setattr(pipeline.runtime.dtype_trial, "bf16_trial", recorded)
    return ran


@pytest.mark.slow
def test_the_trial_runs_on_the_texts_it_is_given_tokenized_as_the_run_will(tmp_path, sample_table,
                                                                          tiny_classifier_path, trials):
    texts = sample_table["text"].to_pylist()[:300]
    config = RunConfig.of(input=(), output="", model=tiny_classifier_path, job="classify", device="cpu",
                          max_length=96, plan_cache=str(tmp_path))
    choice = choose_model(config.model, config.cache.plan_cache, trial_texts=lambda: texts)
    (_, _, _, trial, _), = trials
    spec = load_tokenizer_spec(tiny_classifier_path, 96)
    encoded = encode_texts(texts, Tokenizer.from_str(spec.tokenizer_json), spec)
    expected = {tuple(encoded.token_ids[encoded.offsets[i]:encoded.offsets[i + 1]].tolist()) for i in range(300)}
    rows = [tuple(ids[mask.bool()].tolist()) for input_ids, attention_mask in trial.batches
            for ids, mask in zip(input_ids, attention_mask)]
    assert len(rows) == TRIAL_ROWS and set(rows) <= expected  # the input's rows, not random ids
    lengths = [len(row) for row in rows]
    assert lengths == sorted(lengths) and min(lengths) == encoded.lengths.min() and max(lengths) == 96
    assert len(trial.batches) == 4  # by length, each padded to its own longest row
    assert all(input_ids.shape[1] == int(attention_mask.sum(1).max()) for input_ids, attention_mask in trial.batches)
    assert f"vs float32 on 64 of the input's rows ({min(lengths)}–96 tokens)" in choice.dtype_reason


@pytest.mark.slow
def test_a_run_trials_on_its_own_rows_and_the_summary_says_so(tmp_path, sample_table, tiny_multilabel_path, trials):
    from pipeline.engines.local import run_job

    write_shards(tmp_path / "in", sample_table.slice(0, 80), [80])
    summary = run_job(RunConfig.of(input=(str(tmp_path / "in"),), output=str(tmp_path / "out"),
                                   model=tiny_multilabel_path, job="moderate", max_length=64, tokenize_workers=0,
                                   progress=False, plan_cache=str(tmp_path / "cache"), max_batch_tokens=2048,
                                   probe=False))
    (_, _, loading, trial, _), = trials
    assert loading["thresholds"] == {"toxic": 0.5, "insult": 0.5, "threat": 0.5}  # flags judged as the run will
    reason = json.loads(summary.to_json())["dtype_reason"]
    assert "flags changed on " in reason and f"vs float32 on {trial.rows}" in reason
    assert trial.rows.startswith("64 of the input's rows (")


def test_moderate_counts_flags_that_flip_even_within_the_score_bound(tiny_multilabel_path):
    moderate = get_job("moderate")
    model = moderate.load(tiny_multilabel_path, torch.device("cpu"), torch.float32, thresholds={"toxic": 0.5})
    reference = {"scores": torch.tensor([[0.499, 0.2, 0.1], [0.9, 0.1, 0.1]])}
    candidate = {"scores": torch.tensor([[0.503, 0.2, 0.1], [0.9, 0.1, 0.1]])}  # |Δ| 0.004: within 0.01
    assert moderate.agreement(reference, candidate) == (True, "same top label on 2/2 rows, max |Δscore| 0.0040")
    assert moderate.agreement(reference, candidate, model=model) == (
        False, "same top label on 2/2 rows, max |Δscore| 0.0040, flags changed on 1/2 rows")
    assert moderate.agreement(reference, reference, model=model)[0]


@pytest.mark.slow
def test_without_texts_the_trial_runs_on_random_ids_and_says_so(tmp_path, tiny_encoder_path, trials):
    empty = choose_model(ModelSettings(model=tiny_encoder_path, device="cpu", max_length=64), str(tmp_path),
                         trial_texts=lambda: [None, "  "])
    assert trials[0][3] is None and "vs float32 on 64 random-id rows" in empty.dtype_reason
