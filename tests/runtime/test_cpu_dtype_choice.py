"""CPU speed settings: bf16 only where native, faster and in agreement; batches padded to their own rows."""

from __future__ import annotations

import logging

import numpy as np
import torch

import pipeline.runtime.choice
import pipeline.runtime.dtype_trial
from pipeline.offline.config import RunConfig
from pipeline.core.forward import DeviceFeeder
from pipeline.core.device import native_bf16_feature, padding_multiple
from pipeline.core.settings import ModelSettings
from pipeline.runtime.choice import choose_model
from pipeline.runtime.dtype_trial import pick_cpu_dtype
from pipeline.core.buckets import BatchLimits
from pipeline.core.forward import collate_batches
from pipeline.core.tokenize import EncodedRows


def test_bf16_needs_a_native_feature_a_speedup_and_agreement():
    assert pick_cpu_dtype(None, "AVX2", None, None, "") == ("float32", "float32: no native bf16 (AVX2)")
    assert pick_cpu_dtype("avx512_bf16", "AVX512", 1.68, True, "min cosine 0.99991 vs float32 on 64 rows") == (
        "bfloat16", "bfloat16: avx512_bf16, 1.68x faster, min cosine 0.99991 vs float32 on 64 rows")
    slow = pick_cpu_dtype("amx_bf16", "AVX512", 1.1, True, "min cosine 0.99991")
    assert slow[0] == "float32" and "only 1.10x as fast" in slow[1]
    wrong = pick_cpu_dtype("amx_bf16", "AVX512", 3.0, False, "min cosine 0.98000")
    assert wrong == ("float32", "float32: bfloat16 disagrees with float32 (min cosine 0.98000)")


def test_native_bf16_is_read_from_the_cpu_flags():
    assert native_bf16_feature("fpu sse2 avx2 fma") is None
    supported = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert native_bf16_feature("fpu avx512f avx512_bf16") == ("avx512_bf16" if supported else None)
    assert native_bf16_feature("avx512_bf16 amx_bf16 amx_tile") == ("amx_bf16" if supported else None)


def test_auto_without_native_bf16_is_float32_and_says_why(monkeypatch, tiny_encoder_path):
    monkeypatch.setattr(pipeline.runtime.dtype_trial, "native_bf16_feature", lambda: None)
    choice = choose_model(ModelSettings(model=tiny_encoder_path, device="cpu"))
    assert choice.dtype == torch.float32
    assert choice.dtype_reason == f"float32: no native bf16 ({torch.backends.cpu.get_cpu_capability()})"


def test_explicit_bf16_without_native_support_warns(monkeypatch, tiny_encoder_path, caplog):
    monkeypatch.setattr(pipeline.runtime.choice, "native_bf16_feature", lambda: None)
    with caplog.at_level(logging.WARNING, logger="pipeline.runtime.choice"):
        choice = choose_model(ModelSettings(model=tiny_encoder_path, device="cpu", dtype="bfloat16"))
    assert choice.dtype == torch.bfloat16
    assert "is emulated and runs several times slower" in caplog.text


def test_the_trial_decides_once_and_the_decision_is_cached(monkeypatch, tmp_path, tiny_encoder_path):
    """With a native feature the trial batch runs in both dtypes; its verdict is kept."""
    monkeypatch.setattr(pipeline.runtime.dtype_trial, "native_bf16_feature", lambda: "avx512_bf16")
    trials = []
    real_trial = pipeline.runtime.dtype_trial.bf16_trial

    def counted(*args):
        trials.append(args)
        return real_trial(*args)

    monkeypatch.setattr(pipeline.runtime.dtype_trial, "bf16_trial", counted)
    config = RunConfig.of(input=(), output="", model=tiny_encoder_path, device="cpu", plan_cache=str(tmp_path))
    first = choose_model(config.model, config.cache.plan_cache)
    assert first.dtype in (torch.float32, torch.bfloat16)
    if first.dtype == torch.bfloat16:
        assert first.dtype_reason.startswith("bfloat16: avx512_bf16, ")
        assert "vs float32 on 64 random-id rows" in first.dtype_reason
    else:  # a 32-wide model gains little from bf16
        assert first.dtype_reason.startswith("float32: bfloat16 ")
    again = choose_model(config.model, config.cache.plan_cache)
    assert again.dtype == first.dtype and again.dtype_reason == first.dtype_reason + " (cached)"
    assert len(trials) == 1


def test_embed_and_classify_agreement_tests():
    from jobs.registry import get_job

    embed, classify = get_job("embed"), get_job("classify")
    vectors = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
    assert embed.agreement({"embedding": vectors}, {"embedding": vectors * 1.0001})[0]
    assert not embed.agreement({"embedding": vectors}, {"embedding": vectors.roll(1, dims=0)})[0]
    scores = torch.tensor([[0.7, 0.3], [0.2, 0.8]])
    ok, text = classify.agreement({"scores": scores}, {"scores": scores + 0.004})
    assert ok and text == "same top label on 2/2 rows, max |Δscore| 0.0040"
    assert not classify.agreement({"scores": scores}, {"scores": scores.flip(1)})[0]


def test_cpu_batches_pad_to_their_own_longest_row_and_gpu_batches_to_eight():
    assert padding_multiple(torch.device("cpu")) == 1
    assert padding_multiple(torch.device("cuda")) == 8
    lengths = np.array([5, 29, 30, 31, 13, 12, 27], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    encoded = EncodedRows(np.arange(offsets[-1], dtype=np.int32) % 100 + 1, offsets, np.zeros(7, bool), [None] * 7, 0.0)
    batches = list(collate_batches(encoded, np.arange(7), 64, 3, 32, BatchLimits(None), 0,
                                   DeviceFeeder(torch.device("cpu"))))
    # budget 64 tokens: 2 rows of 31, 2 of 29, 2 of 13 (multiples of 8 would pad to 32, 32, 16), and 5 alone: it
    # would pad by more than an eighth of 13
    assert [lengths[b.rows].tolist() for b in batches] == [[31, 30], [29, 27], [13, 12], [5]]
    assert [b.padded_length for b in batches] == [31, 29, 13, 5]
    assert [tuple(b.tensors[0].shape) for b in batches] == [(2, 31), (2, 29), (2, 13), (1, 5)]
    assert sum(b.padded_tokens for b in batches) == 62 + 58 + 26 + 5
