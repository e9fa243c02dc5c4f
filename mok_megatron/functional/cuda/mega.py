"""The megakernel path of the CUDA backend (stage 2 forward, MEGAKERNEL.md): one op call per pass.

``ops.moe.moe_mega_forward`` runs, from one C++ entry: the routing gather and the device schedule
and plan (row placement, group ends, rounds, m-tiles), staging this rank's tokens, the persistent
megakernel (comm CTAs pull rows into the ring minibatch by minibatch; compute CTAs run L1 +
SwiGLU and L2 tiles as their rows land and store each result row straight into its source's
slot_rows), and the source-side slot-ordered sum (+ the shared expert's output, computed before).

``build_schedule`` on this path is lazy: the schedule's tensors are made by the forward's op;
reading one before the forward builds them (gather, schedule, plan) and the forward then reuses
them. The forward's context is stage 1's ``CudaContext`` with the plan added.

The backward (``backward_steps``, where ``runs_backward``: MoKConfig.cuda_backward):
``ops.moe.moe_mega_backward`` runs the data gradients from one C++ entry (staging d_out; the
backward megakernel: comm CTAs pull d_out rows into the ring, compute CTAs run L2-dgrad tiles with
the SwiGLU backward and the router-weight gradient's partial sums in their epilogue, then L1-dgrad
tiles whose rows go straight into their sources' slots; the unweighted slot sum with the shared
expert's d_x; the rows' router-weight gradients), then the weight gradients run as stage 1's
grouped GEMMs from the rows it returns, in stage 1's two autograd steps; with
MoKConfig.bwd_wgrad="down" (or "down_interleaved") the down weight's is computed inside the launch
instead, as tasks after (or among) the data gradients' (one round).

A forward of several macrobatch rounds keeps the received tokens and its act and h rings, which
end holding the last round with rows. Its backward (``_backward_rounds``) takes the rounds last
first, one backward megakernel launch each: the kept round as it is, every earlier one recomputed
into the rings by the L1 GEMM (``Experts.l1_into``) from the received tokens (MEGAKERNEL.md's
reversed-macrobatch order: the rows the forward ended with need no recompute); the weight
gradients add up in that order, and the last call (round 0) sums the slots every call filled.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mok_megatron.ops import moe as mops

from ..schedule import MoKSchedule
from ..types import FusedExpertWeights, MoKGradients
from . import experts as cuda_experts
from . import stage1
from .experts import ExpertRows, Experts
from .plan import CudaPlan, Rounds, window_offs

__all__ = ["unsupported_reasons", "wanted", "mega_shape", "build_schedule", "rows_in_place",
           "can_run", "forward",
           "backward_unavailable", "runs_backward", "backward_steps"]  # fmt: skip


def unsupported_reasons(device: torch.device | None) -> list[str]:
    """Why the megakernel cannot run on ``device`` (empty when it can)."""
    from mok_megatron.ops import has_op

    reasons = [f"mok_megatron._C lacks {op}" for op in mops.MEGA_OPS if not has_op(op)]
    return reasons + [r for r in (cuda_experts.not_hopper(device),) if r]


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
    it can run, for BF16 experts (FP8 experts run the FP8 megakernel when asked for by name)."""
    if config.cuda_forward == "megakernel":
        return True
    if config.expert_precision != "bf16":  # 'auto': stage 1 for FP8
        return False
    return config.cuda_forward == "auto" and not unsupported_reasons(device)


def mega_shape(config, row_capacity, num_local_experts, hidden, inter):
    """The megakernel's sizes for this shape and config (from the C++ layout header)."""
    return mops.moe_mega_shape(row_capacity, num_local_experts, hidden, inter,
                               config.minibatch_size, config.macrobatch_size)  # fmt: skip


#: Rows in place address each token row by a 32-bit element offset (token * hidden elements,
#: gemm::RowCopies::Rows); the megakernel's host check refuses more (launch/moe_megakernel.cu).
ROWS_IN_PLACE_MAX_ELEMENTS = 2**32 - 1


