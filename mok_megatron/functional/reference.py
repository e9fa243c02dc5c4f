"""The reference backend: pure PyTorch, deterministic, expert-parallel over any process group.

It runs the same plan as the kernels, in the same shape: the schedule's fixed-capacity rows, a
pull of each token once per destination rank, per-expert GEMMs, an expert-side sum over each
token's local slots in slot order, one row per (token, rank) pushed back, and a fixed-order sum
over ranks at the source. All shapes are fixed by the workspace, so it never syncs the host.
Collectives (all-gather, all-to-all) stand in for symmetric-memory loads and stores, so it runs
on gloo (CPU) and NCCL alike. Low-precision inputs are computed in float32 and rounded at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .schedule import MoKSchedule, build_schedule_from_global
from .types import ExpertWeights, FusedExpertWeights, MoKGradients

if TYPE_CHECKING:
    from .workspace import MoKWorkspace

__all__ = ["ReferenceBackend", "ReferenceContext"]


@dataclass
class ReferenceContext:
    """What the reference forward keeps for its backward (rows in schedule order).

    x_rows: [C, H], g_rows / u_rows: [C, I], y_rows: [C, H] (unweighted expert outputs),
    w_rows: [C] router weight of each row; shared_g / shared_u: [T, I_s] or None. With
    expert_precision="fp8_blockwise", g / u / y are the FP8 forward's and x_rows stays
    unquantised: the backward is the BF16 one at the FP8 forward's activations, except that with
    fp8_backward="dgrad" its two data-gradient products are the CUDA path's FP8 ones
    (``_fp8_dgrad_rows``).
    """

    x_rows: torch.Tensor
    g_rows: torch.Tensor
    u_rows: torch.Tensor
    y_rows: torch.Tensor
    w_rows: torch.Tensor
    shared_g: torch.Tensor | None
    shared_u: torch.Tensor | None


class ReferenceBackend:
    name = "reference"

    @staticmethod
    def workspace_bytes(**shape) -> int:
        return 0

    def allocate(self, ws: MoKWorkspace) -> None:
        return None

    def build_schedule(
        self, ws: MoKWorkspace, topk_experts: torch.Tensor, router_weights=None
    ) -> MoKSchedule:
        """Gather the routing (with the router weights when given: one gather) and plan."""
        padded = _pad_rows(topk_experts, ws.num_local_tokens, -1)
        sched = build_schedule_from_global(
            _all_gather(padded, ws, "schedule: routing all-gather"),
            rank=ws.rank,
            num_tokens=topk_experts.shape[0],
            num_experts=ws.num_experts,
            num_local_experts=ws.num_local_experts,
            row_capacity=ws.row_capacity,
            token_capacity=ws.token_capacity,
        )
        if router_weights is not None:
            sched.global_weights = _gather_weights(router_weights, sched, ws, "schedule")
            sched.weights_source = (router_weights, router_weights._version)
        return sched

    def forward(self, ws, sched, x, router_weights, shared, routed, save: bool = True):
        fp8 = ws.config.expert_precision == "fp8_blockwise"
        if fp8:
            from .fp8_weights import check_fp8_sizes

            check_fp8_sizes(x.shape[-1], routed.down.shape[-1])
        cdt = compute_dtype(x.dtype)
        x_rows = _pull_rows(x.to(cdt), sched, ws, "forward: dispatch")
        if sched.gathered_weights_match(router_weights):
            global_weights = sched.global_weights
        else:
            global_weights = _gather_weights(router_weights, sched, ws, "forward")
        w_rows = _row_values(global_weights, sched).to(cdt)
        if fp8:
            g, u, y = _fp8_experts(x_rows, routed, sched.row_expert, cdt)
        else:
            wg, wu, wd = (w.to(cdt) for w in _split_form(routed))
            g = _grouped_linear(x_rows, wg, sched.row_expert)
            u = _grouped_linear(x_rows, wu, sched.row_expert)
            y = _grouped_linear(F.silu(g) * u, wd, sched.row_expert)
        out = _push_and_sum(y * w_rows[:, None], sched, ws, "forward: combine")[: sched.num_tokens]
        shared_g = shared_u = None
        if shared is not None:
            sg, su, sd = (w.to(cdt) for w in shared)
            shared_g, shared_u = x.to(cdt) @ sg.T, x.to(cdt) @ su.T
            out = out + (F.silu(shared_g) * shared_u) @ sd.T
        ctx = ReferenceContext(x_rows, g, u, y, w_rows, shared_g, shared_u)
        return out.to(x.dtype), ctx

    def backward(self, ws, sched, ctx, d_out, x, router_weights, shared, routed, wgrad_acc=None):
        """``wgrad_acc``: the routed weights' accumulators (``api.backward``'s
        wgrad_accumulators, in the weights' form) or None."""
        cdt = compute_dtype(x.dtype)
        wg, wu, wd = (w.to(cdt) for w in _split_form(routed))
        d_rows = _pull_rows(d_out.to(cdt), sched, ws, "backward: dispatch")
        d_w_rows = (d_rows * ctx.y_rows).sum(-1)
        dy = d_rows * ctx.w_rows[:, None]
        silu_g = F.silu(ctx.g_rows)
        a = silu_g * ctx.u_rows
        fp8_dgrad = ws.config.fp8_backward == "dgrad"
        # the data gradients' operands: as they are, or (fp8_dgrad) through FP8 as on CUDA
        dgrad_w = _fp8_weights(routed, cdt) if fp8_dgrad else (wg, wu, wd)
        dy_in = _fp8_dgrad_rows(dy, cdt) if fp8_dgrad else dy
        da = _grouped_linear(dy_in, dgrad_w[2].transpose(1, 2), sched.row_expert)
        d_wd = _grouped_wgrad(dy, a, sched.row_expert, ws.num_local_experts)
        g_rows, u_rows = ctx.g_rows, ctx.u_rows
        if fp8_dgrad:  # what the CUDA SwiGLU backward reads: the GEMM's bf16 da, the bf16 h
            da, g_rows, u_rows = (t.to(torch.bfloat16).to(cdt) for t in (da, g_rows, u_rows))
        dg, du = _swiglu_backward(da, g_rows, u_rows)
        dg_in, du_in = _fp8_dgrad_gate_up(dg, du, cdt) if fp8_dgrad else (dg, du)
        dx_rows = _grouped_linear(dg_in, dgrad_w[0].transpose(1, 2), sched.row_expert)
        dx_rows = dx_rows + _grouped_linear(du_in, dgrad_w[1].transpose(1, 2), sched.row_expert)
        d_wg = _grouped_wgrad(dg, ctx.x_rows, sched.row_expert, ws.num_local_experts)
        d_wu = _grouped_wgrad(du, ctx.x_rows, sched.row_expert, ws.num_local_experts)
        d_x = _push_and_sum(dx_rows, sched, ws, "backward: combine")[: sched.num_tokens]
        d_rw = _push_slot_values(d_w_rows, sched, ws, "backward: router weights")[
            : sched.num_tokens
        ]
        d_shared = (None, None, None)
        if shared is not None:
            d_x, d_shared = _shared_backward(d_out.to(cdt), x.to(cdt), ctx, shared, d_x, cdt)
        if isinstance(routed, FusedExpertWeights):
            from mok_megatron.ops.grouped_gemm import interleave_gate_up

            d_wg, d_wu = interleave_gate_up(d_wg, d_wu), None
        if wgrad_acc is not None:
            has_rows = _experts_with_rows(sched)
            grads = (d_wg, d_wd) if d_wu is None else (d_wg, d_wu, d_wd)  # the accumulators' form
            for acc, grad in zip(wgrad_acc, grads):
                _accumulate(acc, grad, has_rows)
            d_wg = d_wu = d_wd = None
        return MoKGradients(
            d_x=d_x.to(x.dtype),
            d_router_weights=d_rw.to(router_weights.dtype),
            d_w_routed_gate=d_wg,
            d_w_routed_up=d_wu,
            d_w_routed_down=d_wd,
            d_w_shared_gate=d_shared[0],
            d_w_shared_up=d_shared[1],
            d_w_shared_down=d_shared[2],
        )


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _split_form(routed) -> ExpertWeights:
    """The (gate, up, down) weights, de-interleaving the fused gate/up form."""
    if isinstance(routed, FusedExpertWeights):
        from mok_megatron.ops.grouped_gemm import deinterleave_gate_up

        return ExpertWeights(*deinterleave_gate_up(routed.gate_up, dim=-2), routed.down)
    return routed


