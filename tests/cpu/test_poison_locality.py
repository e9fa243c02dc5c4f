"""Poisoned input stays local on the reference backend (issue 17, item 2): a NaN in one token's
x makes exactly the outputs and gradients that depend on that token non-finite (its out, d_x
and router-weight gradient rows, the weight gradients of the experts it visits and of the shared
expert) and leaves every other one bitwise equal to the clean run; NaNs in one expert's W_down
(one input column) do the same for the tokens routed to that expert. EP 1, and EP 2 over spawned gloo ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mok_megatron import functional as F
from mok_megatron.testing import random_moe_problem, run_ranks
from mok_megatron.testing.locality import ROUTED_GRADS, assert_poison_local
from mok_megatron.testing.runs import run_local

PER_TOKEN = ("out", "d_x", "d_router_weights")

SHARED = ("d_w_shared_gate", "d_w_shared_up", "d_w_shared_down")
CONFIG = F.MoKConfig(schedule_capacity_multiplier=2.0)


def _rank_run(rank, world_size, problem):
    result = run_local(problem, rank=rank, dtype=torch.float32, config=CONFIG)
    result.pop("schedule")
    return result


def _run(problem) -> dict:
    """Every rank's per-token rows in global order, routed gradients per global expert, the
    shared gradients summed over ranks."""
    world = len(problem.tokens_per_rank)
    results = run_ranks(_rank_run, world, problem) if world > 1 else [_rank_run(0, 1, problem)]
    whole = {n: torch.cat([r[n] for r in results]) for n in PER_TOKEN + ROUTED_GRADS}
    for n in SHARED:  # None without a shared expert
        parts = [r[n] for r in results]
        whole[n] = None if parts[0] is None else sum(parts[1:], parts[0])
    return whole


@pytest.mark.parametrize("tokens_per_rank", [[48], [20, 17]], ids=["ep1", "ep2"])
def test_nan_in_one_token_stays_with_that_token(tokens_per_rank):
    problem = random_moe_problem(tokens_per_rank, 32, 24, 8, 2, shared_inter=16, seed=3)
    clean = _run(problem)
    token = sum(tokens_per_rank) - 3  # on the last rank
    x = problem.x.clone()
    x[token, 5] = float("nan")
    poisoned = _run(dataclasses.replace(problem, x=x))
    experts = problem.topk_experts[token]
    slots = torch.zeros(problem.topk_experts.shape, dtype=torch.bool)
    slots[token] = experts >= 0
    assert_poison_local(clean, poisoned, slots, experts[experts >= 0], ROUTED_GRADS)
    for name in SHARED:  # the shared expert saw the token
        assert not torch.isfinite(poisoned[name]).all(), name


@pytest.mark.parametrize("tokens_per_rank", [[48], [20, 17]], ids=["ep1", "ep2"])
def test_nan_in_one_experts_weight_stays_with_its_tokens(tokens_per_rank):
    problem = random_moe_problem(tokens_per_rank, 32, 24, 8, 2, seed=4)
    clean = _run(problem)
    expert = 5
    w_down = problem.w_down.clone()
    w_down[expert, :, 3] = float("nan")  # one input column: every output of the expert reads it
    poisoned = _run(dataclasses.replace(problem, w_down=w_down))
    slots = problem.topk_experts == expert
    assert 0 < slots.any(-1).sum() < problem.x.shape[0]
    # W_down's own gradient (dy^T a) does not read W_down: only the L1 gradients see the NaN
    assert_poison_local(clean, poisoned, slots, torch.tensor([expert]), ("d_w_routed_gate",
                                                                   "d_w_routed_up"))  # fmt: skip
