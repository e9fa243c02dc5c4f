"""A rank that stops short of a pass on the reference backend over gloo (issue 17, item 1,
reference half): before the workspace, before the forward, or before the backward, stalling
(sleeping past the others' bound) or exiting (its process ends at once, closing its process
group on the way out). The other ranks fail within
MoKConfig.wait_timeout_ms (bounded here by ERROR_WITHIN_S, well below the stall, also when the
stalled rank is rank 0). Each error names the phase they waited at and the missing rank. No rank
waits for the process group's 30-minute default. A process that got the error then runs a
correct pass on a group of its own (the failure leaves no module state, e.g. caches, that
breaks a later pass; the failed group itself is not reused)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from mok_megatron import functional as F
from mok_megatron.testing import random_moe_problem, run_ranks
from mok_megatron.testing.runs import global_d_out, problem_workspace, run_oracle

TIMEOUT_MS = 1500
#: The most seconds a waiting rank may take to fail: the timeout and a margin for the key-value
#: store's round trips; the stalled rank sleeps STALL_S, longer, so a pass shows the bound.
ERROR_WITHIN_S = 3 * TIMEOUT_MS / 1000
STALL_S = 6 * TIMEOUT_MS / 1000
STEPS = ("workspace", "forward", "backward")
# the phase the waiting ranks report when the stalled rank skips each step (the forward step
# starts with the schedule's routing all-gather)
PHASES = {"workspace": "workspace: config check", "forward": "schedule: routing all-gather",
          "backward": "backward: dispatch"}  # fmt: skip


def _stalling_run(rank, world_size, problem, stalled_rank, stall_at, how="stall"):
    """One pass on every rank; ``stalled_rank`` stops before ``stall_at`` and sleeps past the
    others' timeout (``how="stall"``) or returns at once, ending its process (``"exit"``).
    Returns (error message or None, seconds the failing step took, the largest relative error of
    a later pass that a rank which got the error runs on a group of its own, or None)."""
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
            if how == "stall":
                time.sleep(STALL_S)  # longer than the others may wait: they must give up
            return None, 0.0, None
        start = time.monotonic()
        try:
            steps[step]()
        except RuntimeError as exc:
            return str(exc), time.monotonic() - start, _later_pass_error(rank)
    return None, 0.0, None


def _later_pass_error(rank: int) -> float:
    """A pass after the failure, on a group of this rank alone, against the float64 oracle."""
    solo = dist.new_group([rank], use_local_synchronization=True)
    problem = random_moe_problem([20], 16, 24, 4, 2, seed=5 + rank)
    config = F.MoKConfig(wait_timeout_ms=TIMEOUT_MS)
    ws = F.create_workspace(config, solo, device="cpu", num_local_tokens=20, hidden_size=16,
                            topk=2, num_experts=4, intermediate_size=24, dtype=torch.float64,
                            backend="reference")  # fmt: skip
    x, topk, rw, routed, _ = problem.local(0, dtype=torch.float64)
    sched = F.build_schedule(ws, config, topk, ws.num_local_experts)
    out, _ = F.forward(config, ws, sched, x, rw.double(), None, None, None, *routed)
    want = run_oracle(problem, global_d_out(problem, 0))["out"]
    return float(((out - want).norm() / want.norm()).item())


def _forward(state, config, topk, x, rw, routed):
    ws = state["ws"]
    sched = F.build_schedule(ws, config, topk, ws.num_local_experts)
    out, ctx = F.forward(config, ws, sched, x, rw, None, None, None, *routed)
    return sched, out, ctx


@pytest.mark.parametrize("how", ["stall", "exit"])
@pytest.mark.parametrize("stall_at", STEPS)
def test_a_stalled_rank_fails_the_others_in_bounded_time_naming_the_phase(stall_at, how,
                                                                          record_property):  # fmt: skip
    problem = random_moe_problem([12, 12, 12], 16, 24, 6, 2, seed=1)
    results = run_ranks(_stalling_run, 3, problem, 2, stall_at, how)
    for rank in (0, 1):
        message, seconds, later = results[rank]
        assert message is not None, f"rank {rank} finished a pass without rank 2"
        assert f"waited at '{PHASES[stall_at]}'" in message, message
        assert "wait_timeout_ms=1500" in message, message
        assert "missing rank(s) [2]" in message, message
        assert seconds < ERROR_WITHIN_S, f"rank {rank} waited {seconds:.1f} s"
        assert later < 1e-12, f"rank {rank}'s later pass is off the oracle by {later:.2e}"
    record_property("seconds_to_error", f"{max(r[1] for r in results[:2]):.3f}")


def test_a_stalled_rank_zero_fails_the_others_too(record_property):
    problem = random_moe_problem([10, 10], 16, 24, 4, 2, seed=2)
    message, seconds, later = run_ranks(_stalling_run, 2, problem, 0, "backward")[1]
    assert message is not None and "waited at 'backward: dispatch'" in message, message
    assert "missing rank(s) [0]" in message, message
    assert seconds < ERROR_WITHIN_S, f"rank 1 waited {seconds:.1f} s for the stalled rank 0"
    assert later < 1e-12, later
    record_property("seconds_to_error", f"{seconds:.3f}")
