"""`embed` reads a sentence-transformers folder and computes what SentenceTransformer.encode does."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from jobs.sentence_transformers_folder import (EmbeddingRecipe, TextSettings, read_embedding_recipe,
                                               read_text_settings, resolve_prompt)
from pipeline.offline.config import RunConfig
from pipeline.core.errors import UsageError
from tests.conftest import write_shards

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def st_folder(root: Path, name: str, source: str, pooling: dict, normalize: bool, prompts: dict | None = None,
              default_prompt_name: str | None = None) -> str:
    """A sentence-transformers folder with MiniLM's weights and tokenizer and its own modules."""
    folder = root / name
    folder.mkdir()
    for item in Path(source).iterdir():
        if item.is_file() and item.name not in ("modules.json", "config_sentence_transformers.json"):
            os.symlink(item, folder / item.name)
    modules = [TRANSFORMER, {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 384, **pooling}))
    if normalize:
        modules.append(NORMALIZE)
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": prompts or {}, "default_prompt_name": default_prompt_name}))
    return str(folder)


# ── reading the folder: pure, no torch ─────────────────────────────────────────────────


def test_legacy_pooling_flags_and_the_new_pooling_mode_are_both_read(tmp_path, minilm_path):
    legacy = st_folder(tmp_path, "legacy", minilm_path, {"pooling_mode_cls_token": True,
                                                          "pooling_mode_max_tokens": True}, normalize=False)
    new = st_folder(tmp_path, "new", minilm_path, {"pooling_mode": ["lasttoken", "mean"], "include_prompt": False},
                    normalize=True)
    assert read_embedding_recipe(legacy) == EmbeddingRecipe(("cls", "max"), False, True,
                                                            f"sentence-transformers modules.json in {legacy}")
    recipe = read_embedding_recipe(new)
    assert (recipe.pooling, recipe.normalize, recipe.include_prompt) == (("lasttoken", "mean"), True, False)
    assert read_embedding_recipe(minilm_path).pooling == ("mean",) and read_embedding_recipe(minilm_path).normalize


def test_a_plain_folder_keeps_mean_pooling_and_says_so(tiny_encoder_path):
    recipe = read_embedding_recipe(tiny_encoder_path)
    assert (recipe.pooling, recipe.normalize) == (("mean",), True)
    assert "no sentence-transformers modules.json" in recipe.source
    assert read_text_settings(tiny_encoder_path) == TextSettings()


def test_a_module_lengthwise_does_not_run_is_refused_not_ignored(tmp_path, minilm_path):
    folder = Path(st_folder(tmp_path, "dense", minilm_path, {"pooling_mode": "mean"}, normalize=False))
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UsageError, match="Dense module .*does not run"):
        read_embedding_recipe(str(folder))


def test_an_unknown_pooling_mode_is_refused(tmp_path, minilm_path):
    folder = st_folder(tmp_path, "odd", minilm_path, {"pooling_mode": "median"}, normalize=False)
    with pytest.raises(UsageError, match="'median' is not one lengthwise runs"):
        read_embedding_recipe(folder)


def test_prompts_resolve_as_sentence_transformers_picks_them():
    settings = TextSettings(prompts={"query": "query: ", "doc": "passage: "}, default_prompt_name="doc")
    assert resolve_prompt(settings, None, None) == "passage: "
    assert resolve_prompt(settings, None, "query") == "query: "
    assert resolve_prompt(settings, "custom: ", None) == "custom: "
    assert resolve_prompt(TextSettings(), None, None) == ""
    with pytest.raises(UsageError, match="'nope' is not a prompt of this model; its prompts: query, doc"):
        resolve_prompt(settings, None, "nope")
    with pytest.raises(UsageError, match="not both"):
        resolve_prompt(settings, "x", "query")


def test_max_seq_length_and_lower_casing_come_from_sentence_bert_config(tmp_path, minilm_path):
    folder = Path(st_folder(tmp_path, "lower", minilm_path, {"pooling_mode": "mean"}, normalize=True))
    (folder / "sentence_bert_config.json").unlink()
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": True}))
    assert read_text_settings(str(folder)) == TextSettings(max_seq_length=64, lowercase=True)


# ── equal to SentenceTransformer.encode ────────────────────────────────────────────────

VARIANTS = {
    "cls, not normalized": dict(pooling={"pooling_mode": "cls"}, normalize=False),
    "max": dict(pooling={"pooling_mode_max_tokens": True, "pooling_mode_mean_tokens": False}, normalize=True),
    "mean-sqrt-len + weighted mean + last token": dict(
        pooling={"pooling_mode": ["mean_sqrt_len_tokens", "weightedmean", "lasttoken"]}, normalize=False),
    "named prompt": dict(pooling={"pooling_mode": "mean"}, normalize=True, prompts={"query": "query: "},
                         run={"prompt_name": "query"}, encode={"prompt_name": "query"}),
    "default prompt left out of the pooling": dict(
        pooling={"pooling_mode": "mean", "include_prompt": False}, normalize=False,
        prompts={"query": "Represent this sentence for searching: "}, default_prompt_name="query"),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_embed_equals_sentence_transformers_for_the_folder(tmp_path, sample_table, minilm_path, variant):
    from sentence_transformers import SentenceTransformer

    from pipeline.engines.local import run_job

    spec = dict(VARIANTS[variant])
    run_settings, encode_settings = spec.pop("run", {}), spec.pop("encode", {})
    folder = st_folder(tmp_path, "model", minilm_path, **spec)
    rows = sample_table.slice(0, 48)
    write_shards(tmp_path / "in", rows, [48])
    run_job(RunConfig.of(input=(str(tmp_path / "in"),), output=str(tmp_path / "out"), model=folder, progress=False, dtype="float32",
                         tokenize_workers=0, max_batch_tokens=1024, **run_settings))
    output = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    ours = np.array(output["embedding"].to_pylist(), dtype=np.float32)
    theirs = SentenceTransformer(folder, device="cpu").encode(rows["text"].to_pylist(), batch_size=16,
                                                             convert_to_numpy=True, **encode_settings)
    assert ours.shape == theirs.shape
    cosine = (ours * theirs).sum(axis=1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert cosine.min() >= 0.9999, f"{variant}: worst cosine {cosine.min()}"
    norm_ratio = np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert np.abs(norm_ratio - 1).max() < 1e-3, f"{variant}: vector lengths differ"


def test_a_rerun_with_another_prompt_is_refused(tmp_path, sample_table, tiny_encoder_path):
    from pipeline.engines.local import run_job

    write_shards(tmp_path / "in", sample_table.slice(0, 20), [20])
    settings = dict(input=(str(tmp_path / "in"),), output=str(tmp_path / "out"), model=tiny_encoder_path,
                    progress=False, tokenize_workers=0, probe=False)
    run_job(RunConfig.of(prompt="query: ", **settings))
    with pytest.raises(UsageError, match="prompt: 'query: ' → 'passage: '"):
        run_job(RunConfig.of(prompt="passage: ", **settings))
