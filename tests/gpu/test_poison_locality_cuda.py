"""Poisoned input stays local on the CUDA backend (issue 17, item 2; the reference backend's
half is tests/cpu/test_poison_locality.py, the check is testing.locality's): a NaN in one
token's x, or in one expert's W_down, makes exactly what depends on it non-finite and leaves
every other output and gradient bitwise equal to the clean run. EP 1: stage 1 (the default
cuda_forward) with the split and the fused gate/up weights, and the megakernel (fused weights,
cuda_forward="megakernel"; its backward is stage 1's). Outputs and gradients are allocated from
poisoned memory (testing.poison), so a value the kernels never wrote cannot pass as clean."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mok_megatron import functional as F
from mok_megatron.ops import interleave_gate_up
from mok_megatron.testing import random_moe_problem
from mok_megatron.testing.locality import ROUTED_GRADS, assert_poison_local
from mok_megatron.testing.poison import poisoned_memory
from mok_megatron.testing.runs import global_d_out

pytestmark = pytest.mark.gpu

#: The forward paths: (cuda_forward, fused gate/up weights).
PATHS = {"stage1-split": ("stage1", False), "stage1-fused": ("stage1", True),
         "megakernel": ("megakernel", True)}  # fmt: skip


def run(problem, path: str) -> dict:
    """out and every gradient (on the CPU) of one forward + backward, CUDA backend, bf16."""
    cuda_forward, fused = PATHS[path]
    config = F.MoKConfig(wait_timeout_ms=60_000, cuda_forward=cuda_forward)
    x, topk, rw, (gate, up, down), shared = problem.local(0, dtype=torch.bfloat16, device="cuda")
    routed = (interleave_gate_up(gate, up), None, down) if fused else (gate, up, down)
    ws = F.create_workspace(
        config, None, device="cuda", num_local_tokens=x.shape[0], hidden_size=x.shape[1],
        topk=topk.shape[1], num_experts=gate.shape[0], intermediate_size=gate.shape[1],
        shared_intermediate_size=shared[0].shape[0] if shared else 0, dtype=torch.bfloat16,
        backend="cuda",
    )  # fmt: skip
    assert ws.backend.path(ws) == cuda_forward
    weights = (*(shared or (None, None, None)), *routed)
    d_out = global_d_out(problem, 1).to("cuda", torch.bfloat16)
    with poisoned_memory(large_bytes=1 << 30) as mem:  # outputs start as NaN in every size class
        sched = F.build_schedule(ws, config, topk, ws.num_local_experts, router_weights=rw)
        out, ctx = F.forward(config, ws, sched, x, rw, *weights)
        grads = F.backward(config, ws, sched, ctx, d_out, x, rw, *weights)._asdict()
    result = {k: v for k, v in {"out": out, **grads}.items() if v is not None}
    torch.cuda.synchronize()
    mem.assert_covers(**result)
    return {k: v.cpu() for k, v in result.items()}


@pytest.mark.parametrize("path", list(PATHS))
def test_nan_in_one_token_stays_with_that_token(path):
    problem = random_moe_problem([96], 256, 128, 8, 2, seed=3)
    clean = run(problem, path)
    token = 90
    x = problem.x.clone()
    x[token, 5] = float("nan")
    poisoned = run(dataclasses.replace(problem, x=x), path)
    experts = problem.topk_experts[token]
    slots = torch.zeros(problem.topk_experts.shape, dtype=torch.bool)
    slots[token] = experts >= 0
    assert_poison_local(clean, poisoned, slots, experts[experts >= 0], ROUTED_GRADS)


@pytest.mark.parametrize("path", list(PATHS))
def test_nan_in_one_experts_weight_stays_with_its_tokens(path):
    problem = random_moe_problem([96], 256, 128, 8, 2, seed=4)
    clean = run(problem, path)
    expert = 5
    w_down = problem.w_down.clone()
    w_down[expert, :, 3] = float("nan")
    poisoned = run(dataclasses.replace(problem, w_down=w_down), path)
    slots = problem.topk_experts == expert
    assert 0 < slots.any(-1).sum() < problem.x.shape[0]
    assert_poison_local(clean, poisoned, slots, torch.tensor([expert]), ("d_w_routed_gate",
                                                                  "d_w_routed_up"))  # fmt: skip