def rows_in_place(ws, save: bool = False) -> bool:
    """Whether the forward megakernel's L1 tiles read their rows in place (MoKConfig.fwd_rows):
    'auto' where it can run (one rank, no clusters, the workspace's token rows within the 32-bit
    offsets the loaders hold; FP8 experts also not in a forward of several macrobatch rounds that
    keeps its tokens for the backward, ``save``: those are staged), 'in_place' there or an error,
    'pull' never."""
    c = ws.config
    choice = c.fwd_rows
    if choice == "pull":
        return False
    elements = ws.num_local_tokens * ws.hidden_size
    fits = elements <= ROWS_IN_PLACE_MAX_ELEMENTS
    can = ws.num_ranks == 1 and c.megakernel_cluster == 1
    staged = c.expert_precision != "bf16" and save and ws.buffers.mega.num_rounds > 1
    if choice == "in_place" and not (can and fits and not staged):
        if not can:
            why = (f"rows in place need one rank (this workspace has {ws.num_ranks}) and "
                   "megakernel_cluster=1: at several ranks the rows come from peers and are "
                   "pulled")  # fmt: skip
        elif not fits:
            why = (f"the workspace's {ws.num_local_tokens} token rows of hidden="
                   f"{ws.hidden_size} are {elements} elements, more than the loaders' 32-bit "
                   f"row offsets reach ({ROWS_IN_PLACE_MAX_ELEMENTS})")  # fmt: skip
        else:
            why = ("FP8 rows in place read x quantised in place, and a forward of several "
                   "macrobatch rounds that keeps its tokens for the backward stages them (raise "
                   "macrobatch_size)")  # fmt: skip
        raise ValueError(f"MoKConfig.fwd_rows='in_place' cannot run: {why}; set "
                         "fwd_rows='auto' or 'pull'")  # fmt: skip
    return can and fits and not staged


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
    topk, weights = sched.inputs
    plan = mops.moe_mega_plan(
        topk, weights, ws.buffers.comm, ws.num_experts, ws.row_capacity, ws.token_capacity,
        ws.intermediate_size, ws.config.minibatch_size, ws.config.macrobatch_size,
    )  # fmt: skip
    _fill(ws, sched, plan)


def _fill(ws, sched: MoKSchedule, plan: dict) -> None:
    """The schedule's tensors from the plan op's, and its error flags to the monitor."""
    sched.fill(plan)  # its INTEGER_FIELDS
    if sched.weights_source is not None:
        sched.global_weights = plan["global_weights"]
    sched.device_plan = plan
    ws.monitor.submit(plan["error_flags"], "mok build_schedule")


def forward(ws, sched: MoKSchedule, x, router_weights, shared, routed, save: bool = True):
    pending = sched.is_pending()  # until _fill below (nothing between reads its tensors)
    if not pending and not sched.gathered_weights_match(router_weights):
        raise ValueError(
            "the megakernel forward needs the router weights given to build_schedule "
            "(build_schedule(..., router_weights=...), the same tensor, unchanged since)"
        )
    topk, weights = sched.inputs
    if pending and router_weights is not None:
        weights = router_weights.contiguous()
        sched.weights_source = (router_weights, router_weights._version)
    shared_out, shared_gu, shared_a = stage1.shared_forward(x, shared)
    c = ws.config
    fp8 = c.expert_precision == "fp8_blockwise"
    # y: only for stage 1's backward where it reads y (FP8's always: backward_unavailable); the
    # backward megakernel never does. NOTE: Experts checks FP8 weights (check_fp8_experts).
    keep_y = Experts(routed, c.expert_gemm, x.device, precision=c.expert_precision).backward_reads_y
    rounds = ws.buffers.mega.num_rounds > 1
    keep_y = keep_y and (fp8 or c.cuda_backward == "stage1" or rounds)
    # in rounds, the act and h rings for the backward megakernel (not read by stage 1's)
    keep_rings = save and rounds and not fp8 and c.cuda_backward != "stage1"
    w_gate_up, w_down, scales = routed.gate_up, routed.down, {}
    if fp8:  # the FP8 megakernel, on the weights' FP8 copies
        from ..fp8_weights import fp8_weight

        gu, dn = fp8_weight(routed.gate_up), fp8_weight(routed.down)
        w_gate_up, w_down = gu.data, dn.data
        scales = {"w_gate_up_scales": gu.scales, "w_down_scales": dn.scales}
    outs, plan = mops.moe_mega_forward(
        x, topk, weights, w_gate_up, w_down, shared_out,
        None if pending else sched.device_plan, ws.buffers.comm,
        num_experts=ws.num_experts, row_capacity=ws.row_capacity,
        token_capacity=ws.token_capacity, minibatch=c.minibatch_size,
        macrobatch=c.macrobatch_size, num_comm_sms=c.fwd_num_comm_sms,
        num_sms=ws.buffers.num_sms, save=save, keep_y=keep_y,
        stall_minibatch=ws.buffers.stall_minibatch, stall_l2_cta=ws.buffers.stall_l2_cta,
        trace=ws.buffers.trace, cluster=c.megakernel_cluster,
        rows_in_place=rows_in_place(ws, save), keep_rings=keep_rings,
        order_block=0 if c.megakernel_order_block == "auto" else c.megakernel_order_block,
        **scales,
    )  # fmt: skip
    if ws.buffers.trace:
        ws.buffers.last_trace = (outs["trace_ctas"], outs["trace_tasks"])
        ws.buffers.last_tiles = plan["tiles"]
    if pending:
        _fill(ws, sched, plan)
    return outs["out"], _context(ws, sched, plan, outs, save, shared_gu, shared_a)


