"""Expert parallelism on the reference backend: EP = 2 and 4 over spawned gloo ranks give the
single-rank answer for the same global problem, and bad cross-rank setups fail clearly."""

from __future__ import annotations

import pytest
import torch

from mok_megatron import functional as F
from mok_megatron.testing import random_moe_problem, relative_error, run_ranks
from mok_megatron.testing.runs import run_local, run_oracle

PER_TOKEN = ("out", "d_x", "d_router_weights")
ROUTED = ("d_w_routed_gate", "d_w_routed_up", "d_w_routed_down")
SHARED = ("d_w_shared_gate", "d_w_shared_up", "d_w_shared_down")


def _rank_run(rank, world_size, problem, config):
    result = run_local(problem, rank=rank, dtype=torch.float64, config=config)
    result.pop("schedule")
    return result


def _assemble(results: list[dict]) -> dict:
    """Per-rank pieces → the global tensors EP = 1 computes."""
    whole = {name: torch.cat([r[name] for r in results]) for name in PER_TOKEN + ROUTED}
    for name in SHARED:
        parts = [r[name] for r in results]
        whole[name] = None if parts[0] is None else sum(parts[1:], parts[0])
    return whole


@pytest.mark.parametrize(
    "world_size,tokens,routing,empty,shared_inter,topk",
    [
        (2, [40, 23], "uniform", 0.0, 16, 2),
        (2, [31, 0], "skewed", 0.2, 0, 4),  # a rank with no tokens
        (4, [17, 30, 0, 9], "skewed", 0.1, 8, 2),
        (4, [12, 12, 12, 12], "one_expert", 0.0, 0, 1),  # all tokens to expert 0
        (8, [9, 0, 14, 5, 11, 3, 8, 6], "skewed", 0.1, 8, 2),  # EP 8, as on an 8-GPU node
    ],
)
def test_expert_parallel_equals_single_rank(world_size, tokens, routing, empty, shared_inter, topk):
    problem = random_moe_problem(tokens, 16, 24, 8, topk, shared_inter=shared_inter,
                                 routing=routing, empty_slot_fraction=empty)  # fmt: skip
    config = F.MoKConfig(schedule_capacity_multiplier=float(world_size))  # never overflows
    ep = _assemble(run_ranks(_rank_run, world_size, problem, config))
    single = random_moe_problem_as_one_rank(problem)
    one = run_local(single, rank=0, dtype=torch.float64, config=config)
    oracle = run_oracle(problem, one["d_out"])
    for name in PER_TOKEN + ROUTED + SHARED:
        if one[name] is None:
            assert ep[name] is None
            continue
        assert torch.allclose(ep[name], one[name], rtol=1e-12, atol=1e-12), name
        assert relative_error(ep[name], oracle[name]) < 1e-12, name


def random_moe_problem_as_one_rank(problem):
    """The same global problem, all tokens and experts on one rank."""
    from dataclasses import replace

    return replace(problem, tokens_per_rank=[sum(problem.tokens_per_rank)])


def _overflow_run(rank, world_size, problem, config):
    try:
        run_local(problem, rank=rank, dtype=torch.float32, config=config)
    except F.MoKCapacityError as exc:
        return str(exc)
    return None


def test_capacity_overflow_raises_on_every_rank_naming_the_knob():
    problem = random_moe_problem([200, 200], 8, 8, 4, 1, routing="one_expert")  # 400 rows > 256
    messages = run_ranks(_overflow_run, 2, problem, F.MoKConfig(schedule_capacity_multiplier=1.0))
    for message in messages:
        assert message is not None and "schedule_capacity_multiplier" in message


def _mismatch_run(rank, world_size):
    config = F.MoKConfig(minibatch_size=128 * (rank + 1), macrobatch_size=1024)
    try:
        F.create_workspace(config, None, device="cpu", num_local_tokens=8, hidden_size=8, topk=1,
                           num_experts=2, intermediate_size=8, dtype=torch.float32,
                           backend="reference")  # fmt: skip
    except ValueError as exc:
        return str(exc)
    return None


def test_configs_that_differ_across_ranks_are_rejected():
    for message in run_ranks(_mismatch_run, 2):
        assert message is not None and "differs across the ranks" in message