# ------------------------------------------------------------------- blockwise FP8 forward
def _fp8_experts(x_rows: torch.Tensor, routed, row_expert: torch.Tensor, cdt: torch.dtype):
    """(g, u, y) of the routed experts as the CUDA FP8 path computes them (ops.grouped_gemm_fp8):
    rows and act in (1, 128) blocks, weights in (128, 128) blocks, products in ``cdt``."""
    from mok_megatron.ops.fp8_blockwise import BLOCK

    wg, wu, wd = _fp8_weights(routed, cdt)
    x_q = _fp8_round_trip(x_rows, (1, BLOCK), cdt)
    g = _grouped_linear(x_q, wg, row_expert)
    u = _grouped_linear(x_q, wu, row_expert)
    act = (F.silu(g) * u).to(torch.bfloat16)  # the L1 kernel writes act in bf16, then quantises
    y = _grouped_linear(_fp8_round_trip(act, (1, BLOCK), cdt), wd, row_expert)
    return g, u, y


def _fp8_weights(routed, cdt: torch.dtype) -> ExpertWeights:
    """The routed weights through FP8 in (128, 128) blocks, gate/up quantised in the fused
    interleaved form (the blocks the CUDA path scales), then de-interleaved."""
    from mok_megatron.ops.grouped_gemm import deinterleave_gate_up, interleave_gate_up

    if isinstance(routed, FusedExpertWeights):
        gate_up = routed.gate_up
    else:
        gate_up = interleave_gate_up(routed.gate, routed.up)
    wg, wu = deinterleave_gate_up(_fp8_weight(gate_up, cdt), dim=-2)
    return ExpertWeights(wg, wu, _fp8_weight(routed.down, cdt))


