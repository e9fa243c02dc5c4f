"""The megakernel path of the CUDA backend (stage 2 forward, MEGAKERNEL.md): one op call per pass.

``ops.moe.moe_mega_forward`` runs, from one C++ entry: the routing gather and the device schedule
and plan (row placement, group ends, rounds, m-tiles), staging this rank's tokens, the persistent
megakernel (comm CTAs pull rows into the ring minibatch by minibatch; compute CTAs run L1 +
SwiGLU and L2 tiles as their rows land and store each result row straight into its source's
slot_rows), and the source-side slot-ordered sum (+ the shared expert's output, computed before).

``build_schedule`` on this path is lazy: the schedule's tensors are made by the forward's op;
reading one before the forward builds them (gather, schedule, plan) and the forward then reuses
them. The forward's context is stage 1's ``CudaContext``, so stage 1's backward serves it.
"""

from __future__ import annotations

import torch

from ..schedule import MoKSchedule
from ..types import FusedExpertWeights
from . import stage1
from .experts import ExpertRows, Experts
from .plan import CudaPlan, Rounds

__all__ = ["unsupported_reasons", "wanted", "mega_shape", "build_schedule", "can_run", "forward"]


def unsupported_reasons(device: torch.device | None) -> list[str]:
    """Why the megakernel cannot run on ``device`` (empty when it can)."""
    from mok_megatron.ops import has_op
    from mok_megatron.ops.moe import MEGA_OPS

    from .experts import not_hopper

    reasons = [f"mok_megatron._C lacks {op}" for op in MEGA_OPS if not has_op(op)]
    return reasons + [r for r in (not_hopper(device),) if r]


def unavailable_here() -> str | None:
    """Why the megakernel cannot run on this process's current GPU (None when it can): the
    skip reason of the tests and scripts that need it."""
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    )
    reasons = unsupported_reasons(device)
    return "; ".join(reasons) if reasons else None


def wanted(config, device: torch.device | None) -> bool:
    """Whether a workspace of ``config`` on ``device`` is laid out for the megakernel:
    cuda_forward='megakernel' (which raises at allocation where it cannot run), or 'auto' where
    it can run, for BF16 experts."""
    if config.cuda_forward == "megakernel":
        return True
    if config.expert_precision != "bf16":  # no FP8 mainloop in the megakernel yet: stage 1
        return False
    return config.cuda_forward == "auto" and not unsupported_reasons(device)


def mega_shape(config, row_capacity, num_local_experts, hidden, inter):
    """The megakernel's sizes for this shape and config (from the C++ layout header)."""
    from mok_megatron.ops.moe import moe_mega_shape

    return moe_mega_shape(row_capacity, num_local_experts, hidden, inter, config.minibatch_size,
                          config.macrobatch_size)  # fmt: skip


def can_run(routed) -> bool:
    """The megakernel takes the fused gate/up form (``MoKExperts``' weights)."""
    return isinstance(routed, FusedExpertWeights)


def build_schedule(ws, topk_experts, weights, router_weights) -> MoKSchedule:
    """A schedule whose tensors the forward's op fills (or a first read, through the plan op).
    ``weights``: what the plan gathers (``router_weights`` or zeros when that is None)."""
    sched = MoKSchedule.pending(
        rank=ws.rank, num_ranks=ws.num_ranks, num_tokens=topk_experts.shape[0],
        max_tokens=ws.num_local_tokens, topk=ws.topk, num_local_experts=ws.num_local_experts,
        row_capacity=ws.row_capacity, token_capacity=ws.token_capacity,
        build=lambda s: _plan_now(ws, s),
    )  # fmt: skip
    sched.inputs = (topk_experts.contiguous(), weights)
    if router_weights is not None:
        sched.weights_source = (router_weights, router_weights._version)
    return sched


def _plan_now(ws, sched: MoKSchedule) -> None:
    from mok_megatron.ops import moe as mops

    topk, weights = sched.inputs
    plan = mops.moe_mega_plan(
        topk, weights, ws.buffers.comm, ws.num_experts, ws.row_capacity, ws.token_capacity,
        ws.intermediate_size, ws.config.minibatch_size, ws.config.macrobatch_size,
    )  # fmt: skip
    _fill(ws, sched, plan)


def _fill(ws, sched: MoKSchedule, plan: dict) -> None:
    """The schedule's tensors from the plan op's, and its error flags to the monitor."""
    sched.fill({name: plan[name] for name in MoKSchedule.INTEGER_FIELDS})
    if sched.weights_source is not None:
        sched.global_weights = plan["global_weights"]
    sched.device_plan = plan
    ws.monitor.submit(plan["error_flags"], "mok build_schedule")


def forward(ws, sched: MoKSchedule, x, router_weights, shared, routed, save: bool = True):
    from mok_megatron.ops import moe as mops

    if not sched.is_pending() and not sched.gathered_weights_match(router_weights):
        raise ValueError(
            "the megakernel forward needs the router weights given to build_schedule "
            "(build_schedule(..., router_weights=...), the same tensor, unchanged since)"
        )
    topk, weights = sched.inputs
    if sched.is_pending() and router_weights is not None:
        weights = router_weights.contiguous()
        sched.weights_source = (router_weights, router_weights._version)
    shared_out, shared_gu, shared_a = stage1.shared_forward(x, shared)
    c = ws.config
    keep_y = Experts(routed, c.expert_gemm, x.device).backward_reads_y
    outs, plan = mops.moe_mega_forward(
        x, topk, weights, routed.gate_up, routed.down, shared_out,
        None if sched.is_pending() else sched.device_plan, ws.buffers.comm,
        num_experts=ws.num_experts, row_capacity=ws.row_capacity,
        token_capacity=ws.token_capacity, minibatch=c.minibatch_size,
        macrobatch=c.macrobatch_size, num_comm_sms=c.fwd_num_comm_sms,
        num_sms=ws.buffers.num_sms, save=save, keep_y=keep_y,
        stall_minibatch=ws.buffers.stall_minibatch,
        trace=ws.buffers.trace,
    )  # fmt: skip
    if ws.buffers.trace:
        ws.buffers.last_trace = (outs["trace_ctas"], outs["trace_tasks"])
    if sched.is_pending():
        _fill(ws, sched, plan)
    return outs["out"], _context(ws, sched, plan, outs, save, shared_gu, shared_a)


def _context(ws, sched, plan, outs, save, shared_gu, shared_a) -> stage1.CudaContext:
    """Stage 1's context from the plan and the ring: its backward serves this forward."""
    shape = ws.buffers.mega
    cplan = CudaPlan(plan["row_tok"][: shape.padded_rows], plan["token_rows_padded"],
                     plan["offs"], plan["expert_rows"], plan["prow"])  # fmt: skip
    rounds = Rounds(shape.num_rounds, shape.ring_rows, plan["row_tok"], plan["w_rows"],
                    plan["first_round"])  # fmt: skip
    saved = x_recv = None
    if save and shape.num_rounds == 1:
        y = outs["y_rows"] if outs["y_rows"].shape[0] else None  # not kept: [0, H]
        # not x_ring: the backward dispatches x again and gathers the rows (stage1.CudaContext)
        saved = ExpertRows(None, outs["act_ring"], y, h=outs["h_ring"])
    elif save:
        x_recv = outs["x_recv"]
    return stage1.CudaContext(cplan, rounds, saved, x_recv, shared_gu, shared_a)
