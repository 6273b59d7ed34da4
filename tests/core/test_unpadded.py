"""The unpadded forward (pipeline/core/unpadded.py) gives the padded Hugging Face forward's outputs
on the CPU: MiniLM and tiny random BERT and RoBERTa models, pooled embeddings and classifier
logits, rows of very different lengths, one-token rows and a batch of one; models of another
layout keep the padded forward; `--unpad on` and `--compile on` exclude each other."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch.utils._python_dispatch import TorchDispatchMode

from jobs.registry import get_job
from pipeline.core.errors import UsageError
from pipeline.offline.config import RunConfig
from pipeline.runtime.choice import choose_model
from pipeline.runtime.compile_decision import settle_compile
from pipeline.runtime.model import load_model
from pipeline.core.buckets import BatchLimits
from pipeline.core.clock import StageTimes
from pipeline.core.collate import packed_layout
from pipeline.core.forward import DeviceFeeder, collate_batches, run_on_device
from pipeline.core.tokenize import EncodedRows
from pipeline.core.unpadded import PackedBatch, cumulative_lengths, runs_unpadded, settle_unpad
from tests.conftest import SAMPLE_DIR, TOKENIZER_FILES

CPU = torch.device("cpu")
MAX_DIFFERENCE = 1e-5  # float32: the unpadded forward computes the same sums on fewer rows


def batch(lengths: list[int], vocab: int = 30522, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and mask of rows of `lengths`, padded with id 0 (MiniLM's [PAD])."""
    length = max(lengths)
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).long()
    return torch.randint(1000, vocab, (len(lengths), length), generator=generator) * mask, mask


BATCHES = {"very different lengths": [3, 128, 1, 57, 2, 100, 9], "one-token rows": [1, 1, 4],
           "a batch of one": [23], "one row of one token": [1]}


def outputs_both_ways(job, model, input_ids, attention_mask) -> tuple[dict, dict]:
    """(padded, unpadded) outputs of the same batch."""
    forward = model.unpadded
    with torch.inference_mode():
        unpadded = job.forward(model, input_ids, attention_mask)
        model.unpadded = None
        padded = job.forward(model, input_ids, attention_mask)
    model.unpadded = forward
    return padded, unpadded


def max_difference(padded: dict, unpadded: dict) -> float:
    assert padded.keys() == unpadded.keys()
    return max(float((padded[name] - unpadded[name]).abs().max()) for name in padded)


def test_cumulative_lengths_are_each_rows_offset_in_the_packed_tokens():
    offsets = cumulative_lengths(torch.tensor([3, 1, 5, 1]))
    assert offsets.dtype == torch.int32
    assert offsets.tolist() == [0, 3, 4, 9, 10]
    assert cumulative_lengths(torch.tensor([7])).tolist() == [0, 7]


def test_a_packed_batch_scatters_back_into_its_padded_places():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    packed = PackedBatch(mask)
    assert packed.indices.tolist() == [0, 1, 4, 5, 6, 7, 8]
    assert packed.offsets.tolist() == [0, 2, 6, 7]
    values = torch.arange(1, 8, dtype=torch.float32)[:, None]
    assert packed.padded(values)[..., 0].tolist() == [[1, 2, 0, 0], [3, 4, 5, 6], [7, 0, 0, 0]]


def test_the_hosts_packed_layout_is_the_one_the_mask_gives():
    indices, offsets = packed_layout(np.array([2, 4, 1]), 4)
    assert (indices.dtype, offsets.dtype) == (np.int64, np.int32)
    assert indices.tolist() == [0, 1, 4, 5, 6, 7, 8] and offsets.tolist() == [0, 2, 6, 7]
    for lengths in BATCHES.values():
        from_mask = PackedBatch(batch(lengths)[1])
        indices, offsets = packed_layout(np.array(lengths), max(lengths))
        assert indices.tolist() == from_mask.indices.tolist() and offsets.tolist() == from_mask.offsets.tolist()


