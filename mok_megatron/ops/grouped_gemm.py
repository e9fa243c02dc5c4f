"""Grouped (per-expert) GEMMs of the MoE expert MLP on Hopper: ``torch.ops.mok.grouped_gemm_*``.

Groups follow ``torch._grouped_mm``: ``offs`` is int32 ``[G]``, the END row of each group, on the
device (never read by the host: no synchronisation, CUDA-graph safe). Group ``g`` owns rows
``[offs[g-1], offs[g])``; rows at or past ``offs[-1]`` are left unwritten. All matrices are
contiguous bf16; fp32 accumulation; every output tile is reduced by one CTA in a fixed order, so
results are bitwise reproducible.

The L1 weight is stored gate/up *interleaved in blocks of 8 rows* (:func:`interleave_gate_up`),
so one output tile holds matching gate and up columns and SwiGLU runs in the GEMM epilogue;
``h`` (the pre-activation) and ``d_h`` use the same interleaved column order.

Ops (shapes per call; ``R`` rows, ``G`` groups, ``H`` hidden, ``I`` intermediate):

==========================  =============================================================
``grouped_gemm_l1_swiglu``  x [R,H], w_gu [G,2I,H] -> act [R,I] (+ h [R,2I] if asked)
``grouped_gemm_nt``         a [R,K], b [G,N,K] -> a @ b[g]^T [R,N]       (L2 forward)
``grouped_gemm_nn``         a [R,K], b [G,K,N] -> a @ b[g] [R,N]         (L1 dgrad)
``grouped_gemm_dswiglu``    d_y [R,H], w_down [G,H,I], h [R,2I] -> d_h [R,2I] (+ act [R,I])
``grouped_gemm_tn``         a [R,M], b [R,N] -> a_g^T @ b_g [G,M,N]      (weight grads)
==========================  =============================================================
"""

from __future__ import annotations

import torch

from mok_megatron.ops._extension import extension_available, has_op

__all__ = [
    "SWIGLU_INTERLEAVE",
    "deinterleave_gate_up",
    "grouped_gemm_available",
    "grouped_gemm_dswiglu",
    "grouped_gemm_l1_swiglu",
    "grouped_gemm_nn",
    "grouped_gemm_nt",
    "grouped_gemm_tn",
    "interleave_gate_up",
]

#: Gate/up block width (rows of w_gu, columns of h); mirrors mok::gemm::kSwigluInterleave.
SWIGLU_INTERLEAVE = 8


def grouped_gemm_available() -> bool:
    """True when the CUDA extension provides the grouped-GEMM ops."""
    return has_op("grouped_gemm_nt_out")


def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """w_gate, w_up: [..., I, H] -> w_gu: [..., 2I, H], blocks of 8 gate rows then 8 up rows."""
    *lead, inter, hidden = w_gate.shape
    if w_up.shape != w_gate.shape or inter % SWIGLU_INTERLEAVE:
        raise ValueError(
            f"interleave_gate_up: w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} must "
            f"match with I a multiple of {SWIGLU_INTERLEAVE}"
        )
    blocks = inter // SWIGLU_INTERLEAVE
    g = w_gate.reshape(*lead, blocks, 1, SWIGLU_INTERLEAVE, hidden)
    u = w_up.reshape(*lead, blocks, 1, SWIGLU_INTERLEAVE, hidden)
    return torch.cat([g, u], dim=-3).reshape(*lead, 2 * inter, hidden).contiguous()


def deinterleave_gate_up(t: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Split an interleaved tensor (h or d_h along dim -1, w_gu or its grad along dim -2) into
    (gate, up), each with half the size along ``dim`` (contiguous copies)."""
    dim = dim % t.dim()
    two_i = t.shape[dim]
    blocks = two_i // (2 * SWIGLU_INTERLEAVE)
    v = t.reshape(*t.shape[:dim], blocks, 2, SWIGLU_INTERLEAVE, *t.shape[dim + 1 :])
    gate = v.select(dim + 1, 0).reshape(*t.shape[:dim], two_i // 2, *t.shape[dim + 1 :])
    up = v.select(dim + 1, 1).reshape(*t.shape[:dim], two_i // 2, *t.shape[dim + 1 :])
    return gate.contiguous(), up.contiguous()


def grouped_gemm_l1_swiglu(
    x: torch.Tensor, w_gu: torch.Tensor, offs: torch.Tensor, save_h: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [R, H] bf16, w_gu: [G, 2I, H] bf16 (interleaved), offs: [G] int32 ->
    (act [R, I] = silu(gate) * up, h [R, 2I] pre-activation or None)."""
    act = x.new_empty(x.shape[0], w_gu.shape[1] // 2)
    h = x.new_empty(x.shape[0], w_gu.shape[1]) if save_h else None
    torch.ops.mok.grouped_gemm_l1_swiglu_out(x, w_gu, offs, act, h)
    return act, h


def grouped_gemm_nt(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a: [R, K], b: [G, N, K] bf16 -> out [R, N], group g's rows times b[g]^T (L2 forward)."""
    out = a.new_empty(a.shape[0], b.shape[1])
    torch.ops.mok.grouped_gemm_nt_out(a, b, offs, out)
    return out


def grouped_gemm_nn(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a: [R, K], b: [G, K, N] bf16 -> out [R, N], group g's rows times b[g] (L1 dgrad)."""
    out = a.new_empty(a.shape[0], b.shape[2])
    torch.ops.mok.grouped_gemm_nn_out(a, b, offs, out)
    return out


def grouped_gemm_dswiglu(
    d_y: torch.Tensor, w_down: torch.Tensor, h: torch.Tensor, offs: torch.Tensor,
    want_act: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """d_y: [R, H], w_down: [G, H, I], h: [R, 2I] (interleaved) bf16 -> (d_h [R, 2I] interleaved,
    act [R, I] recomputed or None): the L2 dgrad with the SwiGLU backward fused."""
    d_h = d_y.new_empty(d_y.shape[0], 2 * w_down.shape[2])
    act = d_y.new_empty(d_y.shape[0], w_down.shape[2]) if want_act else None
    torch.ops.mok.grouped_gemm_dswiglu_out(d_y, w_down, h, offs, d_h, act)
    return d_h, act


def grouped_gemm_tn(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a: [R, M], b: [R, N] bf16 -> out [G, M, N] = a_g^T @ b_g over each group's rows, in a
    fixed order (zeros for an empty group): the weight gradients."""
    out = a.new_empty(offs.shape[0], a.shape[1], b.shape[1])
    torch.ops.mok.grouped_gemm_tn_out(a, b, offs, out)
    return out


# ------------------------------------------------------------------------------------ fakes
def _out_fake(*args) -> None:  # every op writes into caller-provided outputs
    return None


if extension_available() and grouped_gemm_available():
    for _name in ("l1_swiglu", "nt", "nn", "dswiglu", "tn"):
        torch.library.register_fake(f"mok::grouped_gemm_{_name}_out")(_out_fake)
