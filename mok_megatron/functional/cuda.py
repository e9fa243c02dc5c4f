"""The CUDA backend, stage 1: compiled kernels over symmetric memory (DESIGN.md, "Kernel roadmap").

The plan is the reference backend's, step for step, with every cross-rank move done by kernels
that load and store through peers' symmetric buffers (no collectives, no host sync):

  schedule   routing all-gather (``moe_gather_routing``) + the device schedule
             (``moe_build_schedule``), integer-for-integer equal to ``build_schedule_from_global``
  dispatch   each token pulled once per destination rank into received-token order
             (``moe_dispatch``), then gathered (``moe_gather_rows``) into a *padded* row
             layout: each local expert's rows start at a multiple of 8 (zero rows between),
             which ``torch._grouped_mm`` needs for its 16-byte-aligned groups in the
             weight-gradient GEMMs
  experts    with the fused gate/up weight (``FusedExpertWeights``; MoKExperts' form): on Hopper,
             L1 with SwiGLU in its epilogue and the L2 forward on the expert GEMM engine
             (``ops.grouped_gemm``), ``torch._grouped_mm`` for the GEMMs where the engine does
             not win (env MOK_EXPERT_GEMM picks otherwise; docs/GEMM.md, docs/PERF.md);
             with separate gate and up weights, two grouped GEMMs and the SwiGLU kernel
             reading both; then the L2 grouped GEMM
  combine    per received token, a slot-ordered float32 sum on the expert side, one row per
             (token, rank) pushed to the source, a rank-ordered float32 sum there (+ shared)
  backward   the same moves in reverse; the per-row router-weight gradient and weighted d_out
             in one kernel (``moe_row_grad``); weight gradients are grouped GEMMs that reduce
             over each expert's rows in one fixed order (no atomics), experts without rows
             zeroed by ``moe_accumulate_groups`` without a pass over the other experts
  rounds     when the schedule holds more rows than ``macrobatch_size``, the padded rows run in
             ``ceil(row_capacity / macrobatch_size)`` windows ("macrobatch rounds") of equal,
             fixed size: each round gathers, runs the expert MLP and adds its rows to a float32
             per-token accumulator; the last round pushes. The forward then keeps only the
             received tokens, and the backward recomputes each round's gate/up and SwiGLU (not
             the down projection: its gradients need only d_rows @ W_down), so no buffer
             grows with the routed rows beyond one round (the integer schedule aside). The number
             of rounds is fixed by the capacity, not the routing: no host sync, graph-safe.

It serves a workspace only when every op it needs is compiled into ``mok_megatron._C``;
``unsupported_reasons`` says what is missing, and backend selection reports it.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .schedule import MoKSchedule
from .types import FusedExpertWeights

if TYPE_CHECKING:
    from .workspace import MoKWorkspace

__all__ = ["CudaBackend", "CudaContext"]

#: Row alignment of each expert's group in the padded GEMM layout (16 bytes of bf16).
GROUP_ALIGN = 8
#: Ranks one barrier kernel serves (one thread per peer in a warp: csrc/launch/moe.cu).
MAX_RANKS = 32
#: Device waits give up after this long (env MOK_WAIT_TIMEOUT_MS), reporting rank, phase, flag.
DEFAULT_WAIT_TIMEOUT_MS = 10_000
#: The fused gate/up form's steps the expert GEMM engine can run (env MOK_EXPERT_GEMM: "auto",
#: "torch" (none), "engine" (all) or a list joined by "," or "+"): "l1" L1 + SwiGLU (forward,
#: and the rounds' recompute), "dswiglu" the L2 dgrad + SwiGLU backward, and the plain GEMMs:
#: "l2" the L2 forward, "dgrad" the dgrads (against W_down without "dswiglu", and against W_gu),
#: "wgrad" the weight gradients.
ENGINE_STEPS = ("l1", "dswiglu", "l2", "dgrad", "wgrad")
#: What "auto" picks on Hopper. "l2": its engine GEMM beat torch._grouped_mm on all six points of
#: the same-process micro-benchmark (docs/GEMM.md). "l1" (which also writes h for the backward):
#: in that micro-benchmark it is compared with torch._grouped_mm + MoK's interleaved SwiGLU
#: kernel, the backend's alternative (pair "mok_save_h" / "torch_gemm+mok_swiglu"); in the layer
#: at EP 2 the default's forward was ahead of all-torch GEMMs (docs/PERF.md). Not the dgrads (the
#: L1 dgrad lost on one shape), the weight gradients (lost on most) or the fused dSwiGLU (its
#: d_h store is not staged through shared memory; pair "mok" / "torch_gemm+mok_dswiglu").
AUTO_ENGINE_STEPS = ("l1", "l2")


@dataclass
class CudaBuffers:
    """One rank's symmetric workspace and the device tables the kernels read peers through."""

    buffer: torch.Tensor  # [total_bytes] uint8: this rank's copy of the layout
    handle: Any  # the symmetric-memory handle (None for one rank)
    peer_table: torch.Tensor  # [W] int64: base address of each rank's copy
    signal_table: torch.Tensor | None  # [W] int64: each rank's signal pad (None for one rank)
    comm: list[int]  # the 9 ints every moe_* op takes (ops/moe.py)
    layout: Any  # ops.moe.MoeWorkspaceLayout


