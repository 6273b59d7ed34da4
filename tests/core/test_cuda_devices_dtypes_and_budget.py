"""What the CUDA path needs that a CPU can check (none of it has run on a GPU): CUDA devices
carry their index, sliding-window encoders keep their own mask, unpadded batches go without a
mask, fp16 pooling does not overflow, Ray actors settle their own device, dtype and threads, the
allocator setting in effect is recorded, and the CUDA token budget grows with the model."""

from __future__ import annotations

import pytest
import torch

from pipeline.core.device import resolve_device
from pipeline.core.errors import UsageError


@pytest.fixture
def two_gpus_current_one(monkeypatch):
    """torch.cuda as a host with two GPUs, cuda:1 current, whose set_device refuses a device
    without an index (torch's own check, `_get_device_index`)."""
    made_current = []

    def set_device(device):
        made_current.append(torch.cuda._utils._get_device_index(device))  # ValueError without an index

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    return made_current


def test_a_cuda_device_always_carries_its_index(two_gpus_current_one):
    with pytest.raises(ValueError, match="index"):
        torch.cuda.set_device(torch.device("cuda"))  # what the index-less device did on the first GPU run
    for name, index in (("auto", 1), ("cuda", 1), ("cuda:0", 0), ("cuda:1", 1)):
        device = resolve_device(name)
        assert device == torch.device("cuda", index)
        torch.cuda.set_device(device)
    assert two_gpus_current_one == [1, 1, 0, 1]
    with pytest.raises(UsageError, match="cuda:0 to cuda:1"):
        resolve_device("cuda:2")


def test_without_a_gpu_cuda_is_a_usage_error_and_auto_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(UsageError, match="--device cpu"):
        resolve_device("cuda")


def tiny_modernbert():
    """A 3-layer ModernBERT with random weights: one global layer, two attending within 8 tokens."""
    import transformers

    config = transformers.ModernBertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                           intermediate_size=64, max_position_embeddings=512, local_attention=8,
                                           global_attn_every_n_layers=3, pad_token_id=0, bos_token_id=1,
                                           eos_token_id=2, cls_token_id=1, sep_token_id=2)
    torch.manual_seed(0)
    return transformers.ModernBertModel._from_config(config, attn_implementation="sdpa").eval()


def test_sliding_window_settings_are_recognised_on_configs():
    from types import SimpleNamespace

    import transformers

    from jobs.base import attends_locally

    assert attends_locally(transformers.BertConfig()) is False
    assert attends_locally(transformers.MistralConfig(sliding_window=4096)) is True
    assert attends_locally(SimpleNamespace(layer_types=["full_attention", "sliding_attention"])) is True
    assert attends_locally(SimpleNamespace(layer_types=["full_attention"], sliding_window=None)) is False


@pytest.mark.slow
def test_a_sliding_window_encoder_keeps_its_own_mask(monkeypatch):
    """The 8-token check cannot tell: the prepared mask passes it, then changes 64-token rows by
    attending globally in the local layers. lengthwise must not prepare the mask for such a model."""
    import jobs.base
    from jobs.base import model_attention_mask, prepared_mask, takes_prepared_mask

    model = tiny_modernbert()
    assert takes_prepared_mask(model) is False
    monkeypatch.setattr(jobs.base, "attends_locally", lambda config: False)
    assert takes_prepared_mask(model) is True  # blind at 8 tokens, within one window
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, 1000, (2, 64), generator=generator)
    attention_mask = torch.ones(2, 64, dtype=torch.long)
    attention_mask[1, 40:] = 0
    kept = attention_mask.bool()
    with torch.inference_mode():
        plain = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        prepared = model(input_ids=input_ids, attention_mask=prepared_mask(attention_mask)).last_hidden_state
        ours = model(input_ids=input_ids, attention_mask=model_attention_mask(model, attention_mask)).last_hidden_state
    assert float((plain - prepared)[kept].abs().max()) > 1e-3  # the wrong vectors a prepared mask gives a sliding window
    torch.testing.assert_close(ours[kept], plain[kept], rtol=0, atol=0)  # model.takes_prepared_mask is False


