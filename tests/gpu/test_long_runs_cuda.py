"""Long runs on one GPU (issue 17, item 4): 1000 forward + backward passes of the CUDA backend
bitwise equal to the first with the caching allocator's reserved bytes exactly flat after a
warm-up (stage 1, both weight forms; the megakernel forward for 200), and the tiny GPU config
(configs/tiny_gpu_ep1.yaml, one NCCL rank) trained 200 steps with finite, falling losses and
flat reserved memory. ``scripts/long_runs.py`` runs the longer versions and records them.

Exactly flat, not bounded: each pass (and each step) allocates the same sizes in the same order
on one stream, so once warm nothing needs a new segment (``long_runs.CUDA_RESERVED_SPREAD_BOUND``
says why no cross-stream free can get in the way).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mok_megatron import ops
from mok_megatron.functional.cuda.mega import unavailable_here
from mok_megatron.testing import long_runs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not ops.extension_available(),
        reason="needs a CUDA GPU and mok_megatron._C",
    ),
]

ROOT = Path(__file__).resolve().parents[2]


def _assert_repeats_flat(record: dict) -> None:
    summary = {k: v for k, v in record.items() if k != "shape"}
    assert record["first_pass_finite"], summary
    assert record["mismatching_passes"] == 0, summary
    assert record["memory_kind"] == "cuda_reserved"
    assert record["memory_spread_bytes"] <= long_runs.CUDA_RESERVED_SPREAD_BOUND, summary  # 0
    assert long_runs.failures(record) == []


@pytest.mark.parametrize("fused_gate_up", [False, True], ids=["split", "fused"])
def test_stage1_1000_passes_bitwise_with_flat_reserved_memory(fused_gate_up):
    record = long_runs.repeat_passes(1000, cuda_forward="stage1", fused_gate_up=fused_gate_up)
    assert record["path"] == "cuda/stage1"
    _assert_repeats_flat(record)


@pytest.mark.skipif(bool(unavailable_here()), reason=f"megakernel: {unavailable_here()}")
def test_megakernel_200_passes_bitwise_with_flat_reserved_memory():
    """The megakernel forward (fused gate/up weights; a shared expert and top-4 are fine for it:
    test_megakernel.py runs deepseek-v3's shape, top-8 with a shared expert), stage 1's backward."""
    record = long_runs.repeat_passes(200, cuda_forward="megakernel")
    assert record["path"] == "cuda/megakernel" and record["gate_up"] == "fused"
    _assert_repeats_flat(record)


def test_tiny_gpu_config_trains_200_steps_with_flat_reserved_memory():
    record = long_runs.train_steps(str(ROOT / "configs" / "tiny_gpu_ep1.yaml"), 200, warmup=20)
    summary = {k: v for k, v in record.items() if k not in ("losses", "memory_bytes")}
    assert record["world"] == 1 and record["device"] == "cuda"
    assert record["all_losses_finite"], record["losses"]
    assert record["final_loss"] < record["first_loss"] - 1.0, record["losses"]
    assert record["memory_kind"] == "cuda_reserved"
    assert record["memory_spread_bytes"][0] <= long_runs.CUDA_RESERVED_SPREAD_BOUND, summary
    assert long_runs.failures(record) == []