class DeviceQuestions(TorchDispatchMode):
    """The ops that make the host wait for the device: a data-dependent shape (nonzero) or a value
    read back (.item(), bool() of a tensor)."""

    SYNCS = {"nonzero", "_local_scalar_dense", "masked_select", "unique"}

    def __init__(self):
        super().__init__()
        self.asked: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.SYNCS:
            self.asked.append(name)
        return func(*args, **(kwargs or {}))


def encoded_rows(lengths: list[int]) -> EncodedRows:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    token_ids = (np.arange(offsets[-1], dtype=np.int32) * 7919) % 29000 + 1000
    return EncodedRows(token_ids, offsets, np.zeros(len(lengths), bool), [None] * len(lengths), 0.0)


def test_the_unpadded_forward_takes_its_layout_from_the_batch_and_never_asks_the_device(minilm_embedder):
    job, model = minilm_embedder
    assert runs_unpadded(model)
    lengths = BATCHES["very different lengths"] + [40, 41, 7]
    encoded, rows, feeder, limits = encoded_rows(lengths), np.arange(len(lengths)), DeviceFeeder(CPU), BatchLimits(None)
    collated = list(collate_batches(encoded, rows, 4096, 4, 128, limits, 0, feeder, packed=True))
    assert all(len(b.tensors) == 4 for b in collated if b.padded)  # ids, mask, token positions, row offsets
    with DeviceQuestions() as questions:
        done = list(run_on_device(collated, job, model, CPU, feeder, limits, 2, StageTimes()))
    assert questions.asked == []
    with DeviceQuestions() as control:  # the same forward without the host's layout reads it from the mask
        with torch.inference_mode():
            job.forward(model, *batch(lengths[:3]))
    assert "nonzero" in control.asked
    # cell for cell the padded forward's embeddings
    model.unpadded, unpadded = None, model.unpadded
    try:
        padded = list(run_on_device(collate_batches(encoded, rows, 4096, 4, 128, limits, 0, feeder), job, model, CPU,
                                    feeder, limits, 2, StageTimes()))
    finally:
        model.unpadded = unpadded
    assert [b.rows.tolist() for b, _ in done] == [b.rows.tolist() for b, _ in padded]
    for (_, with_layout), (_, without) in zip(done, padded):
        assert np.abs(with_layout.outputs["embedding"] - without.outputs["embedding"]).max() <= MAX_DIFFERENCE


@pytest.fixture(scope="module")
def minilm_embedder(minilm_path):
    job = get_job("embed")
    model = job.load(minilm_path, CPU, torch.float32)
    reason = settle_unpad("on", job, model, CPU, torch.float32)
    assert reason.startswith("unpadded: BertModel on packed tokens, padded attention"), reason
    return job, model


@pytest.mark.parametrize("lengths", BATCHES.values(), ids=BATCHES.keys())
def test_minilm_embeddings_unpadded_equal_the_padded_forward(minilm_embedder, lengths):
    job, model = minilm_embedder
    padded, unpadded = outputs_both_ways(job, model, *batch(lengths))
    assert unpadded["embedding"].shape == (len(lengths), 384)
    assert max_difference(padded, unpadded) <= MAX_DIFFERENCE


def test_minilm_unpadded_rows_do_not_depend_on_their_batch(minilm_embedder):
    job, model = minilm_embedder
    input_ids, attention_mask = batch(BATCHES["very different lengths"])
    with torch.inference_mode():
        together = job.forward(model, input_ids, attention_mask)["embedding"]
        alone = job.forward(model, input_ids[3:4, :57], attention_mask[3:4, :57])["embedding"]
    assert float((together[3] - alone[0]).abs().max()) <= MAX_DIFFERENCE


def tiny_model(directory: Path, minilm_path: str, architecture: str, **config) -> str:
    """A 2-layer, 32-wide random model of `architecture` (Bert… or Roberta…), saved with
    save_pretrained, with MiniLM's tokenizer."""
    import transformers

    config_class = transformers.RobertaConfig if architecture.startswith("Roberta") else transformers.BertConfig
    torch.manual_seed(0)
    model_config = config_class(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=64, max_position_embeddings=514, **config)
    getattr(transformers, architecture)(model_config).eval().save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(minilm_path) / name, directory / name)
    return str(directory)