@dataclass
class CudaPlan:
    """The padded row layout of one schedule (P = C + 8 * E_l rows; all device tensors).

    row_tok: [P] received-token index of each padded row, -1 for padding;
    token_rows: [C_tok, K] padded row of each slot, -1; offs: [E_l] int32 group ends;
    expert_rows: [E_l] rows per expert (weight gradients of empty experts are zeroed).
    """

    row_tok: torch.Tensor
    token_rows: torch.Tensor
    offs: torch.Tensor
    expert_rows: torch.Tensor
    prow: torch.Tensor  # [C] padded row of each schedule row (P for unused rows)


@dataclass
class Rounds:
    """Macrobatch rounds over the padded rows: ``count`` windows of ``rows`` rows each.

    row_tok: [count * rows] received-token index of each padded row (-1 for padding);
    w_rows: [count * rows] float32 router weight of each row (0 for padding);
    first_round: [E_l] int32 round of each expert's first row (-1 for an expert with none).
    """

    count: int
    rows: int
    row_tok: torch.Tensor
    w_rows: torch.Tensor
    first_round: torch.Tensor

    def window(self, r: int) -> slice:
        return slice(r * self.rows, (r + 1) * self.rows)


@dataclass
class ExpertRows:
    """One round's expert activations, bf16: x_rows [M, H], a [M, I], y [M, H] (None when the
    backward recomputes a round: it needs only the others) and the pre-activation: g, u [M, I]
    (separate gate and up weights) or h [M, 2I] (fused form: gate and up columns interleaved in
    blocks of 8; None when only the forward of a round needs it)."""

    x_rows: torch.Tensor
    a: torch.Tensor
    y: torch.Tensor | None
    g: torch.Tensor | None = None
    u: torch.Tensor | None = None
    h: torch.Tensor | None = None


@dataclass
class CudaContext:
    """What the forward keeps for its backward.

    One round: ``saved`` holds its activations. More rounds: ``x_recv`` [C_tok, H] holds the
    received tokens and the backward recomputes each round. shared_gu / shared_a: [T, 2I_s] /
    [T, I_s] or None.
    """

    plan: CudaPlan
    rounds: Rounds
    saved: ExpertRows | None
    x_recv: torch.Tensor | None
    shared_gu: torch.Tensor | None
    shared_a: torch.Tensor | None


