"""Capacity and skew on the reference backend (issue 17, item 5, reference half): routing swept
from uniform to every token on one expert, at the default knobs, over EP 4 gloo ranks. Each
point either runs, and then every token's output and every gradient is the float64 oracle's (no
row dropped), or raises MoKCapacityError on every rank naming the knob; never anything else.
Both outcomes occur in the sweep."""

from __future__ import annotations

import dataclasses

import torch

from mok_megatron import functional as F
from mok_megatron.testing import random_moe_problem, relative_error, run_ranks
from mok_megatron.testing.runs import run_local, run_oracle

NAMES = ("out", "d_x", "d_router_weights")
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)  # of the tokens sent to expert 0
TOKENS = 100


def _rank_run(rank, world_size, problem):
    try:
        result = run_local(problem, rank=rank, dtype=torch.float64, config=F.MoKConfig())
    except F.MoKCapacityError as exc:
        return {"capacity_error": str(exc)}
    result.pop("schedule")
    return result


def _skewed(fraction: float, seed: int):
    """TOKENS per rank on 4 ranks, 8 experts, top-1; the first ``fraction`` of each rank's
    tokens sent to expert 0. At the default schedule_capacity_multiplier (2.0) a rank holds twice
    a balanced load (rounded up to the 128-row tile: 256 rows here), so all 400 tokens on one
    expert must overflow."""
    problem = random_moe_problem([TOKENS] * 4, 16, 24, 8, 1, seed=seed)
    topk = problem.topk_experts.clone()
    for start in range(0, topk.shape[0], TOKENS):
        topk[start : start + int(round(fraction * TOKENS)), 0] = 0
    return dataclasses.replace(problem, topk_experts=topk)


def test_skew_sweep_runs_exactly_or_raises_naming_the_knob():
    outcomes = []
    for i, fraction in enumerate(FRACTIONS):
        problem = _skewed(fraction, seed=i)
        results = run_ranks(_rank_run, 4, problem)
        errors = [r.get("capacity_error") for r in results]
        if any(errors):
            assert all(e and "schedule_capacity_multiplier" in e for e in errors), errors
            outcomes.append("raised")
            continue
        d_out = torch.cat([r["d_out"] for r in results]).double()
        oracle = run_oracle(problem, d_out)
        for name in NAMES:
            got = torch.cat([r[name] for r in results])
            assert relative_error(got, oracle[name]) < 1e-12, (fraction, name)
            per_token = (got - oracle[name]).abs().amax(-1)
            assert (per_token <= 1e-9 * oracle[name].abs().amax().clamp(min=1)).all(), name
        outcomes.append("ran")
    assert outcomes[0] == "ran" and outcomes[-1] == "raised", outcomes