LABELS = {"num_labels": 3, "id2label": {0: "ok", 1: "spam", 2: "abuse"}, "label2id": {"ok": 0, "spam": 1, "abuse": 2}}
CASES = {"bert embed": ("embed", "BertModel", {}),
         "bert classify": ("classify", "BertForSequenceClassification", LABELS),
         "bert moderate": ("moderate", "BertForSequenceClassification",
                           {**LABELS, "problem_type": "multi_label_classification"}),
         "roberta embed": ("embed", "RobertaModel", {}),
         "roberta classify": ("classify", "RobertaForSequenceClassification", LABELS)}


@pytest.mark.parametrize("job_name, architecture, config", CASES.values(), ids=CASES.keys())
def test_tiny_random_models_unpadded_equal_the_padded_forward(tmp_path, minilm_path, job_name, architecture, config):
    job = get_job(job_name)
    model = job.load(tiny_model(tmp_path, minilm_path, architecture, **config), CPU, torch.float32)
    reason = settle_unpad("on", job, model, CPU, torch.float32)
    assert reason.startswith("unpadded: "), reason
    for lengths in BATCHES.values():
        padded, unpadded = outputs_both_ways(job, model, *batch(lengths))
        assert max_difference(padded, unpadded) <= MAX_DIFFERENCE, lengths
    if job_name != "embed":  # the classifier's raw logits too, not only its probabilities
        input_ids, attention_mask = batch(BATCHES["very different lengths"])
        classifier = getattr(model, "classifier") if job_name == "moderate" else model
        with torch.inference_mode():
            logits = model.unpadded.logits(input_ids, attention_mask)
            reference = classifier(input_ids=input_ids, attention_mask=attention_mask).logits
        assert logits.shape == (7, 3)
        assert float((logits - reference).abs().max()) <= MAX_DIFFERENCE


def test_another_layout_keeps_the_padded_forward_and_says_why(tmp_path, minilm_path):
    import transformers

    config = transformers.DistilBertConfig(vocab_size=30522, dim=32, n_layers=2, n_heads=2, hidden_dim=64)
    transformers.DistilBertModel(config).save_pretrained(tmp_path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(minilm_path) / name, tmp_path / name)
    job = get_job("embed")
    model = job.load(str(tmp_path), CPU, torch.float32)
    reason = settle_unpad("on", job, model, CPU, torch.float32)
    assert reason == "padded: DistilBertModel (distilbert) is not one of BertModel, RobertaModel, XLMRobertaModel"
    assert model.unpadded is None


def test_auto_keeps_the_padded_forward_on_a_cpu_and_off_is_off(minilm_path):
    job = get_job("embed")
    model = job.load(minilm_path, CPU, torch.float32)
    assert settle_unpad("auto", job, model, CPU, torch.float32).startswith("padded: --unpad auto on a CPU")
    assert model.unpadded is None
    assert settle_unpad("off", job, model, CPU, torch.float32) == "padded: --unpad off"
    assert model.unpadded is None


def test_compile_on_and_unpad_on_exclude_each_other(tiny_encoder_path):
    settings = RunConfig.of(input=(), output="", model=tiny_encoder_path, device="cpu", dtype="float32",
                            compile="on", unpad="on")
    with pytest.raises(UsageError, match="--compile on and --unpad on exclude each other"):
        choose_model(settings.model)


def test_unpad_on_leaves_compile_auto_eager(tiny_encoder_path, tmp_path):
    settings = RunConfig.of(input=(), output="", model=tiny_encoder_path, device="cpu", dtype="float32",
                            compile="auto", unpad="on", plan_cache=str(tmp_path))
    choice = choose_model(settings.model, settings.cache.plan_cache)
    job = get_job("embed")
    model = job.load(choice.path, CPU, torch.float32)
    kept, decided = settle_compile(settings.model, settings.batch, settings.cache, choice, job, model, job_tokens=1e12)
    assert kept is model and not decided.compiled
    assert decided.reason == "eager: --unpad on (a compiled forward runs padded)"


