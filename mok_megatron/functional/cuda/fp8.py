"""The routed experts' blockwise-FP8 forward on the CUDA backend (MoKConfig.expert_precision =
"fp8_blockwise"; issue 15).

The forward's two expert GEMMs run in FP8 (ops.grouped_gemm_fp8): the rows are quantised in
(1, 128) blocks, L1 + SwiGLU writes act (bf16, kept for the backward) and act in (1, 128) FP8 for
the L2. The backward is BF16 (stage1.backward on the BF16 weights and the FP8 forward's act
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

__all__ = ["check_fp8_experts", "forward", "dgrad"]


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


def forward(routed, x_rows: torch.Tensor, offs: torch.Tensor, *, save_pre: bool,
            with_down: bool):  # fmt: skip
    """x_rows [M, H] -> (act [M, I] bf16, y [M, H] or None, h [M, 2I] or None)."""
    from mok_megatron.ops import fp8_blockwise as fb
    from mok_megatron.ops import grouped_gemm_fp8 as gf

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
