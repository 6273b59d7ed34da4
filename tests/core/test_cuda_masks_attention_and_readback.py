"""The CUDA path's host-side behaviour, checked on the CPU: the prepared attention mask, the pooler
left out, the attention implementation settled and recorded, the plan key's runtime, the
allocator setting made before CUDA starts, and outputs read back after the next launch."""

import os
import subprocess
import sys

import numpy as np
import torch

from jobs.base import attention_implementation, model_attention_mask, takes_prepared_mask
from jobs.classify import ClassifyJob
from jobs.embed import EmbedJob, NoPooler
from pipeline.core.forward import HostCopy, forward_splitting_on_oom
from pipeline.core.cache import plan_cache_key

CPU = torch.device("cpu")


def padded_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    lengths = torch.tensor([12, 7, 3, 12])
    attention_mask = (torch.arange(12)[None, :] < lengths[:, None]).long()
    return torch.randint(1000, vocab_size, (4, 12), generator=generator) * attention_mask, attention_mask


def test_sdpa_models_take_the_prepared_mask_and_give_the_same_outputs(tiny_encoder_path, tiny_classifier_path):
    """The 4-D mask skips transformers' per-forward `mask.all()` (a host-device sync); it must
    change nothing in the outputs."""
    for job, path in ((EmbedJob(), tiny_encoder_path), (ClassifyJob(), tiny_classifier_path)):
        model = job.load(path, CPU, torch.float32, attention="sdpa")
        encoder = getattr(model, "encoder", model)
        assert encoder.config._attn_implementation == "sdpa" and encoder.takes_prepared_mask is True
        input_ids, attention_mask = padded_batch(encoder.config.vocab_size)
        assert model_attention_mask(encoder, attention_mask).shape == (4, 1, 1, 12)
        with torch.inference_mode():
            prepared = job.forward(model, input_ids, attention_mask)
            encoder.takes_prepared_mask = False
            plain = job.forward(model, input_ids, attention_mask)
        for name in plain:
            torch.testing.assert_close(prepared[name], plain[name], rtol=1e-5, atol=1e-5)


def test_eager_attention_keeps_the_plain_mask(tiny_encoder_path):
    model = EmbedJob().load(tiny_encoder_path, CPU, torch.float32, attention="eager")
    assert model.encoder.config._attn_implementation == "eager"
    assert takes_prepared_mask(model.encoder) is False
    assert model_attention_mask(model.encoder, torch.ones(2, 4, dtype=torch.long)).shape == (2, 4)


def test_embedding_models_do_not_run_the_unused_pooler(tiny_encoder_path):
    model = EmbedJob().load(tiny_encoder_path, CPU, torch.float32)
    assert isinstance(model.encoder.pooler, NoPooler)


def test_the_attention_implementation_is_settled_from_the_architecture(tiny_encoder_path, tiny_classifier_path):
    assert attention_implementation(EmbedJob.auto_class, tiny_encoder_path) == "sdpa"
    assert attention_implementation(ClassifyJob.auto_class, tiny_classifier_path) == "sdpa"


def test_the_output_fingerprint_holds_the_attention_implementation(tiny_encoder_path):
    from pipeline.offline.config import RunConfig
    from pipeline.runtime.choice import choose_model
    from pipeline.offline.claim import output_fingerprint

    config = RunConfig.of(input=("x",), output="y", model=tiny_encoder_path, device="cpu", dtype="float32")
    assert output_fingerprint(config, choose_model(config.model, config.cache.plan_cache))["attention"] == "sdpa"


def test_cache_keys_hold_the_runtime_that_decides_memory_and_speed():
    import transformers

    key, name = plan_cache_key(kind="test", model="m")
    assert key["torch"] == torch.__version__ and key["transformers"] == transformers.__version__
    assert key["cuda"] == torch.version.cuda and "lengthwise" in key and "allocator" in key
    assert plan_cache_key(kind="test", model="m")[1] == name


def test_expandable_segments_are_set_before_torch_starts_unless_the_user_set_the_allocator():
    code = "import os, pipeline; print(os.environ.get('PYTORCH_ALLOC_CONF'), os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))"
    clean = {k: v for k, v in os.environ.items() if not k.endswith("ALLOC_CONF")}
    ours = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, check=True)
    assert ours.stdout.split() == ["expandable_segments:True", "None"]
    theirs = subprocess.run([sys.executable, "-c", code],
                            env={**clean, "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"},
                            capture_output=True, text=True, check=True)
    assert theirs.stdout.split() == ["None", "max_split_size_mb:64"]


def test_outputs_come_back_to_the_host_as_float32_numpy():
    def forward(ids, mask):
        return {"value": (ids * 2).to(torch.bfloat16)}

    ids = torch.arange(6).reshape(3, 2)
    copy = HostCopy(forward_splitting_on_oom(forward, ids, torch.ones_like(ids), CPU), CPU)
    result = copy.read()
    assert isinstance(result.outputs["value"], np.ndarray) and result.outputs["value"].dtype == np.float32
    assert result.outputs["value"].tolist() == [[0, 2], [4, 6], [8, 10]] and copy.device_seconds() is None


class RecordingWriter:
    """Stands in for a WindowWriter: records what it was given, fails on a named window."""

    def __init__(self, fail_on=None):
        self.written, self.failures, self.fail_on = [], {}, fail_on

    def write(self, window):
        if window == self.fail_on:
            raise OSError(f"disk full at {window}")
        self.written.append(window)


def test_the_writer_thread_writes_in_order_and_hands_errors_back():
    from pipeline.offline.sink import BackgroundWriter

    ok = BackgroundWriter(RecordingWriter())
    for window in range(20):
        ok.write(window)
    ok.close()
    assert ok.writer.written == list(range(20))

    failing = BackgroundWriter(RecordingWriter(fail_on=3))
    raised = None
    try:
        for window in range(6):
            failing.write(window)  # raises here if the thread has met the error already
        failing.close()
    except OSError as error:
        raised = error
    assert raised is not None and "disk full at 3" in str(raised)
    assert failing.writer.written == [0, 1, 2]  # nothing after the failure is written


def test_a_config_only_remote_code_can_read_leaves_the_attention_to_that_code(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "not-a-transformers-architecture", "auto_map": '
                                          '{"AutoModel": "modeling_custom.CustomModel"}}')
    assert attention_implementation(EmbedJob.auto_class, str(tmp_path)) is None
