"""testing.timing on a GPU: time_back_to_back keeps the GPU's queue full, so host work that
precedes each call's launches is hidden behind the call before it, where time_fn (each call from
an idle GPU) counts it."""

from __future__ import annotations

import time

import pytest
import torch

from mok_megatron.testing.timing import time_back_to_back, time_fn

pytestmark = pytest.mark.gpu

HOST_S = 0.002  # host work before each call's kernel
GPU_MS = 6.0  # the kernel's time on the GPU


def _sleep_cycles(ms: float) -> int:
    """torch.cuda._sleep cycles that last about ``ms`` on this GPU (measured)."""
    probe = 1_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe)  # warm
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * ms / start.elapsed_time(end))


def test_back_to_back_hides_host_work_that_time_fn_counts():
    cycles = _sleep_cycles(GPU_MS)

    def call(i):
        time.sleep(HOST_S)  # the host's part of the call, before its launch
        torch.cuda._sleep(cycles)

    one_by_one = time_fn(call, warmup=2, iters=6, device="cuda")
    back_to_back = time_back_to_back(call, warmup=2, iters=6, calls=8, device="cuda")
    host_ms = HOST_S * 1e3
    # call by call: the host's time, then the kernel's; back to back: the kernel's alone (the
    # host's part of a call runs while the GPU runs the one before; only the first is exposed)
    assert one_by_one.median_ms > GPU_MS + 0.8 * host_ms
    assert back_to_back.median_ms < GPU_MS + host_ms / 8 + 0.5
    assert back_to_back.median_ms > 0.8 * GPU_MS