def test_a_batch_without_padding_runs_without_a_mask_and_gives_the_same_outputs(tiny_encoder_path):
    from jobs.base import model_attention_mask
    from jobs.embed import EmbedJob

    model = EmbedJob().load(tiny_encoder_path, torch.device("cpu"), torch.float32, attention="sdpa")
    input_ids = torch.randint(1000, 30000, (3, 16), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(input_ids)
    assert model_attention_mask(model.encoder, attention_mask, padded=False) is None
    with torch.inference_mode():
        masked = EmbedJob().forward(model, input_ids, attention_mask, padded=True)["embedding"]
        unmasked = EmbedJob().forward(model, input_ids, attention_mask, padded=False)["embedding"]
    torch.testing.assert_close(unmasked, masked, rtol=1e-5, atol=1e-6)


def test_the_collate_tells_which_batches_hold_padding():
    import numpy as np

    from pipeline.core.buckets import BatchLimits
    from pipeline.core.collate import has_padding
    from pipeline.core.forward import DeviceFeeder, collate_batches
    from pipeline.core.tokenize import EncodedRows

    lengths = np.array([6, 6, 6, 3])
    encoded = EncodedRows(token_ids=np.arange(lengths.sum(), dtype=np.int32) + 100,
                          offsets=np.concatenate([[0], np.cumsum(lengths)]), truncated=np.zeros(4, dtype=bool),
                          errors=[None] * 4, encode_s=0.0)
    batches = list(collate_batches(encoded, np.arange(4), max_batch_tokens=18, max_batch_rows=3, max_length=8,
                                   limits=BatchLimits(None), pad_token_id=0, feeder=DeviceFeeder(torch.device("cpu"))))
    assert [(sorted(b.rows.tolist()), b.padded_length, b.padded) for b in batches] == [([0, 1, 2], 6, False),
                                                                                        ([3], 3, False)]
    assert has_padding(np.array([6, 3]), 6) is True and has_padding(np.array([8, 8]), 8) is False


@pytest.mark.parametrize("mode", ["weightedmean", "mean", "mean_sqrt_len_tokens"])
def test_float16_pooling_of_512_tokens_stays_finite_and_matches_float32(mode):
    """Weighted-mean weights alone add up to 131,328 at 512 tokens, more than float16 holds
    (65,504); states near 200 overflow a plain float16 mean too."""
    from jobs.embed import pool
    from jobs.sentence_transformers_folder import EmbeddingRecipe

    generator = torch.Generator().manual_seed(4)
    hidden = (200 + torch.randn(2, 512, 16, generator=generator)).half()
    attention_mask = torch.ones(2, 512, dtype=torch.long)
    attention_mask[1, 300:] = 0
    positions = torch.arange(1, 513, dtype=torch.float16)
    raw_sum = torch.bmm((attention_mask.half() * positions).unsqueeze(1), hidden)
    assert not torch.isfinite(raw_sum).all()  # what the float16 matmul of unscaled weights gave
    recipe = EmbeddingRecipe(pooling=(mode,), normalize=False)
    half = pool(hidden, attention_mask, recipe)
    single = pool(hidden.float(), attention_mask, recipe)
    assert half.dtype == torch.float32 and torch.isfinite(half).all()
    torch.testing.assert_close(half, single, rtol=2e-3, atol=0)


def test_the_default_cuda_token_budget_grows_as_the_model_shrinks():
    import transformers

    from pipeline.core.settings import cuda_batch_tokens, device_batch_limit

    assert cuda_batch_tokens(768, 12) == 32768  # BERT-base: the flat default it replaces
    assert cuda_batch_tokens(384, 6) == 262144  # all-MiniLM-L6-v2: 8x less work per token
    assert cuda_batch_tokens(384, 12) == 131072  # all-MiniLM-L12-v2
    assert cuda_batch_tokens(1024, 24) == 16384  # BERT-large: the floor
    assert cuda_batch_tokens(32, 2) == 262144  # the ceiling
    minilm = transformers.BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12)
    assert device_batch_limit("cuda", "max_batch_tokens", minilm) == 262144
    assert device_batch_limit("cuda", "max_batch_tokens") == 32768  # no model: the flat default
    assert device_batch_limit("cpu", "max_batch_tokens", minilm) == 2048  # the CPU default does not scale
    assert device_batch_limit("cuda", "max_batch_rows", minilm) == 4096


def test_the_allocator_setting_recorded_is_the_one_in_effect_once_cuda_has_started(monkeypatch):
    """The variable's text says nothing once CUDA has started without it (or ignored it): the
    plan key holds what torch reports, including whether its segments really are expandable."""
    from pipeline.core.cache import plan_cache_key
    from pipeline.core.device import allocator_config

    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert allocator_config() == ""  # nothing in effect before CUDA starts
    before = plan_cache_key(kind="test")[1]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [{"is_expandable": False}])
    assert allocator_config() == "native; settings ; expandable segments no"  # the variable was not applied
    ignored = plan_cache_key(kind="test")
    assert ignored[0]["allocator"] == "native; settings ; expandable segments no" and ignored[1] != before
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "expandable_segments:True")
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [{"is_expandable": True}])
    assert allocator_config() == "native; settings expandable_segments:True; expandable segments yes"
    assert plan_cache_key(kind="test")[1] != ignored[1]