class CudaBackend:
    name = "cuda"

    @staticmethod
    def unsupported_reasons(ws: MoKWorkspace) -> list[str]:
        from mok_megatron.ops import extension_error, has_op
        from mok_megatron.ops.moe import CUDA_OPS

        reasons = []
        if ws.device.type != "cuda":
            reasons.append(f"the workspace device is {ws.device}, not a CUDA device")
        if ws.dtype != torch.bfloat16:
            reasons.append(f"the CUDA backend takes bfloat16 activations, not {ws.dtype}")
        for name, size in (
            ("hidden_size", ws.hidden_size),
            ("intermediate_size", ws.intermediate_size),
        ):
            if size % GROUP_ALIGN:
                reasons.append(f"{name}={size} is not a multiple of {GROUP_ALIGN} (16-byte rows)")
        if ws.num_ranks > MAX_RANKS:
            reasons.append(
                f"{ws.num_ranks} expert-parallel ranks; the barrier serves <= {MAX_RANKS}"
            )
        missing = [op for op in CUDA_OPS if not has_op(op)]
        if extension_error() is not None:
            reasons.append(f"mok_megatron._C did not load ({extension_error()})")
        elif missing:
            reasons.append(f"mok_megatron._C lacks the ops {missing}")
        return reasons

    @staticmethod
    def workspace_bytes(**shape) -> int:
        from mok_megatron.ops import extension_error
        from mok_megatron.ops.moe import moe_workspace_layout

        if extension_error() is not None:
            raise RuntimeError(
                f"the CUDA backend's workspace layout needs mok_megatron._C ({extension_error()})"
            )
        return moe_workspace_layout(
            shape["num_ranks"], shape["num_local_tokens"], shape["topk"], shape["hidden_size"]
        ).total_bytes

    # ------------------------------------------------------------------------------ workspace
    def allocate(self, ws: MoKWorkspace) -> CudaBuffers:
        from mok_megatron.ops.moe import moe_workspace_layout

        layout = moe_workspace_layout(ws.num_ranks, ws.num_local_tokens, ws.topk, ws.hidden_size)
        timeout_ms = int(os.environ.get("MOK_WAIT_TIMEOUT_MS", DEFAULT_WAIT_TIMEOUT_MS))
        if ws.num_ranks == 1:
            buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=ws.device)
            handle, peers, signals = None, [buffer.data_ptr()], None
        else:
            buffer, handle, peers, signals = _rendezvous(ws, layout.total_bytes)
        peer_table = torch.tensor(peers, dtype=torch.int64, device=ws.device)
        signal_table = None
        if signals is not None:
            signal_table = torch.tensor(signals, dtype=torch.int64, device=ws.device)
        comm = [
            peer_table.data_ptr(), signal_table.data_ptr() if signal_table is not None else 0,
            buffer.data_ptr(), ws.rank, ws.num_ranks, ws.num_local_tokens, ws.topk,
            ws.hidden_size, timeout_ms,
        ]  # fmt: skip
        return CudaBuffers(buffer, handle, peer_table, signal_table, comm, layout)

    # ------------------------------------------------------------------------------- schedule
    def build_schedule(self, ws: MoKWorkspace, topk_experts: torch.Tensor) -> MoKSchedule:
        from mok_megatron.ops import moe as mops

        comm = ws.buffers.comm
        num_tokens = topk_experts.shape[0]
        no_weights = torch.zeros(topk_experts.shape, dtype=torch.float32, device=ws.device)
        global_topk, _ = mops.moe_gather_routing(topk_experts.contiguous(), no_weights, comm)
        fields = mops.moe_build_schedule(
            global_topk, ws.rank, ws.num_experts, ws.row_capacity, ws.token_capacity
        )
        names = MoKSchedule.INTEGER_FIELDS[1:]
        return MoKSchedule(
            rank=ws.rank, num_ranks=ws.num_ranks, num_tokens=num_tokens,
            max_tokens=ws.num_local_tokens, topk=ws.topk, num_local_experts=ws.num_local_experts,
            row_capacity=ws.row_capacity, token_capacity=ws.token_capacity,
            global_topk=global_topk, **dict(zip(names, fields)),
        )  # fmt: skip

    # -------------------------------------------------------------------------------- forward
    def forward(self, ws, sched, x, router_weights, shared, routed):
        from mok_megatron.ops import moe as mops

        comm = ws.buffers.comm
        plan = _padded_plan(sched)
        mine = sched.global_topk[ws.rank, : sched.num_tokens].contiguous()
        _, slot_weights = mops.moe_gather_routing(mine, router_weights.contiguous(), comm)
        rounds = _rounds(ws.config.macrobatch_size, sched, plan, slot_weights)
        recv = mops.moe_dispatch(x, sched.recv_token_src, comm)
        shared_gu = shared_a = shared_out = None
        if shared is not None:
            shared_gu = x @ torch.cat([shared.gate, shared.up], dim=0).T
            inter = shared.gate.shape[0]
            shared_a = mops.moe_swiglu(shared_gu[:, :inter], shared_gu[:, inter:])
            shared_out = shared_a @ shared.down.T
        acc = _round_accumulator(rounds, recv)
        experts = _Experts(routed, x.device)
        for r in range(rounds.count):
            window = rounds.window(r)
            offs = _window_offs(plan, window)
            x_rows = _gather_rows(recv, rounds.row_tok[window])
            act = experts.forward(x_rows, offs, save_pre=rounds.count == 1)
            out = mops.moe_combine(
                act.y, plan.token_rows, sched.recv_token_src, slot_weights, sched.send_to,
                shared_out, sched.num_tokens, comm, acc, window.start, r == 0,
                r == rounds.count - 1,
            )  # fmt: skip
        one = rounds.count == 1
        ctx = CudaContext(
            plan, rounds, act if one else None, None if one else recv, shared_gu, shared_a
        )
        return out, ctx

    # ------------------------------------------------------------------------------- backward
    def backward(self, ws, sched, ctx, d_out, x, router_weights, shared, routed):
        from mok_megatron.ops import moe as mops

        from .types import MoKGradients

        comm, plan, rounds = ws.buffers.comm, ctx.plan, ctx.rounds
        d_recv = mops.moe_dispatch(d_out, sched.recv_token_src, comm)
        d_shared, shared_dx = (None, None, None), None
        if shared is not None:
            d_shared, shared_dx = _shared_backward(d_out, x, ctx, shared)
        d_row_w = torch.empty(rounds.row_tok.shape[0], dtype=torch.float32, device=x.device)
        experts = _Experts(routed, x.device)
        d_w = [None, None, None]  # gate (or fused gate_up), up, down
        acc = _round_accumulator(rounds, d_recv)
        for r in range(rounds.count):
            window = rounds.window(r)
            offs = _window_offs(plan, window)
            row_tok, w_rows = rounds.row_tok[window], rounds.w_rows[window]
            d_rows = _gather_rows(d_recv, row_tok)
            if ctx.saved is not None:  # one round: the forward kept every activation
                act = ctx.saved
                # one pass: d_row_w = <d_rows, y> (float32, fixed order; 0 on padding),
                # dy = w * d_rows
                d_row_w[window], dy = mops.moe_row_grad(d_rows, act.y, w_rows, row_tok)
                d_pre = experts.pre_grads_from_dy(dy, act, offs)
                wgrad_down = (dy, act.a)
            else:  # rounds: recompute gate/up and SwiGLU from the received tokens (not y:
                # <d_rows, y> = <d_rows @ W_down, a>, and d_a = w * (d_rows @ W_down))
                act = experts.forward(_gather_rows(ctx.x_recv, row_tok), offs, save_pre=True,
                                      with_down=False)  # fmt: skip
                d_row_w[window], da = mops.moe_row_grad(
                    experts.mm_nn(d_rows, routed.down, offs), act.a, w_rows, row_tok
                )
                d_pre = experts.pre_grads_from_da(da, act)
                del da
                wgrad_down = (d_rows, (act.a.float() * w_rows[:, None]).to(torch.bfloat16))
            # dx = Σ d_pre @ W_pre: with separate gate and up, each term rounded to bf16 once
            # and summed in float32 by the combine (rows2), so no add pass over [rows, H]
            dx = [experts.mm_nn(d, w, offs) for d, w in zip(d_pre, experts.pre_weights)]
            # weight gradients one at a time (each part is weight-sized)
            parts = [(d, act.x_rows) for d in d_pre] + [wgrad_down]
            for i, (rows_t, rows) in zip(experts.grad_slots, parts):
                d_w[i] = _accumulate(d_w[i], experts.mm_tn(rows_t, rows, offs), offs, rounds, r)
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