def _context(ws, sched, plan, outs, save, shared_gu, shared_a) -> stage1.CudaContext:
    """Stage 1's context from the plan and the ring: its backward serves this forward."""
    shape = ws.buffers.mega
    cplan = CudaPlan(plan["row_tok"][: shape.padded_rows], plan["token_rows_padded"],
                     plan["offs"], plan["expert_rows"], plan["prow"])  # fmt: skip
    rounds = Rounds(shape.num_rounds, shape.ring_rows, plan["row_tok"], plan["w_rows"],
                    plan["first_round"])  # fmt: skip
    saved = x_recv = kept = None
    if save and shape.num_rounds == 1:
        y = outs["y_rows"] if outs["y_rows"].shape[0] else None  # not kept: [0, H]
        # not x_ring: the backward gathers x's rows again (_routed_rows), for the peak memory
        saved = ExpertRows(None, outs["act_ring"], y, h=outs["h_ring"])
    elif save:
        x_recv = outs["x_recv"]
        if outs["h_ring"].shape[0]:  # keep_rings
            kept = ExpertRows(None, outs["act_ring"], None, h=outs["h_ring"])
    return stage1.CudaContext(cplan, rounds, saved, x_recv, shared_gu, shared_a, mega_plan=plan,
                              kept=kept)  # fmt: skip


def backward_unavailable(ws, ctx: stage1.CudaContext, routed) -> str | None:
    """Why the backward megakernel cannot take this context (None when it can)."""
    if ctx.mega_plan is None:
        return "the forward was stage 1's (the backward megakernel reads the megakernel's plan)"
    if ws.config.expert_precision == "fp8_blockwise":
        return ("FP8 experts: their backward is stage 1's (the router-weight gradient reads the "
                "FP8 forward's y, the backward megakernel recomputes it from act in BF16)")  # fmt: skip
    act = ctx.saved if ctx.saved is not None else ctx.kept
    if act is None:
        return ("the forward ran in macrobatch rounds (more routed rows than macrobatch_size) "
                "and kept the received tokens only: its act and h rings are kept for the backward "
                "megakernel where the forward is bf16 and cuda_backward is not 'stage1'")  # fmt: skip
    if act.h is None or act.a is None:
        return "the forward did not keep its activation rings"
    if not can_run(routed) or routed.gate_up.dtype != torch.bfloat16:
        return "the backward megakernel takes the bf16 fused gate/up weights of MoKExperts"
    return None


def runs_backward(ws, ctx: stage1.CudaContext, routed) -> bool:
    """Whether this backward runs the backward megakernel (MoKConfig.cuda_backward): 'auto'
    where it can, 'megakernel' or an error naming why not, 'stage1' never."""
    choice = ws.config.cuda_backward
    if choice == "stage1":
        return False
    reason = backward_unavailable(ws, ctx, routed)
    if reason is not None and choice == "megakernel":
        raise ValueError(f"MoKConfig.cuda_backward='megakernel' cannot run: {reason}; use "
                         "cuda_backward='auto' (stage 1 where the megakernel cannot run)")  # fmt: skip
    return reason is None


def _routed_rows(ws, sched: MoKSchedule, ctx: stage1.CudaContext, x, window: slice, row_tok):
    """The routed rows of x in the ring's row order (zero rows for padding), for the gate/up
    weight gradient. Several ranks: x dispatched again (the forward dropped its x ring, to keep
    its peak memory), then gathered by each row's received token. One rank: gathered from x
    itself by the plan's row_src (the row's source token s * T_max + t, with s = 0), with no
    dispatch: its staging copy and pull were 0.2 ms of deepseek-v3's 8192-token backward
    (profile_moe at edf94f1), and they give the same rows."""
    if ws.num_ranks == 1:
        return mops.moe_gather_rows(x.contiguous(), ctx.mega_plan["row_src"][window])
    received = mops.moe_dispatch(x, sched.recv_token_src, ws.buffers.comm)
    return mops.moe_gather_rows(received, row_tok)


