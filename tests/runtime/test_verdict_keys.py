"""Verdicts keyed by content: a retrained checkpoint (same config, same file sizes, other
weights) and another pooling of the same weights get their own dtype and compile verdicts;
memory plans, which depend on shapes only, are shared; the content hash is cached by file
identity and a touched file hashes to the same key."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers

import pipeline.core.cache
from pipeline.core.cache import hash_files, model_content_files, model_content_hash, model_memory_fingerprint
from pipeline.core.compile import CompileVerdict
from pipeline.core.device import native_bf16_feature
from pipeline.runtime.choice import choose_model
from pipeline.runtime.compile_decision import compile_verdict_key, settle_compile
from pipeline.runtime.dtype_trial import dtype_verdict_key
from pipeline.offline.config import RunConfig
from pipeline.offline.claim import output_fingerprint
from tests.conftest import TOKENIZER_FILES


def tiny_classifier(directory: Path, minilm_path: str, seed: int) -> str:
    """conftest's tiny classifier with weights from `seed`: one config, one file size, other values."""
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=512, num_labels=3,
                                     id2label={0: "ok", 1: "spam", 2: "abuse"},
                                     label2id={"ok": 0, "spam": 1, "abuse": 2})
    torch.manual_seed(seed)
    transformers.BertForSequenceClassification(config).eval().save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(minilm_path) / name, directory / name)
    return str(directory)


def with_pooling(encoder_path: str, directory: Path, mode: str) -> str:
    """The same encoder weights as a sentence-transformers folder pooling by `mode`."""
    shutil.copytree(encoder_path, directory)
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32,
                                                                     "pooling_mode": mode}))
    return str(directory)


@pytest.fixture(scope="module")
def retrained(tmp_path_factory, minilm_path) -> tuple[str, str]:
    return (tiny_classifier(tmp_path_factory.mktemp("week-1"), minilm_path, seed=0),
            tiny_classifier(tmp_path_factory.mktemp("week-2"), minilm_path, seed=1))


@pytest.fixture(scope="module")
def poolings(tmp_path_factory, tiny_encoder_path) -> tuple[str, str]:
    base = tmp_path_factory.mktemp("poolings")
    return with_pooling(tiny_encoder_path, base / "cls", "cls"), with_pooling(tiny_encoder_path, base / "mean", "mean")


def settings(tmp_path, model, job="classify", **extra) -> RunConfig:
    return RunConfig.of(input=("unused",), output=str(tmp_path / "out"), model=model, job=job, max_length=128,
                        plan_cache=str(tmp_path / "cache"), **extra)


def verdict_name(run: RunConfig) -> str:
    """The file name of the dtype verdict a run on its input's rows looks for."""
    return dtype_verdict_key(run.model.job, choose_here(run), True)[1]


def verdict_of(run: RunConfig, choice) -> str:
    """The file name of the compile verdict a run looks for."""
    return compile_verdict_key(run.model, choice)[1]


def choose_here(run: RunConfig):
    return choose_model(run.model, run.cache.plan_cache)


def test_a_retrained_checkpoint_of_equal_config_and_sizes_gets_its_own_verdict_keys(tmp_path, retrained):
    first, second = (Path(p) for p in retrained)
    assert (first / "config.json").read_bytes() == (second / "config.json").read_bytes()
    assert (first / "model.safetensors").stat().st_size == (second / "model.safetensors").stat().st_size
    assert (first / "model.safetensors").read_bytes() != (second / "model.safetensors").read_bytes()
    # the old key: equal; it still keys the memory plans and sweep recommendations, which follow shapes only
    assert model_memory_fingerprint(str(first)) == model_memory_fingerprint(str(second))
    runs = [settings(tmp_path, str(model), dtype="float32") for model in (first, second)]
    assert verdict_name(runs[0]) != verdict_name(runs[1])
    choices = [choose_model(run.model, run.cache.plan_cache) for run in runs]
    assert verdict_of(runs[0], choices[0]) != verdict_of(runs[1], choices[1])
    assert output_fingerprint(runs[0], choices[0])["model"] != output_fingerprint(runs[1], choices[1])["model"]