@pytest.mark.slow
def test_a_run_with_unpad_on_writes_the_padded_runs_embeddings(tmp_path, tiny_encoder_path):
    import numpy as np
    import pyarrow.parquet as pq

    from pipeline.engines.local import run_job

    sample = pq.read_table(sorted(SAMPLE_DIR.glob("*.parquet"))[0]).slice(0, 60)
    (tmp_path / "in").mkdir()
    pq.write_table(sample, tmp_path / "in" / "part-0.parquet")
    outputs, summaries = {}, {}
    for unpad in ("off", "on"):
        config = RunConfig.of(input=(str(tmp_path / "in"),), output=str(tmp_path / unpad), model=tiny_encoder_path,
                              device="cpu", dtype="float32", compile="off", unpad=unpad, tokenize_workers=0,
                              probe=False, progress=False, plan_cache=str(tmp_path / "plans"))
        summaries[unpad] = run_job(config)
        table = pq.read_table(tmp_path / unpad)
        outputs[unpad] = (table["id"].to_pylist(), np.stack(table["embedding"].to_numpy(zero_copy_only=False)))
    assert summaries["off"].unpad == "padded: --unpad off"
    assert summaries["on"].unpad.startswith("unpadded: BertModel")
    assert outputs["on"][0] == outputs["off"][0] == sample["id"].to_pylist()
    assert summaries["on"].rows == 60
    assert np.abs(outputs["on"][1] - outputs["off"][1]).max() <= MAX_DIFFERENCE


def test_the_flag_the_variable_and_the_toml_key_reach_the_setting(tmp_path, monkeypatch, tiny_encoder_path):
    from pipeline.cli import cli

    runner = CliRunner()
    seen = []

    def stop_before_running(config):
        seen.append(config.model.unpad)
        raise UsageError("stopped before running")

    monkeypatch.setattr("pipeline.cli.job_commands.execute_run", stop_before_running)
    common = ["run", "--input", str(SAMPLE_DIR), "--output", str(tmp_path / "out"), "--model", tiny_encoder_path]
    assert runner.invoke(cli, [*common, "--unpad", "on"]).exit_code == 2
    assert runner.invoke(cli, common, env={"LENGTHWISE_UNPAD": "off"}).exit_code == 2
    toml = tmp_path / "job.toml"
    toml.write_text('unpad = "on"\n')
    assert runner.invoke(cli, [*common, "--config", str(toml)]).exit_code == 2
    assert runner.invoke(cli, common).exit_code == 2
    assert seen == ["on", "off", "on", "auto"]
    assert runner.invoke(cli, [*common, "--unpad", "sometimes"]).exit_code == 2


def test_load_model_records_which_forward_runs(tiny_classifier_path, tmp_path):
    settings = RunConfig.of(input=(), output="", job="classify", model=tiny_classifier_path, device="cpu",
                            dtype="float32", compile="off", unpad="on", plan_cache=str(tmp_path))
    loaded = load_model(settings.model, settings.batch, cache=settings.cache)
    assert loaded.unpad.startswith("unpadded: BertForSequenceClassification on packed tokens")
    assert loaded.model.unpadded is not None
    off_settings = settings.with_settings(unpad="off")
    off = load_model(off_settings.model, off_settings.batch, cache=off_settings.cache)
    assert off.unpad == "padded: --unpad off" and off.model.unpadded is None


@pytest.mark.slow
def test_the_unpadded_forward_gets_a_memory_plan_of_its_own(tiny_encoder_path, tmp_path):
    from pipeline.core.probe import memory_plan_for

    # batches large enough that the probe measures growth whatever else the machine runs (256 tokens did not)
    config = RunConfig.of(input=(), output="", model=tiny_encoder_path, device="cpu", dtype="float32", max_length=64,
                          max_batch_tokens=2**20, max_batch_rows=4096, memory_budget=64 * 2**20,
                          plan_cache=str(tmp_path))
    job = get_job("embed")
    model = job.load(tiny_encoder_path, CPU, torch.float32)
    for unpad in ("off", "on"):
        settle_unpad(unpad, job, model, CPU, torch.float32)
        assert memory_plan_for(config.batch, config.cache, "embed", 64, job, model, tiny_encoder_path, CPU) is not None
    plans = sorted(path.name for path in tmp_path.glob("*.json"))
    assert len(plans) == 2, plans  # one probed with each forward, neither reused for the other
