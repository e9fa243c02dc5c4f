"""Stage 1 of the CUDA backend: the MoE pass as a sequence of sync-free kernels driven from
Python (DESIGN.md, "Kernel roadmap"), kept as the tested fallback and the oracle of the
megakernel.

  dispatch   each token pulled once per destination rank into received-token order
             (``moe_dispatch``), then gathered (``moe_gather_rows``) into the padded row layout
             (``plan.padded_plan``: each local expert's rows start at a multiple of 8)
  experts    ``experts.Experts``: the expert GEMM engine or ``torch._grouped_mm``
  combine    per received token, a slot-ordered float32 sum on the expert side, one row per
             (token, rank) pushed to the source, a rank-ordered float32 sum there (+ shared)
  backward   the same moves in reverse; the per-row router-weight gradient and weighted d_out
             in one kernel (``moe_row_grad``): <d_rows, y>, or, where the forward did not
             keep y (``Experts.backward_reads_y``), <d_rows @ W_down, a>; weight gradients
             are grouped GEMMs that reduce over each expert's rows in one fixed order (no
             atomics), experts without rows
             zeroed by ``moe_accumulate_groups``; or, given accumulators (gradient-accumulation
             fusion), each weight-gradient GEMM adds into the caller's fp32 buffer in its
             epilogue (``Experts.mm_tn_accumulate``), round after round
  steps      ``backward_steps``: the backward as two steps for autograd (functional.moe's two
             nodes): the down projection's side first, whose weight gradient autograd adds and
             drops before the second step makes gate/up's; each kept activation is let go
             after its last read
  rounds     more rows than ``macrobatch_size``: the padded rows run in fixed-size windows; each
             round adds its rows to a float32 per-token accumulator and the last pushes; the
             forward then keeps only the received tokens and the backward recomputes each
             round's gate/up and SwiGLU (not the down projection, but for FP8 experts, whose
             router-weight gradient reads the FP8 GEMM's y)
  saved      one round keeps its activations but not all of them: y only where the backward
             reads it (``Experts.backward_reads_y``), and not the routed rows x_rows: the
             backward dispatches x (which autograd keeps) again and gathers them before the
             gate/up weight gradient, their one read

The backward also serves the megakernel's forward: its context has the same fields (and the
forward's plan, with which the backward megakernel runs instead where MoKConfig.cuda_backward
lets it: ``mega.runs_backward``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mok_megatron.ops import moe as mops

from .experts import ExpertRows, Experts, accumulate, grouped_mm, weighted_rows
from .plan import CudaPlan, Rounds, make_rounds, padded_plan, round_accumulator, window_offs

__all__ = ["CudaContext", "forward", "backward", "backward_steps", "shared_forward",
           "slot_weights_of"]  # fmt: skip


@dataclass
class CudaContext:
    """What the forward keeps for its backward.

    One round: ``saved`` holds its activations but x_rows (None: the backward dispatches x again
    and gathers them). More rounds: ``saved`` is None, ``x_recv`` [C_tok, H] holds the
    received tokens and the backward recomputes each round; after the megakernel's forward,
    ``kept`` holds its act and h rings (None elsewhere), which end holding the last round that
    has rows: the backward megakernel takes the rounds last first and recomputes all but that
    one (``mega.backward_steps``). shared_gu / shared_a: [T, 2I_s] / [T, I_s] or None.
    """

    plan: CudaPlan
    rounds: Rounds
    saved: ExpertRows | None
    x_recv: torch.Tensor | None
    shared_gu: torch.Tensor | None
    shared_a: torch.Tensor | None
    mega_plan: dict | None = None  # the megakernel forward's plan (``moe_mega_plan``'s), or None
    kept: ExpertRows | None = None  # more rounds, the megakernel's forward: its act and h rings


def slot_weights_of(ws, sched, router_weights: torch.Tensor) -> torch.Tensor:
    """[W, T_max, K] float32: every rank's router weights. The ones ``build_schedule`` gathered
    with the routing when they are these weights (same tensor, unchanged since); otherwise they
    are gathered now (a second routing gather: pass router_weights to build_schedule)."""
    if sched.gathered_weights_match(router_weights):
        return sched.global_weights
    mine = sched.global_topk[ws.rank, : sched.num_tokens].contiguous()
    return mops.moe_gather_routing(mine, router_weights.contiguous(), ws.buffers.comm)[1]


# NOTE: the shared expert's GEMMs are torch._grouped_mm with one group, not cuBLAS (torch's
# matmul): cuBLAS loads its kernel libraries on their first use, which waits for the device, and
# inside a pass the device may be waiting for another rank (virtual ranks share one context).
# torch._grouped_mm wants 16-byte row strides: other widths take torch's matmul.
def _fits(*dims: int) -> bool:
    return all(d % 8 == 0 for d in dims)


def _one_group(rows: int, device: torch.device) -> torch.Tensor:
    return torch.full((1,), rows, dtype=torch.int32, device=device)  # a fill: no host sync


def _rows_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] → [M, N]."""
    if a.shape[0] == 0 or not _fits(a.shape[1], b.shape[1]):
        return a @ b  # no rows (no kernel runs) or a width _grouped_mm does not take
    return grouped_mm(a, b.unsqueeze(0), _one_group(a.shape[0], a.device))