def _fp8_weight(w: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """A weight through FP8 in (128, 128) blocks: its kept FP8 copy (``fp8_weights``: the
    caller's own quantisation when it passed one, made once per update otherwise; the CUDA path
    reads the same copy), or, for float64 weights the quantiser does not take, a fresh one."""
    from mok_megatron.ops.fp8_blockwise import BLOCK, fp8_blockwise_dequantize_exact

    from .fp8_weights import fp8_weight

    if w.dtype == torch.float64:
        return _fp8_round_trip(w, (BLOCK, BLOCK), cdt)
    return fp8_blockwise_dequantize_exact(fp8_weight(w)).to(cdt)


def _fp8_dgrad_rows(rows: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """A data-gradient GEMM's rows as the CUDA path feeds them (``cuda.fp8.dgrad``): rounded to
    bf16 (the tensor it quantises), then through FP8 in (1, 128) blocks."""
    from mok_megatron.ops.fp8_blockwise import BLOCK

    return _fp8_round_trip(rows.to(torch.bfloat16), (1, BLOCK), cdt)


def _fp8_dgrad_gate_up(dg: torch.Tensor, du: torch.Tensor, cdt: torch.dtype):
    """(d_g, d_u) [C, I] as the CUDA L1 dgrad reads them: d_h [C, 2I] interleaved (gate and up
    columns in blocks of 8), bf16, through FP8 in (1, 128) blocks along 2I, split again."""
    from mok_megatron.ops.grouped_gemm import deinterleave_gate_up, interleave_gate_up

    d_h = interleave_gate_up(dg.T, du.T).T  # the weights' row interleave, on columns
    return deinterleave_gate_up(_fp8_dgrad_rows(d_h, cdt), dim=-1)


def _fp8_round_trip(t: torch.Tensor, block: tuple[int, int], cdt: torch.dtype) -> torch.Tensor:
    """``t`` quantised to blockwise FP8 from its float32 values (bf16 converts exactly; the
    quantiser takes no float64), dequantised exactly, in ``cdt``."""
    from mok_megatron.ops.fp8_blockwise import (
        fp8_blockwise_dequantize_exact,
        fp8_blockwise_quantize_reference,
    )

    q = fp8_blockwise_quantize_reference(t.float().contiguous(), block)
    return fp8_blockwise_dequantize_exact(q).to(cdt)


# ----------------------------------------------------------------------------------- math
def _grouped_linear(rows: torch.Tensor, weight: torch.Tensor, row_expert: torch.Tensor):
    """rows: [C, in], weight: [E_l, out, in] → [C, out]; row i uses weight[row_expert[i]].

    Unused rows (row_expert == E_l) give zeros. A dense product per expert keeps shapes fixed.
    """
    out = rows.new_zeros(rows.shape[0], weight.shape[1])
    for e in range(weight.shape[0]):
        out = torch.where((row_expert == e)[:, None], rows @ weight[e].T, out)
    return out


def _grouped_wgrad(d_rows: torch.Tensor, in_rows: torch.Tensor, row_expert, num_experts: int):
    """Σ over each expert's rows of d_rowᵀ · in_row → [E_l, out, in], rows in schedule order."""
    grads = []
    for e in range(num_experts):
        mask = (row_expert == e)[:, None]
        grads.append(torch.where(mask, d_rows, 0).T @ torch.where(mask, in_rows, 0))
    return torch.stack(grads)


def _experts_with_rows(sched: MoKSchedule) -> torch.Tensor:
    """[E_l] bool: the local experts that received at least one row (no host sync)."""
    experts = torch.arange(sched.num_local_experts, device=sched.row_expert.device)
    return (sched.row_expert[None, :] == experts[:, None]).any(1)


def _accumulate(acc: torch.Tensor, grad: torch.Tensor, has_rows: torch.Tensor) -> None:
    """acc [E_l, ...] += grad in acc's dtype, on the experts with rows only. NOTE: the others add
    -0.0, which leaves every value as it is (x + -0.0 == x, even for x = -0.0 or NaN); +0.0 would
    turn a -0.0 into +0.0."""
    mask = has_rows.view(-1, *([1] * (grad.dim() - 1)))
    acc.add_(torch.where(mask, grad, -0.0).to(acc.dtype))


def _swiglu_backward(da: torch.Tensor, g: torch.Tensor, u: torch.Tensor):
    """d/dg and d/du of silu(g) * u, given d/da."""
    sig = torch.sigmoid(g)
    dg = da * u * sig * (1 + g * (1 - sig))
    du = da * g * sig
    return dg, du


def _shared_backward(d_out, x, ctx: ReferenceContext, shared: ExpertWeights, d_x, cdt):
    sg, su, sd = (w.to(cdt) for w in shared)
    a = F.silu(ctx.shared_g) * ctx.shared_u
    da = d_out @ sd
    dg, du = _swiglu_backward(da, ctx.shared_g, ctx.shared_u)
    d_x = d_x + dg @ sg + du @ su
    return d_x, (dg.T @ x, du.T @ x, d_out.T @ a)


# ---------------------------------------------------------------------------- data movement
def _pull_rows(values: torch.Tensor, sched: MoKSchedule, ws: MoKWorkspace, phase: str):
    """values: [T, H] local → [C, H] in schedule row order (each token pulled once per rank)."""
    every = _all_gather(_pad_rows(values, sched.max_tokens, 0), ws, phase).flatten(0, 1)
    tokens = every[sched.recv_token_src.clamp(min=0)]
    return tokens[sched.row_token_idx.clamp(min=0)]


def _row_values(per_slot: torch.Tensor, sched: MoKSchedule) -> torch.Tensor:
    """per_slot: [W, T_max, K] → [C], the value of each row's (s, t, k); 0 for unused rows."""
    flat = (sched.row_src_rank * sched.max_tokens + sched.row_src_token) * sched.topk
    flat = (flat + sched.row_src_slot).clamp(min=0)
    return torch.where(sched.row_expert < sched.num_local_experts, per_slot.flatten()[flat], 0)


def _push_and_sum(rows: torch.Tensor, sched: MoKSchedule, ws: MoKWorkspace, phase: str):
    """rows: [C, H] → [T_max, H] at the sources: Σ_k on the expert side, then Σ over ranks."""
    per_token = rows.new_zeros(sched.token_capacity, rows.shape[1])
    for k in range(sched.topk):
        idx = sched.token_rows[:, k]
        per_token = per_token + torch.where((idx >= 0)[:, None], rows[idx.clamp(min=0)], 0)
    pos = sched.recv_token_pos
    parts = torch.where((pos >= 0)[:, None], per_token[pos.clamp(min=0)], 0)
    received = _exchange(parts.view(sched.num_ranks, sched.max_tokens, -1), ws, phase)
    out = rows.new_zeros(sched.max_tokens, rows.shape[1])
    for d in range(sched.num_ranks):
        out = out + torch.where(sched.send_to[:, d, None], received[d], 0)
    return out


def _push_slot_values(row_values: torch.Tensor, sched: MoKSchedule, ws: MoKWorkspace, phase: str):
    """row_values: [C] → [T_max, K] at the sources (each slot lives on exactly one rank)."""
    pos = sched.recv_token_pos
    slot_rows = sched.token_rows[pos.clamp(min=0)]
    here = (pos >= 0)[:, None] & (slot_rows >= 0)
    parts = torch.where(here, row_values[slot_rows.clamp(min=0)], 0)
    received = _exchange(parts.view(sched.num_ranks, sched.max_tokens, -1), ws, phase)
    out = row_values.new_zeros(sched.max_tokens, sched.topk)
    for d in range(sched.num_ranks):
        out = out + received[d]
    return out


def _gather_weights(router_weights: torch.Tensor, sched: MoKSchedule, ws: MoKWorkspace,
                    phase: str):  # fmt: skip
    """Every rank's router weights, [W, T_max, K], 0 padded."""
    return _all_gather(
        _pad_rows(router_weights, sched.max_tokens, 0), ws, f"{phase}: router weights"
    )


def _pad_rows(t: torch.Tensor, rows: int, value) -> torch.Tensor:
    if t.shape[0] == rows:
        return t.contiguous()
    pad = t.new_full((rows - t.shape[0], *t.shape[1:]), value)
    return torch.cat([t, pad])


def _all_gather(t: torch.Tensor, ws: MoKWorkspace, phase: str) -> torch.Tensor:
    """[n, ...] → [W, n, ...] from every rank of the workspace's group."""
    if ws.num_ranks == 1:
        return t.unsqueeze(0)
    comm = t.to(_comm_device(ws))
    out = comm.new_empty((ws.num_ranks * t.shape[0], *t.shape[1:]))
    _wait_for_ranks(ws, phase)
    dist.all_gather_into_tensor(out, comm.contiguous(), group=ws.group)
    return out.view(ws.num_ranks, *t.shape).to(t.device)


def _exchange(t: torch.Tensor, ws: MoKWorkspace, phase: str) -> torch.Tensor:
    """[W, ...] with block d meant for rank d → [W, ...] with block s received from rank s."""
    if ws.num_ranks == 1:
        return t
    comm = t.to(_comm_device(ws)).contiguous()
    out = torch.empty_like(comm)
    _wait_for_ranks(ws, phase)
    dist.all_to_all_single(out, comm, group=ws.group)
    return out.to(t.device)


def _wait_for_ranks(ws: MoKWorkspace, phase: str) -> None:
    """Every rank at ``phase`` within wait_timeout_ms, or an error that names it (gloo)."""
    from .rank_wait import wait_for_ranks

    wait_for_ranks(ws.group, ws.config.wait_timeout_ms, phase)


def _comm_device(ws: MoKWorkspace) -> torch.device:
    return ws.device if dist.get_backend(ws.group) == "nccl" else torch.device("cpu")
