"""The routed experts' blockwise-FP8 forward on the CUDA backend (MoKConfig.expert_precision =
"fp8_blockwise"; issue 15).

The forward's two expert GEMMs run in FP8 (ops.grouped_gemm_fp8): the tokens are quantised in
(1, 128) blocks at their source and dispatched in FP8 (``dispatch_tokens``, ``gather_rows``;
where the backward recomputes from the received tokens, with macrobatch rounds, the bf16 tokens
are dispatched and the rows quantised after the gather), L1 + SwiGLU writes act (bf16, kept for
the backward) and act in (1, 128) FP8 for the L2. The backward is BF16 (stage1.backward on the BF16 weights and the FP8 forward's act
and h: the gradient of the BF16 layer at the FP8 forward's activations), except, with
MoKConfig.fp8_backward="dgrad", its two data-gradient GEMMs (``dgrad``): the rows quantised in
(1, 128) blocks, times the weights' FP8 copies transposed.

Weights: the FP8 copies of ``functional.fp8_weights`` (made once per weight update).
"""

from __future__ import annotations

import torch

from ..fp8_weights import check_fp8_sizes, fp8_weight, fp8_weight_transposed
from ..types import FusedExpertWeights
from .experts import not_hopper

__all__ = ["check_fp8_experts", "dispatch_tokens", "gather_rows", "forward", "dgrad"]


def check_fp8_experts(routed, device: torch.device) -> None:
    """Raise, naming the rule, unless the FP8 expert GEMMs can run these weights here."""
    from mok_megatron.ops.grouped_gemm_fp8 import grouped_gemm_fp8_available

    if not isinstance(routed, FusedExpertWeights):
        raise ValueError(
            "MoKConfig.expert_precision='fp8_blockwise' on the CUDA backend takes the fused "
            "gate/up weights (gate_up [E_l, 2I, H] interleaved, None, down): MoKExperts' form, "
            "ops.interleave_gate_up makes it"
        )
    check_fp8_sizes(routed.gate_up.shape[2], routed.gate_up.shape[1] // 2)
    why = not_hopper(device)
    if not grouped_gemm_fp8_available():
        why = "mok_megatron._C lacks the FP8 grouped-GEMM ops"
    if why is not None:
        raise RuntimeError(
            f"MoKConfig.expert_precision='fp8_blockwise' but the FP8 expert GEMMs can't run: "
            f"{why}; use expert_precision='bf16' (or the reference backend, which emulates FP8)"
        )


def dispatch_tokens(x: torch.Tensor, recv_token_src: torch.Tensor, comm) -> torch.Tensor:
    """The tokens x [T, H] quantised in (1, 128) blocks here, at their source, and dispatched
    as packed FP8 rows (``ops.moe.moe_fp8_pack_rows``: about half the bf16 bytes) → recv
    [C_tok, W] bf16-typed packed rows, for ``gather_rows``. Collective, as ``moe_dispatch``.
    A row's quantisation depends on that row alone, so this gives bit for bit what quantising
    the gathered bf16 rows gives, for 1/top-k of the rows."""
    from mok_megatron.ops import fp8_blockwise as fb
    from mok_megatron.ops import moe as mops

    q = fb.fp8_blockwise_quantize(x.contiguous(), (1, fb.BLOCK))
    return mops.moe_dispatch(mops.moe_fp8_pack_rows(q.data, q.scales), recv_token_src, comm)


def gather_rows(recv: torch.Tensor, row_tok: torch.Tensor, hidden: int):
    """The expert rows of ``dispatch_tokens``' packed tokens → an (1, 128) FP8BlockTensor
    [P, H] (padding rows: an all-zero row's quantisation)."""
    from mok_megatron.ops import fp8_blockwise as fb
    from mok_megatron.ops import moe as mops

    data, scales = mops.moe_gather_rows_fp8(recv, row_tok, hidden)
    return fb.FP8BlockTensor(data, scales, (1, fb.BLOCK))


def forward(routed, x_rows: torch.Tensor | None, offs: torch.Tensor, *, save_pre: bool,
            with_down: bool, x_q=None):  # fmt: skip
    """x_rows [M, H] (or ``x_q``, the rows already quantised: ``gather_rows``) -> (act [M, I]
    bf16, y [M, H] or None, h [M, 2I] or None)."""
    from mok_megatron.ops import fp8_blockwise as fb
    from mok_megatron.ops import grouped_gemm_fp8 as gf

    if x_q is None:
        x_q = fb.fp8_blockwise_quantize(x_rows, (1, fb.BLOCK))
    l1 = gf.grouped_gemm_fp8_l1_swiglu(x_q, fp8_weight(routed.gate_up), offs, save_act=True,
                                       save_h=save_pre)  # fmt: skip
    y = gf.grouped_gemm_fp8_nt(l1.act_q, fp8_weight(routed.down), offs) if with_down else None
    return l1.act, y, l1.h


def dgrad(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """rows [M, K] bf16, weight [G, K, N] (dense; its FP8 copy is read) -> bf16 [M, N], group
    g's rows times ``dequant(weight[g])`` (a data gradient): the rows quantised in (1, 128)
    blocks, the weight's (128, 128) FP8 copy transposed (``fp8_weight_transposed``)."""
    from mok_megatron.ops import fp8_blockwise as fb
    from mok_megatron.ops import grouped_gemm_fp8 as gf

    rows_q = fb.fp8_blockwise_quantize(rows.contiguous(), (1, fb.BLOCK))
    return gf.grouped_gemm_fp8_nt(rows_q, fp8_weight_transposed(weight), offs)
