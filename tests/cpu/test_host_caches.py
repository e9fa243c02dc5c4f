"""What the forward's host path keeps between calls (to cut its host time) is never stale: each
cache misses when what it stands for changes, and bad input raises as it did without it."""

from __future__ import annotations

import pytest
import torch

from mok_megatron.functional.cuda import experts as cuda_experts

SM90_WHY = None
SM80_WHY = "mok_megatron._C is built for sm_90a and this GPU is sm_80"


@pytest.fixture
def capabilities(monkeypatch):
    """A fake torch.cuda.get_device_capability (cuda:0 is sm_90, cuda:1 sm_80, the current
    device sm_90); returns the list of devices it was asked about."""
    asked = []
    by_index = {0: (9, 0), 1: (8, 0), None: (9, 0)}

    def capability(device=None):
        index = device.index if isinstance(device, torch.device) else device
        asked.append(index)
        return by_index[index]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    cuda_experts._capability_of_index.cache_clear()
    yield asked
    cuda_experts._capability_of_index.cache_clear()


def test_device_capability_is_asked_once_per_device_index(capabilities):
    for _ in range(3):
        assert cuda_experts.not_hopper(torch.device("cuda", 0)) is SM90_WHY
        assert cuda_experts.not_hopper(torch.device("cuda", 1)) == SM80_WHY
    assert capabilities == [0, 1]


def test_the_current_device_is_asked_every_time(capabilities):
    """An index-less device is whichever is current, which may change: never cached."""
    for _ in range(2):
        assert cuda_experts.not_hopper(torch.device("cuda")) is SM90_WHY
    assert capabilities == [None, None]


def test_a_device_that_is_not_cuda_asks_nothing(capabilities):
    assert cuda_experts.not_hopper(torch.device("cpu")) == "the device is cpu, not a CUDA GPU"
    assert cuda_experts.not_hopper(None) == "the device is None, not a CUDA GPU"
    assert capabilities == []


def test_a_gpu_that_cannot_run_the_engine_still_raises_every_time(capabilities):
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"expert_gemm='engine' but the expert GEMM engine"):
            cuda_experts.engine_steps("engine", torch.device("cuda", 1))
