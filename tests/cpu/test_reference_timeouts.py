"""A rank that stops short of a pass on the reference backend over gloo (issue 17, item 1,
reference half): before the workspace, before the forward, or before the backward. The other
ranks fail within MoKConfig.wait_timeout_ms. Each error names the phase they waited at, and on
rank 0 the missing rank. No rank waits for the process group's 30-minute default."""

from __future__ import annotations

import time

import pytest
import torch

from mok_megatron import functional as F
from mok_megatron.testing import random_moe_problem, run_ranks
from mok_megatron.testing.runs import global_d_out, problem_workspace

TIMEOUT_MS = 1500
STEPS = ("workspace", "forward", "backward")
# the phase the waiting ranks report when the stalled rank skips each step (the forward step
# starts with the schedule's routing all-gather)
PHASES = {"workspace": "workspace: config check", "forward": "schedule: routing all-gather",
          "backward": "backward: dispatch"}  # fmt: skip


def _stalling_run(rank, world_size, problem, stalled_rank, stall_at):
    """One pass on every rank; ``stalled_rank`` stops before ``stall_at`` and sleeps past the
    others' timeout. Returns (error message or None, seconds the failing step took)."""
    config = F.MoKConfig(wait_timeout_ms=TIMEOUT_MS, schedule_capacity_multiplier=float(world_size))
    x, topk, rw, routed, _ = problem.local(rank, dtype=torch.float32)
    d_out = global_d_out(problem, 0)[problem.token_slice(rank)].float().contiguous()

    def workspace():
        return problem_workspace(problem, dtype=torch.float32, config=config)

    state = {}
    steps = {
        "workspace": lambda: state.update(ws=workspace()),
        "forward": lambda: state.update(fwd=_forward(state, config, topk, x, rw, routed)),
        "backward": lambda: F.backward(config, state["ws"], state["fwd"][0], state["fwd"][2],
                                       d_out, x, rw, None, None, None, *routed),
    }  # fmt: skip
    for step in STEPS:
        if rank == stalled_rank and step == stall_at:
            time.sleep(6 * TIMEOUT_MS / 1000)  # longer than the others wait: they must give up
            return None, 0.0
        start = time.monotonic()
        try:
            steps[step]()
        except RuntimeError as exc:
            return str(exc), time.monotonic() - start
    return None, 0.0


def _forward(state, config, topk, x, rw, routed):
    ws = state["ws"]
    sched = F.build_schedule(ws, config, topk, ws.num_local_experts)
    out, ctx = F.forward(config, ws, sched, x, rw, None, None, None, *routed)
    return sched, out, ctx


@pytest.mark.parametrize("stall_at", STEPS)
def test_a_stalled_rank_fails_the_others_in_bounded_time_naming_the_phase(stall_at):
    problem = random_moe_problem([12, 12, 12], 16, 24, 6, 2, seed=1)
    results = run_ranks(_stalling_run, 3, problem, 2, stall_at)
    for rank in (0, 1):
        message, seconds = results[rank]
        assert message is not None, f"rank {rank} finished a pass without rank 2"
        assert f"waited at '{PHASES[stall_at]}'" in message, message
        assert "wait_timeout_ms=1500" in message, message
        assert seconds < 10 * TIMEOUT_MS / 1000, f"rank {rank} waited {seconds:.1f} s"
    assert "2" in results[0][0].split("waited at", 1)[1], results[0][0]  # rank 0 names rank 2


def test_a_stalled_rank_zero_fails_the_others_too():
    problem = random_moe_problem([10, 10], 16, 24, 4, 2, seed=2)
    message, seconds = run_ranks(_stalling_run, 2, problem, 0, "backward")[1]
    assert message is not None and "waited at 'backward: dispatch'" in message, message
    assert seconds < 10 * TIMEOUT_MS / 1000