def test_a_cls_and_a_mean_pooling_embedder_of_the_same_weights_get_their_own_verdict_keys(tmp_path, poolings):
    cls, mean = poolings
    assert Path(cls, "model.safetensors").read_bytes() == Path(mean, "model.safetensors").read_bytes()
    runs = [settings(tmp_path, model, job="embed", dtype="float32") for model in poolings]
    assert verdict_name(runs[0]) != verdict_name(runs[1])
    choices = [choose_model(run.model, run.cache.plan_cache) for run in runs]
    assert verdict_of(runs[0], choices[0]) != verdict_of(runs[1], choices[1])


def test_a_compile_verdict_is_read_for_its_own_model_only(tmp_path, retrained):
    """Week 1's cached verdict (compiled only 1.05x as fast) is used for week 1, not for week 2."""
    from pipeline.core.cache import write_keyed

    runs = [settings(tmp_path, model, dtype="float32", compile="auto") for model in retrained]
    choices = [choose_model(run.model, run.cache.plan_cache) for run in runs]
    key, name = compile_verdict_key(runs[0].model, choices[0])
    write_keyed(tmp_path / "cache" / f"compile-{name}.json", key,
                {**CompileVerdict(1.05, True, "min cosine 1.00000", 1e4, 20.0).__dict__})
    job = object()  # settle_compile reaches neither the job nor the model on these two eager paths
    assert settle_compile(runs[0].model, runs[0].batch, runs[0].cache, choices[0], job, None, None)[1].reason == \
        "eager: compiled only 1.05x as fast (needs 1.1x)"
    assert settle_compile(runs[1].model, runs[1].batch, runs[1].cache, choices[1], job, None, None)[1].reason == \
        "eager: no compile trial for this model, device and dtype"


@pytest.mark.slow
@pytest.mark.skipif(native_bf16_feature() is None, reason="the CPU dtype trial runs only where bf16 is native")
def test_the_second_checkpoint_runs_its_own_dtype_trial(tmp_path, retrained):
    first, second = (choose_here(settings(tmp_path, model, dtype="auto")) for model in retrained)
    assert not first.dtype_reason.endswith("(cached)") and not second.dtype_reason.endswith("(cached)")
    assert len(list((tmp_path / "cache").glob("dtype-*.json"))) == 2
    again = choose_here(settings(tmp_path, retrained[1], dtype="auto"))
    assert again.dtype_reason == second.dtype_reason + " (cached)"


def test_the_content_hash_is_cached_by_file_identity_and_a_touched_file_gets_the_same_hash(
        tmp_path, retrained, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(retrained[0], model)
    hashed = []
    monkeypatch.setattr(pipeline.core.cache, "hash_files",
                        lambda folder, files: hashed.append(folder) or hash_files(folder, files))
    cache = str(tmp_path / "cache")
    first = model_content_hash(str(model), cache)
    assert first == hash_files(model, model_content_files(model))  # the output fingerprint's hash, as before
    assert model_content_hash(str(model), cache) == first and len(hashed) == 1  # warm: read, not hashed

    weights = model / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # touched
    assert model_content_hash(str(model), cache) == first and len(hashed) == 2  # hashed again, same hash
    key = verdict_name(settings(tmp_path, str(model)))
    assert verdict_name(settings(tmp_path, str(model))) == key and len(hashed) == 2

    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # retrained in place: same size, same inode
    with open(weights, "r+b") as f:
        f.write(data)
    assert model_content_hash(str(model), cache) != first and len(hashed) == 3
    assert verdict_name(settings(tmp_path, str(model))) != key


def test_the_pooling_config_is_part_of_the_content(poolings):
    cls = Path(poolings[0])
    assert "1_Pooling/config.json" in [p.relative_to(cls).as_posix() for p in model_content_files(cls)]
    assert "modules.json" in [p.name for p in model_content_files(cls)]