def _grad_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, P]^T @ b [M, Q] → [P, Q] (a weight gradient, reduced over the rows)."""
    if a.shape[0] == 0 or not _fits(a.shape[1], b.shape[1]):
        return a.T @ b  # no rows (zeros, no GEMM runs) or a width _grouped_mm does not take
    return grouped_mm(a.T, b, _one_group(a.shape[0], a.device))[0]


def shared_forward(x, shared):
    """The shared expert on the local tokens: (out [T, H], gu [T, 2I_s], a [T, I_s]), or Nones."""
    if shared is None:
        return None, None, None
    gu = _rows_mm(x, torch.cat([shared.gate, shared.up], dim=0).T)
    inter = shared.gate.shape[0]
    a = mops.moe_swiglu(gu[:, :inter], gu[:, inter:])
    return _rows_mm(a, shared.down.T), gu, a


def dispatches_fp8_tokens(experts, save: bool, rounds) -> bool:
    """FP8 experts: the tokens quantised at their source and dispatched in FP8 (``fp8.
    dispatch_tokens``), bit for bit the rows the GEMM would quantise after a bf16 dispatch;
    not where the backward recomputes from the received bf16 tokens (rounds, kept in the
    context), which then are what is dispatched."""
    return experts.fp8 and not (save and rounds.count > 1)


def forward(ws, sched, x, router_weights, shared, routed, save: bool = True):
    """``save``: keep what the backward needs (nothing when False)."""
    comm = ws.buffers.comm
    plan = padded_plan(sched)
    slot_weights = slot_weights_of(ws, sched, router_weights)
    rounds = make_rounds(ws.config.macrobatch_size, sched, plan, slot_weights)
    experts = Experts(routed, ws.config.expert_gemm, x.device,
                      precision=ws.config.expert_precision)  # fmt: skip
    fp8_tokens = dispatches_fp8_tokens(experts, save, rounds)
    if fp8_tokens:
        from . import fp8

        recv = fp8.dispatch_tokens(x, sched.recv_token_src, comm)
    else:
        recv = mops.moe_dispatch(x, sched.recv_token_src, comm)
    shared_out, shared_gu, shared_a = shared_forward(x, shared)
    acc = round_accumulator(rounds, recv, x.shape[1])
    for r in range(rounds.count):
        window = rounds.window(r)
        offs = window_offs(plan, window)
        save_pre = save and rounds.count == 1
        if fp8_tokens:
            x_q = fp8.gather_rows(recv, rounds.row_tok[window], x.shape[1])
            act = experts.forward(None, offs, save_pre=save_pre, x_q=x_q)
            del x_q
        else:
            x_rows = mops.moe_gather_rows(recv, rounds.row_tok[window])
            act = experts.forward(x_rows, offs, save_pre=save_pre)
        out = mops.moe_combine(
            act.y, plan.token_rows, sched.recv_token_src, slot_weights, sched.send_to,
            shared_out, sched.num_tokens, comm, acc, window.start, r == 0,
            r == rounds.count - 1,
        )  # fmt: skip
    one = rounds.count == 1
    if save and one:
        if not experts.backward_reads_y:
            act.y = None  # the backward takes the router-weight gradient from a instead
        act.x_rows = None  # the backward dispatches x again and gathers them
    ctx = CudaContext(plan, rounds, act if save and one else None,
                      recv if save and not one else None, shared_gu, shared_a)  # fmt: skip
    return out, ctx


def backward(ws, sched, ctx: CudaContext, d_out, x, router_weights, shared, routed,
             wgrad_acc=None):  # fmt: skip
    """Every gradient at once: ``backward_steps``' two steps run back to back (the context is
    left as it was, so it can serve another backward).

    ``wgrad_acc``: the routed weights' fp32 accumulators in the weights' form
    (``ExpertWeights`` / ``FusedExpertWeights``; api.backward's wgrad_accumulators) or None."""
    steps = backward_steps(ws, sched, ctx, d_out, x, router_weights, shared, routed, wgrad_acc,
                           consume=False)  # fmt: skip
    d_w_down = next(steps)
    return next(steps)._replace(d_w_routed_down=d_w_down)


def backward_steps(ws, sched, ctx: CudaContext, d_out, x, router_weights, shared, routed,
                   wgrad_acc=None, *, consume: bool = True):  # fmt: skip
    """The backward in two steps, a generator (``api.backward_steps``): the first ``next`` gives
    the routed down projection's weight gradient (None when it went into its accumulator), the
    second every other gradient (``MoKGradients``, its ``d_w_routed_down`` None).

    One round: step 1 is the down projection's side (d_out pulled to the rows, the router-weight
    gradient, dy = w * d_rows, or the L2 dgrad where y was not kept, the down weight's
    gradient), step 2 the rest, so autograd can add the down
    gradient into ``.grad`` and drop it before the gate/up gradient is made. ``consume``: this
    backward is the context's last use, and each kept activation is let go after its last read.
    With rounds, the down gradient is summed over rounds that each recompute gate/up, so step 1
    does all the work.
    """
    from . import mega

    if ctx.saved is None and ctx.x_recv is None:
        raise RuntimeError(
            "mok backward: the forward kept nothing for a backward (save_for_backward=False, "
            "e.g. it ran under torch.no_grad()); run the forward with gradients enabled"
        )
    if mega.runs_backward(ws, ctx, routed):
        yield from mega.backward_steps(ws, sched, ctx, d_out, x, router_weights, shared, routed,
                                       wgrad_acc, consume)  # fmt: skip
        return
    if ctx.saved is None:
        grads = _backward_rounds(ws, sched, ctx, d_out, x, router_weights, shared, routed,
                                 wgrad_acc)  # fmt: skip
        yield grads.d_w_routed_down
        yield grads._replace(d_w_routed_down=None)
        return
    yield from _one_round_steps(ws, sched, ctx, d_out, x, router_weights, shared, routed,
                                wgrad_acc, consume)  # fmt: skip


def _one_round_steps(ws, sched, ctx: CudaContext, d_out, x, router_weights, shared, routed,
                     wgrad_acc, consume: bool):  # fmt: skip
    from ..types import MoKGradients

    comm, plan, rounds = ws.buffers.comm, ctx.plan, ctx.rounds
    act = replace(ctx.saved)  # our own references, dropped after each one's last use
    if consume:  # then nothing else holds the activations
        ctx.saved = None
    experts = Experts(routed, ws.config.expert_gemm, x.device, accumulate=wgrad_acc is not None,
                      precision=ws.config.expert_precision,
                      fp8_backward=ws.config.fp8_backward)  # fmt: skip
    acc_w = _accumulator_slots(wgrad_acc)  # the caller's buffers in d_w's slots, or None
    window = rounds.window(0)
    offs = window_offs(plan, window)
    row_tok, w_rows = rounds.row_tok[window], rounds.w_rows[window]

    # step 1: the down projection's side
    d_rows = mops.moe_gather_rows(mops.moe_dispatch(d_out, sched.recv_token_src, comm), row_tok)
    d_row_w = torch.empty(rounds.row_tok.shape[0], dtype=torch.float32, device=x.device)
    d_row_w[window], dy, da, down_operands = _down_side(experts, act, d_rows, w_rows, row_tok,
                                                         offs)  # fmt: skip
    down_rows = [down_operands]  # popped into the down weight's gradient below
    del d_rows, down_operands
    act.y = act.a = None
    d_rw = mops.moe_combine_slots(
        d_row_w, plan.token_rows, sched.recv_token_src, sched.send_to, sched.num_tokens, comm
    )
    # NOTE: yielded unnamed: a local would keep the gradient alive in this generator's frame
    # after autograd has added it into .grad; and its operands popped: they go when it is made,
    # not after this generator resumes
    yield _weight_grad(experts, *down_rows.pop(), offs, rounds, acc_w, 2)

    # step 2: the SwiGLU backward, the gate/up dgrad and weight gradient, the shared expert
    d_shared, shared_dx = (None, None, None), None
    if shared is not None:
        d_shared, shared_dx = _shared_backward(d_out, x, ctx, shared)
    d_pre = _pre_grads(experts, dy, da, act, offs)
    del dy, da
    act.g = act.u = act.h = None
    # dx = Σ d_pre @ W_pre: with separate gate and up, each term rounded to bf16 once and summed
    # in float32 by the combine (rows2), so no add pass over [rows, H]
    dx = [experts.mm_nn(d, w, offs) for d, w in zip(d_pre, experts.pre_weights)]
    d_x = mops.moe_combine(
        dx[0], plan.token_rows, sched.recv_token_src, None, sched.send_to, shared_dx,
        sched.num_tokens, comm, None, window.start, True, True, dx[1] if len(dx) > 1 else None,
    )  # fmt: skip
    del dx, shared_dx
    # x_rows, not kept: x dispatched again (collective, as the d_out dispatch above), gathered
    x_rows = mops.moe_gather_rows(mops.moe_dispatch(x, sched.recv_token_src, comm), row_tok)
    del act
    d_w = [None, None, None]  # gate (or fused gate_up), up, down
    for slot, d in zip(experts.grad_slots, d_pre):  # one at a time (each is weight-sized)
        d_w[slot] = _weight_grad(experts, d, x_rows, offs, rounds, acc_w, slot)
    del x_rows, d_pre
    yield MoKGradients(
        d_x=d_x, d_router_weights=d_rw.to(router_weights.dtype),
        d_w_routed_gate=d_w[0], d_w_routed_up=d_w[1], d_w_routed_down=None,
        d_w_shared_gate=d_shared[0], d_w_shared_up=d_shared[1], d_w_shared_down=d_shared[2],
    )  # fmt: skip


def _down_side(experts, act: ExpertRows, d_rows, w_rows, row_tok, offs):
    """The down projection's side of one round's backward, in one ``moe_row_grad`` pass:
    (d_row_w, dy, da, the down weight gradient's operands). With y: d_row_w = <d_rows, y>
    (float32, fixed order; 0 on padding), dy = w * d_rows, da None, operands (dy, a). Without:
    <d_rows, y> = <d_rows @ W_down, a> and d_a = w * (d_rows @ W_down), dy None, operands
    (d_rows, w * a)."""
    if act.y is not None:
        d_row_w, dy = mops.moe_row_grad(d_rows, act.y, w_rows, row_tok)
        return d_row_w, dy, None, (dy, act.a)
    d_row_w, da = mops.moe_row_grad(
        experts.mm_nn(d_rows, experts.routed.down, offs), act.a, w_rows, row_tok
    )
    return d_row_w, None, da, (d_rows, weighted_rows(act.a, w_rows, row_tok))


def _pre_grads(experts, dy, da, act: ExpertRows, offs):
    """The pre-activation gradients from ``_down_side``'s dy or da."""
    if da is None:
        return experts.pre_grads_from_dy(dy, act, offs)
    return experts.pre_grads_from_da(da, act)


def _weight_grad(experts, rows_t, rows, offs, rounds, acc_w, slot, total=None, r=0):
    """One routed weight's gradient over round ``r``'s rows, or None when it went into the
    caller's buffer ``acc_w[slot]``. In several rounds it is added to ``total`` (the rounds so
    far, None before the first), in the caller's round order: on the engine (its "wgrad" step,
    ``Experts.accumulate_on_engine``) by the GEMM's epilogue into one zeroed bf16 total, with no
    weight-sized part per round (the rounds exist for the peak memory); on torch, each round's
    part added by ``accumulate`` (``rounds.first_round`` orders them)."""
    if acc_w is not None:
        experts.mm_tn_accumulate(rows_t, rows, offs, acc_w[slot])
        return None
    if rounds.count > 1 and experts.accumulate_on_engine:
        if total is None:  # zeros: an expert without rows so far, or at all, adds to 0
            total = rows_t.new_zeros(offs.shape[0], rows_t.shape[1], rows.shape[1])
        experts.mm_tn_accumulate(rows_t, rows, offs, total)
        return total
    return accumulate(total, experts.mm_tn(rows_t, rows, offs), offs, rounds, r)


def _backward_rounds(ws, sched, ctx: CudaContext, d_out, x, router_weights, shared, routed,
                     wgrad_acc):  # fmt: skip
    """More rounds than one: each recomputes gate/up and SwiGLU from the received tokens (not y:
    <d_rows, y> = <d_rows @ W_down, a>, and d_a = w * (d_rows @ W_down); FP8 experts recompute
    y as well, whose router-weight gradient is <d_rows, y>); the weight gradients add up round
    after round."""
    from ..types import MoKGradients

    comm, plan, rounds = ws.buffers.comm, ctx.plan, ctx.rounds
    d_recv = mops.moe_dispatch(d_out, sched.recv_token_src, comm)
    d_shared, shared_dx = (None, None, None), None
    if shared is not None:
        d_shared, shared_dx = _shared_backward(d_out, x, ctx, shared)
    d_row_w = torch.empty(rounds.row_tok.shape[0], dtype=torch.float32, device=x.device)
    # accumulate: the weight gradients add up over the rounds (into the caller's buffers or a
    # bf16 total: _weight_grad), so "auto" runs them on the engine (AUTO_ACCUMULATE_STEPS)
    experts = Experts(routed, ws.config.expert_gemm, x.device, accumulate=True,
                      precision=ws.config.expert_precision,
                      fp8_backward=ws.config.fp8_backward)  # fmt: skip
    d_w = [None, None, None]  # gate (or fused gate_up), up, down
    acc_w = _accumulator_slots(wgrad_acc)  # the caller's buffers in the same slots, or None
    acc = round_accumulator(rounds, d_recv)
    for r in range(rounds.count):
        window = rounds.window(r)
        offs = window_offs(plan, window)
        row_tok, w_rows = rounds.row_tok[window], rounds.w_rows[window]
        d_rows = mops.moe_gather_rows(d_recv, row_tok)
        x_rows = mops.moe_gather_rows(ctx.x_recv, row_tok)
        # FP8 recomputes y too: its router-weight gradient is <d_rows, y> of the FP8 GEMM's y
        # (Experts.backward_reads_y); the bf16 W_down's <d_rows @ W_down, a> is not
        act = experts.forward(x_rows, offs, save_pre=True, with_down=experts.fp8)
        d_row_w[window], dy, da, wgrad_down = _down_side(experts, act, d_rows, w_rows, row_tok,
                                                         offs)  # fmt: skip
        act.y = d_rows = None  # d_rows lives on in wgrad_down only where it is an operand
        d_pre = _pre_grads(experts, dy, da, act, offs)
        del dy, da
        dx = [experts.mm_nn(d, w, offs) for d, w in zip(d_pre, experts.pre_weights)]
        # weight gradients one at a time (on torch each round's part is weight-sized: _weight_grad)
        parts = [(d, act.x_rows) for d in d_pre] + [wgrad_down]
        for i, (rows_t, rows) in zip(experts.grad_slots, parts):  # (or into acc_w, in order)
            d_w[i] = _weight_grad(experts, rows_t, rows, offs, rounds, acc_w, i, d_w[i], r)
        d_x = mops.moe_combine(
            dx[0], plan.token_rows, sched.recv_token_src, None, sched.send_to, shared_dx,
            sched.num_tokens, comm, acc, window.start, r == 0, r == rounds.count - 1,
            dx[1] if len(dx) > 1 else None,
        )  # fmt: skip
    d_rw = mops.moe_combine_slots(
        d_row_w, plan.token_rows, sched.recv_token_src, sched.send_to, sched.num_tokens, comm
    )
    return MoKGradients(
        d_x=d_x, d_router_weights=d_rw.to(router_weights.dtype),
        d_w_routed_gate=d_w[0], d_w_routed_up=d_w[1], d_w_routed_down=d_w[2],
        d_w_shared_gate=d_shared[0], d_w_shared_up=d_shared[1],
        d_w_shared_down=d_shared[2],
    )  # fmt: skip


def _accumulator_slots(wgrad_acc):
    """The accumulators as (gate or fused gate_up, up or None, down): d_w's slots."""
    from ..types import FusedExpertWeights

    if wgrad_acc is None:
        return None
    if isinstance(wgrad_acc, FusedExpertWeights):
        return (wgrad_acc.gate_up, None, wgrad_acc.down)
    return tuple(wgrad_acc)


def _shared_backward(d_out, x, ctx: CudaContext, shared):
    da = _rows_mm(d_out, shared.down)  # [T, I_s]
    inter = shared.gate.shape[0]
    gu = ctx.shared_gu
    dgu = torch.cat(mops.moe_swiglu_backward(da.contiguous(), gu[:, :inter], gu[:, inter:]), 1)
    d_w1 = _grad_mm(dgu, x)  # [2I_s, H]
    d_sd = _grad_mm(d_out, ctx.shared_a)
    shared_dx = _rows_mm(dgu, torch.cat([shared.gate, shared.up], dim=0))
    return (d_w1[:inter].contiguous(), d_w1[inter:].contiguous(), d_sd), shared_dx.contiguous()