# ------------------------------------------------------------------------------- helpers
def _rendezvous(ws: MoKWorkspace, nbytes: int):
    """Allocate this rank's symmetric copy and exchange peers' addresses (a collective)."""
    import torch.distributed._symmetric_memory as symm_mem

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    group = ws.group if ws.group is not None else dist.group.WORLD
    buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=ws.device)
    buffer.zero_()
    handle = symm_mem.rendezvous(buffer, group.group_name)
    # The tensor may sit inside a larger symmetric block: address peers at the same offset.
    delta = buffer.data_ptr() - handle.buffer_ptrs[handle.rank]
    check = torch.tensor([delta, -delta], dtype=torch.int64, device=ws.device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
    if int(check[0]) != delta or int(check[1]) != -delta:  # workspace creation: may sync
        raise RuntimeError("mok: the symmetric workspace sits at different offsets across ranks")
    peers = [base + delta for base in handle.buffer_ptrs]
    dist.barrier(group=group)
    return buffer, handle, peers, list(handle.signal_pad_ptrs)


def _padded_plan(sched: MoKSchedule) -> CudaPlan:
    """Schedule rows → padded rows: expert e's rows start at a multiple of GROUP_ALIGN."""
    e_l, cap = sched.num_local_experts, sched.row_capacity
    num_padded = cap + GROUP_ALIGN * e_l
    offsets = sched.expert_offsets
    expert_rows = offsets[1:] - offsets[:-1]
    padded = (expert_rows + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    used = sched.row_expert < e_l
    expert = sched.row_expert.clamp(max=e_l - 1)
    rows = torch.arange(cap, device=offsets.device)
    prow = torch.where(used, rows - offsets[expert] + pad_start[expert], num_padded)
    row_tok = torch.full((num_padded + 1,), -1, dtype=torch.int64, device=offsets.device)
    row_tok.scatter_(0, prow, torch.where(used, sched.row_token_idx, -1))
    slot = sched.token_rows
    token_rows = torch.where(slot >= 0, prow[slot.clamp(min=0)], -1)
    return CudaPlan(row_tok[:num_padded], token_rows.contiguous(), pad_end.to(torch.int32),
                    expert_rows, prow)  # fmt: skip


def _gather_rows(recv: torch.Tensor, row_tok: torch.Tensor) -> torch.Tensor:
    """recv: [C_tok, H] → [P, H] in padded row order, zeros on padding (one kernel)."""
    from mok_megatron.ops import moe as mops

    return mops.moe_gather_rows(recv, row_tok)


def _rounds(macrobatch: int, sched: MoKSchedule, plan: CudaPlan, slot_weights) -> Rounds:
    """Split the P padded rows into ceil(row_capacity / macrobatch) equal windows (a multiple of
    GROUP_ALIGN rows each, so every group in a window stays 16-byte aligned)."""
    padded = plan.row_tok.shape[0]
    count = max(1, math.ceil(sched.row_capacity / macrobatch))
    rows = padded if count == 1 else _align(math.ceil(padded / count), GROUP_ALIGN)
    extra = count * rows - padded
    row_tok, w_rows = plan.row_tok, _row_weights(slot_weights, sched, plan)
    if extra:
        row_tok = torch.cat([row_tok, row_tok.new_full((extra,), -1)])
        w_rows = torch.cat([w_rows, w_rows.new_zeros(extra)])
    ends = plan.offs.to(torch.int64)
    start = torch.cat([ends.new_zeros(1), ends[:-1]])  # each expert's first padded row
    first_round = torch.where(plan.expert_rows > 0, start // rows, -1).to(torch.int32)
    return Rounds(count, rows, row_tok, w_rows, first_round)


def _window_offs(plan: CudaPlan, window: slice) -> torch.Tensor:
    """Group ends of the padded layout, seen from inside one window ([G] int32)."""
    width = window.stop - window.start
    return (plan.offs - window.start).clamp_(0, width).to(torch.int32)


def _round_accumulator(rounds: Rounds, recv: torch.Tensor) -> torch.Tensor | None:
    """The float32 per-received-token sum carried between rounds (None for one round)."""
    if rounds.count == 1:
        return None
    return torch.empty(recv.shape, dtype=torch.float32, device=recv.device)


class _Experts:
    """The routed expert MLP on one round's rows, for either weight form.

    Separate gate/up: two grouped GEMMs and the SwiGLU kernel. Fused gate/up
    (``FusedExpertWeights``): each step on the expert GEMM engine or on torch GEMMs, as
    ``_engine_steps`` says: L1 + SwiGLU in one engine GEMM (``h`` kept when the backward needs
    it) or one ``torch._grouped_mm`` over both halves and the interleaved SwiGLU kernel; the L2
    dgrad with the SwiGLU backward in one engine GEMM, or ``torch._grouped_mm`` and the
    interleaved SwiGLU-backward kernel; the plain GEMMs (L2 forward, dgrads, weight gradients)
    likewise (``mm_nt``, ``mm_nn``, ``mm_tn``).
    """

    def __init__(self, routed, device: torch.device):
        self.routed = routed
        self.fused = isinstance(routed, FusedExpertWeights)
        self.engine = _engine_steps(device) if self.fused else ()
        if self.fused:
            self.pre_weights = (routed.gate_up,)
            self.grad_slots = (0, 2)  # d_w_routed_gate holds gate_up's gradient
        else:
            self.pre_weights = (routed.gate, routed.up)
            self.grad_slots = (0, 1, 2)

    def forward(self, x_rows, offs, *, save_pre: bool, with_down: bool = True) -> ExpertRows:
        """x_rows [M, H] → ExpertRows; the pre-activation is kept only when ``save_pre`` (the
        separate form always has it: it is the GEMMs' output)."""
        from mok_megatron.ops import grouped_gemm as gg
        from mok_megatron.ops import moe as mops

        w = self.routed
        g = u = h = None
        if "l1" in self.engine:
            a, h = gg.grouped_gemm_l1_swiglu(x_rows, w.gate_up, offs, save_h=save_pre)
        elif self.fused:
            h = grouped_mm(x_rows, w.gate_up.transpose(1, 2), offs)
            a = mops.moe_swiglu_interleaved(h)
            h = h if save_pre else None
        else:
            # NOTE: gate and up stay two GEMMs: concatenating the weights would copy all of
            # them (2 * E_l * I * H) every pass; the SwiGLU kernel reads the two outputs.
            g = grouped_mm(x_rows, w.gate.transpose(1, 2), offs)
            u = grouped_mm(x_rows, w.up.transpose(1, 2), offs)
            a = mops.moe_swiglu(g, u)
        y = self.mm_nt(a, w.down, offs) if with_down else None
        return ExpertRows(x_rows, a, y, g, u, h)

    def pre_grads_from_dy(self, dy, act: ExpertRows, offs) -> tuple[torch.Tensor, ...]:
        """dy = w * d_rows [M, H] → the pre-activation gradients (d_g, d_u) or (d_h,)."""
        from mok_megatron.ops import grouped_gemm as gg

        if "dswiglu" in self.engine:  # the L2 dgrad with the SwiGLU backward in its epilogue
            return (gg.grouped_gemm_dswiglu(dy, self.routed.down, act.h, offs)[0],)
        return self.pre_grads_from_da(self.mm_nn(dy, self.routed.down, offs), act)

    def pre_grads_from_da(self, da, act: ExpertRows) -> tuple[torch.Tensor, ...]:
        """da [M, I] (the gradient of the SwiGLU output) → (d_g, d_u) or (d_h,)."""
        from mok_megatron.ops import moe as mops

        if self.fused:
            return (mops.moe_swiglu_interleaved_backward(da, act.h),)
        return mops.moe_swiglu_backward(da, act.g, act.u)

    # The plain GEMMs: the engine's (steps "l2", "dgrad", "wgrad") or torch._grouped_mm.
    def mm_nt(self, a, b, offs):
        """a [M, K], b [G, N, K] → a_g @ b[g]^T [M, N] (the L2 forward)."""
        from mok_megatron.ops import grouped_gemm as gg

        if "l2" in self.engine:
            return gg.grouped_gemm_nt(a, b, offs)
        return grouped_mm(a, b.transpose(1, 2), offs)

    def mm_nn(self, a, b, offs):
        """a [M, K], b [G, K, N] → a_g @ b[g] [M, N] (the dgrads)."""
        from mok_megatron.ops import grouped_gemm as gg

        if "dgrad" in self.engine:
            return gg.grouped_gemm_nn(a, b, offs)
        return grouped_mm(a, b, offs)

    def mm_tn(self, a, b, offs):
        """a [M, P], b [M, Q] → [G, P, Q], each group's a_g^T @ b_g (the weight gradients)."""
        from mok_megatron.ops import grouped_gemm as gg

        if "wgrad" in self.engine:
            return gg.grouped_gemm_tn(a, b, offs)
        return grouped_mm(a.T, b, offs)


def _engine_steps(device: torch.device) -> tuple[str, ...]:
    """The steps of the fused gate/up form that run on the expert GEMM engine (ENGINE_STEPS),
    from env MOK_EXPERT_GEMM; "auto" is AUTO_ENGINE_STEPS where the engine can run, else none
    (with a warning that says why)."""
    from mok_megatron.ops.grouped_gemm import grouped_gemm_available

    choice = os.environ.get("MOK_EXPERT_GEMM", "auto")
    if choice in ("auto", "torch", "engine"):
        steps = {"auto": AUTO_ENGINE_STEPS, "torch": (), "engine": ENGINE_STEPS}[choice]
    else:
        steps = tuple(s.strip() for s in choice.replace("+", ",").split(","))
        if not set(steps) <= set(ENGINE_STEPS):
            raise ValueError(
                f"MOK_EXPERT_GEMM={choice!r}; choose auto, torch, engine or a comma list of "
                f"{ENGINE_STEPS}"
            )
    if not steps:
        return ()
    why_not = None
    if not grouped_gemm_available():
        why_not = "mok_megatron._C lacks the grouped-GEMM ops"
    elif device.type != "cuda":
        why_not = f"the device is {device}, not a CUDA GPU"
    elif torch.cuda.get_device_capability(device) != (9, 0):
        major, minor = torch.cuda.get_device_capability(device)
        why_not = f"it is built for sm_90a and this GPU is sm_{major}{minor}"
    if why_not is None:
        return steps
    if choice != "auto":
        raise RuntimeError(
            f"MOK_EXPERT_GEMM={choice} but the expert GEMM engine can't run: {why_not}"
        )
    _warn_once(
        f"mok: the fused gate/up experts run on torch._grouped_mm, not the expert GEMM engine: "
        f"{why_not} (MOK_EXPERT_GEMM=torch chooses this without the warning)"
    )
    return ()


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


def _accumulate(total, part: torch.Tensor, offs: torch.Tensor, rounds: Rounds, r: int):
    """Add round r's weight gradient to the total, in round order, touching only the experts
    that need it (ops.moe.moe_accumulate_groups); round 0's output becomes the total. Experts
    with no rows get exact zeros (whatever an empty group GEMM leaves)."""
    from mok_megatron.ops import moe as mops

    part = part.contiguous()
    total = part if total is None else total
    mops.moe_accumulate_groups(total, part, offs, rounds.first_round, r)
    return total


def _row_weights(slot_weights: torch.Tensor, sched: MoKSchedule, plan: CudaPlan):
    """[W, T_max, K] router weights → [P] weight of each padded row (0 on padding)."""
    flat = (sched.row_src_rank * sched.max_tokens + sched.row_src_token) * sched.topk
    flat = (flat + sched.row_src_slot).clamp(min=0)
    values = torch.where(
        sched.row_expert < sched.num_local_experts, slot_weights.flatten()[flat], 0
    )
    out = torch.zeros(plan.row_tok.shape[0] + 1, dtype=torch.float32, device=values.device)
    out.scatter_(0, plan.prow, values)  # unused rows all land on the dropped last entry
    return out[:-1]


def _shared_backward(d_out, x, ctx: CudaContext, shared):
    from mok_megatron.ops import moe as mops

    da = d_out @ shared.down  # [T, I_s]
    inter = shared.gate.shape[0]
    gu = ctx.shared_gu
    dgu = torch.cat(mops.moe_swiglu_backward(da.contiguous(), gu[:, :inter], gu[:, inter:]), 1)
    d_w1 = dgu.T @ x  # [2I_s, H]
    d_sd = d_out.T @ ctx.shared_a
    shared_dx = dgu @ torch.cat([shared.gate, shared.up], dim=0)
    return (d_w1[:inter].contiguous(), d_w1[inter:].contiguous(), d_sd), shared_dx.contiguous()


def _align(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` (bf16, no host sync), or a masked dense loop when
    MOK_GROUPED_MM=loop (a slow fallback with the same semantics, for debugging).

    2d x 3d: a [P, K], b [G, K, N] → [P, N] (rows past offs[-1] are undefined);
    2d x 2d: a [M, P], b [P, N] → [G, M, N], reducing each group's rows.
    """
    if os.environ.get("MOK_GROUPED_MM", "torch") != "loop":
        return torch._grouped_mm(a, b, offs=offs)
    group_rows = a.shape[0] if b.dim() == 3 else a.shape[1]
    idx = torch.arange(group_rows, device=a.device)
    group = torch.searchsorted(offs.to(torch.int64), idx, right=True)
    if b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[2])
        for g in range(b.shape[0]):
            out = torch.where((group == g)[:, None], a @ b[g], out)
        return out
    return torch.stack([torch.where((group == g)[None, :], a, 0) @ b for g in range(offs.shape[0])])
