"""Each job against the reference implementation users already trust."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from jobs.registry import get_job
from pipeline.core.errors import UsageError
from pipeline.offline.config import RunConfig
from pipeline.engines.local import run_job
from tests.conftest import write_shards


def run_over(tmp_path, table, **settings) -> pa.Table:
    write_shards(tmp_path / "in", table, [table.num_rows])
    config = RunConfig.of(input=(str(tmp_path / "in"),), output=str(tmp_path / "out"), progress=False, dtype="float32",
                          tokenize_workers=0, **settings)
    run_job(config)
    import pyarrow.parquet as pq

    return pq.read_table(tmp_path / "out" / "part-00000.parquet")


@pytest.mark.slow
def test_embed_matches_sentence_transformers_on_the_shipped_sample(tmp_path, sample_table, minilm_path):
    from sentence_transformers import SentenceTransformer

    output = run_over(tmp_path, sample_table, job="embed", max_length=256)
    assert output["id"].to_pylist() == sample_table["id"].to_pylist()
    ours = np.array(output["embedding"].to_pylist(), dtype=np.float32)
    reference = SentenceTransformer(minilm_path, device="cpu")
    assert reference.max_seq_length == 256
    theirs = reference.encode(sample_table["text"].to_pylist(), batch_size=32, convert_to_numpy=True)
    cosine = (ours * theirs).sum(axis=1) / np.linalg.norm(theirs, axis=1)
    assert ours.shape == (400, 384)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    assert cosine.min() >= 0.9999, f"worst row {sample_table['id'][int(cosine.argmin())]}: {cosine.min()}"


@pytest.mark.slow
def test_classify_matches_the_transformers_pipeline(tmp_path, sample_table, tiny_classifier_path):
    from transformers import pipeline

    rows = sample_table.slice(0, 60)
    output = run_over(tmp_path, rows, job="classify", model=tiny_classifier_path, max_length=512)
    classifier = pipeline("text-classification", model=tiny_classifier_path, top_k=None, device="cpu")
    expected = classifier(rows["text"].to_pylist(), truncation=True, max_length=512)
    labels = ["ok", "spam", "abuse"]
    assert output.schema.field("score").type == pa.float32()
    for row, reference in zip(output.to_pylist(), expected):
        by_label = {item["label"]: item["score"] for item in reference}
        assert row["scores"] == pytest.approx([by_label[name] for name in labels], abs=1e-4)
        assert row["label"] == reference[0]["label"]
        assert row["score"] == pytest.approx(reference[0]["score"], abs=1e-4)


def test_embed_forward_masks_padding(tiny_encoder_path):
    job = get_job("embed")
    model = job.load(tiny_encoder_path, torch.device("cpu"), torch.float32)
    ids = torch.tensor([[101, 2054, 102, 0, 0, 0]])
    with torch.inference_mode():
        padded = job.forward(model, ids, (ids != 0).long())["embedding"]
        unpadded = job.forward(model, ids[:, :3], torch.ones(1, 3, dtype=torch.long))["embedding"]
    assert torch.allclose(padded, unpadded, atol=1e-5)


def test_unknown_job_lists_the_known_ones():
    with pytest.raises(UsageError, match="set --job to one of: classify, embed"):
        get_job("summarise")
