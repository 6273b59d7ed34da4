"""The second GPU review's findings (issue 19) that a CPU can check: CUDA devices carry their
index, sliding-window encoders keep their own mask, unpadded batches go without a mask, fp16
pooling does not overflow, Ray actors settle their own device, dtype and threads, the allocator
setting in effect is recorded, and the CUDA token budget grows with the model."""

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