def backward_steps(ws, sched: MoKSchedule, ctx: stage1.CudaContext, d_out, x, router_weights,
                   shared, routed, wgrad_acc, consume: bool):  # fmt: skip
    """``stage1.backward_steps``' two steps with the data gradients from the backward
    megakernel: step 1 runs it (and the shared expert's backward, whose d_x its slot sum adds)
    and the down weight's gradient from its d_rows; step 2 the gate/up weight gradient from its
    d_h and x dispatched again (as stage 1). Several macrobatch rounds: ``_backward_rounds``."""
    if ctx.saved is None:
        yield from _backward_rounds(ws, sched, ctx, d_out, x, router_weights, shared, routed,
                                    wgrad_acc, consume)  # fmt: skip
        return
    comm, plan, rounds, c = ws.buffers.comm, ctx.plan, ctx.rounds, ws.config
    act = replace(ctx.saved)  # our own references, dropped after each one's last use
    if consume:
        ctx.saved = None
    experts = Experts(routed, c.expert_gemm, x.device, accumulate=wgrad_acc is not None)
    acc_w = stage1._accumulator_slots(wgrad_acc)
    window = rounds.window(0)
    offs = window_offs(plan, window)
    row_tok, w_rows = rounds.row_tok[window], rounds.w_rows[window]

    # step 1: the data gradients, the router weights' and the down weight's gradients
    d_shared, shared_dx = (None, None, None), None
    if shared is not None:
        d_shared, shared_dx = stage1._shared_backward(d_out, x, ctx, shared)
    # MoKConfig.bwd_wgrad="down": the down weight's gradient inside the launch, into the caller's
    # buffer (added) or a fresh one (stored)
    wgrad_down = None
    if c.bwd_wgrad != "off":
        wgrad_down = acc_w[2] if acc_w is not None else torch.empty_like(routed.down)
    outs = mops.moe_mega_backward(
        d_out.contiguous(), sched.inputs[0], ctx.mega_plan, act.a, act.h, routed.gate_up,
        routed.down, shared_dx, comm, num_experts=ws.num_experts, row_capacity=ws.row_capacity,
        minibatch=c.minibatch_size, macrobatch=c.macrobatch_size,
        num_comm_sms=c.bwd_num_comm_sms, num_sms=ws.buffers.num_sms,
        stall_minibatch=ws.buffers.stall_minibatch, trace=ws.buffers.trace,
        cluster=c.megakernel_cluster, wgrad_down=wgrad_down, wgrad_accumulate=acc_w is not None,
        wgrad_interleave=c.bwd_wgrad == "down_interleaved",
    )  # fmt: skip
    if ws.buffers.trace:
        ws.buffers.last_backward_trace = (outs["trace_ctas"], outs["trace_tasks"])
    del shared_dx
    act.h = act.y = None
    d_x, d_h = outs["d_x"], outs["d_h"]
    d_rw = mops.moe_combine_slots(
        outs["d_row_w"], plan.token_rows, sched.recv_token_src, sched.send_to, sched.num_tokens,
        comm,
    )  # fmt: skip
    down_rows = []
    if wgrad_down is None:
        down_rows.append((outs["d_rows"], cuda_experts.weighted_rows(act.a, w_rows, row_tok)))
    del outs
    act = None
    if wgrad_down is not None:  # the launch's: into acc_w[2] (None to yield), or fresh
        yield None if acc_w is not None else wgrad_down
    else:  # NOTE: yielded unnamed, its operands popped (as stage 1's step 1)
        yield stage1._weight_grad(experts, *down_rows.pop(), offs, rounds, acc_w, 2)

    # step 2: the gate/up weight gradient from d_h and the routed rows of x (_routed_rows)
    x_rows = _routed_rows(ws, sched, ctx, x, window, row_tok)
    d_w = [None, None, None]
    for slot, d in zip(experts.grad_slots, (d_h,)):
        d_w[slot] = stage1._weight_grad(experts, d, x_rows, offs, rounds, acc_w, slot)
    del x_rows, d_h
    yield MoKGradients(
        d_x=d_x, d_router_weights=d_rw.to(router_weights.dtype),
        d_w_routed_gate=d_w[0], d_w_routed_up=d_w[1], d_w_routed_down=None,
        d_w_shared_gate=d_shared[0], d_w_shared_up=d_shared[1], d_w_shared_down=d_shared[2],
    )  # fmt: skip


def _backward_rounds(ws, sched: MoKSchedule, ctx: stage1.CudaContext, d_out, x, router_weights,
                     shared, routed, wgrad_acc, consume: bool):  # fmt: skip
    """The backward of a forward in R > 1 macrobatch rounds, one backward megakernel launch per
    round, the last round first (as ``backward_steps``' two steps; the first does all the work,
    as in stage 1's rounds).

    The forward's act and h rings (``ctx.kept``) end holding the last round with rows, so that
    round runs on them as they are; before each earlier round its act and h are recomputed into
    them from the received tokens (``Experts.l1_into``). Which round the rings hold is known on
    the device only, so every round's recompute is enqueued, the held one's with its group ends
    zeroed (no rows: nothing is written). The weight gradients add up round after round in that
    order (``Rounds.last_first``); the last call, round 0's, sums the slots every call filled
    into d_x. ``consume`` False (the context may serve another backward): the recompute goes
    into copies of the rings, and the context keeps them as the forward left them."""
    comm, plan, rounds, c = ws.buffers.comm, ctx.plan, ctx.rounds, ws.config
    rings = ctx.kept
    if consume:
        ctx.kept = None
    else:
        rings = ExpertRows(None, rings.a.clone(), None, h=rings.h.clone())
    # accumulate: the weight gradients add up over the rounds (stage1._weight_grad)
    experts = Experts(routed, c.expert_gemm, x.device, accumulate=True)
    acc_w = stage1._accumulator_slots(wgrad_acc)
    d_shared, shared_dx = (None, None, None), None
    if shared is not None:
        d_shared, shared_dx = stage1._shared_backward(d_out, x, ctx, shared)
    visits, held = rounds.last_first(plan)
    d_row_w = torch.empty(rounds.row_tok.shape[0], dtype=torch.float32, device=x.device)
    d_w = [None, None, None]  # gate_up (the fused form's slot 0), -, down
    d_out, d_x, traces = d_out.contiguous(), None, []
    for visit, r in enumerate(reversed(range(rounds.count))):
        window = rounds.window(r)
        offs = window_offs(plan, window)
        row_tok, w_rows = rounds.row_tok[window], rounds.w_rows[window]
        x_rows = mops.moe_gather_rows(ctx.x_recv, row_tok)
        recompute = torch.where(held == r, torch.zeros_like(offs), offs)  # the held round: none
        experts.l1_into(x_rows, recompute, rings.a, rings.h)
        outs = mops.moe_mega_backward(
            d_out, sched.inputs[0], ctx.mega_plan, rings.a, rings.h, routed.gate_up, routed.down,
            shared_dx, comm, num_experts=ws.num_experts, row_capacity=ws.row_capacity,
            minibatch=c.minibatch_size, macrobatch=c.macrobatch_size,
            num_comm_sms=c.bwd_num_comm_sms, num_sms=ws.buffers.num_sms,
            stall_minibatch=ws.buffers.stall_minibatch, trace=ws.buffers.trace,
            cluster=c.megakernel_cluster, round=r,
        )  # fmt: skip
        if ws.buffers.trace:  # each round's launch: its CTAs, and its round of the tasks
            traces.insert(0, (outs["trace_ctas"], outs["trace_tasks"][r]))
        d_row_w[window] = outs["d_row_w"]
        parts = ((outs["d_h"], x_rows),
                 (outs["d_rows"], cuda_experts.weighted_rows(rings.a, w_rows, row_tok)))  # fmt: skip
        for slot, (rows_t, rows) in zip(experts.grad_slots, parts):  # (or into acc_w, in order)
            d_w[slot] = stage1._weight_grad(experts, rows_t, rows, offs, visits, acc_w, slot,
                                            d_w[slot], visit)  # fmt: skip
        del parts, x_rows
        if r == 0:
            d_x = outs["d_x"]
        del outs
    del rings, shared_dx
    if traces:  # per round, in round order: ([R, CTAs, words], [R, tasks, words])
        ws.buffers.last_backward_trace = tuple(torch.stack(t) for t in zip(*traces))
    d_rw = mops.moe_combine_slots(
        d_row_w, plan.token_rows, sched.recv_token_src, sched.send_to, sched.num_tokens, comm
    )
    yield d_w.pop()  # the down gradient, out of this frame once autograd has it
    yield MoKGradients(
        d_x=d_x, d_router_weights=d_rw.to(router_weights.dtype),
        d_w_routed_gate=d_w[0], d_w_routed_up=None, d_w_routed_down=None,
        d_w_shared_gate=d_shared[0], d_w_shared_up=d_shared[1], d_w_shared_down=d_shared[2],
    )  # fmt: skip
