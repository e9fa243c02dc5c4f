"""The routed experts' blockwise-FP8 forward on the CUDA backend (MoKConfig.expert_precision =
"fp8_blockwise"; issue 15).

The forward's two expert GEMMs run in FP8 (ops.grouped_gemm_fp8): the rows are quantised in
(1, 128) blocks, L1 + SwiGLU writes act (bf16, kept for the backward) and act in (1, 128) FP8 for
the L2. The backward stays BF16 (stage1.backward on the BF16 weights and the FP8 forward's act
and h): the gradient of the BF16 layer at the FP8 forward's activations.

Weights: the FP8 copies of ``functional.fp8_weights`` (made once per weight update).
"""

from __future__ import annotations

import torch

from ..fp8_weights import fp8_weight, invalidate_fp8_weight_cache
from ..types import FusedExpertWeights

__all__ = ["FP8_DIM_MULTIPLE", "check_fp8_experts", "fp8_weight", "forward",
           "invalidate_fp8_weight_cache"]  # fmt: skip

#: Hidden and intermediate sizes must be multiples of this: the FP8 scale blocks.
FP8_DIM_MULTIPLE = 128


def check_fp8_experts(routed, device: torch.device) -> None:
    """Raise, naming the rule, unless the FP8 expert GEMMs can run these weights here."""
    from mok_megatron.ops.grouped_gemm_fp8 import grouped_gemm_fp8_available

    if not isinstance(routed, FusedExpertWeights):
        raise ValueError(
            "MoKConfig.expert_precision='fp8_blockwise' on the CUDA backend takes the fused "
            "gate/up weights (gate_up [E_l, 2I, H] interleaved, None, down): MoKExperts' form, "
            "ops.interleave_gate_up makes it"
        )
    inter, hidden = routed.gate_up.shape[1] // 2, routed.gate_up.shape[2]
    if hidden % FP8_DIM_MULTIPLE or inter % FP8_DIM_MULTIPLE:
        raise ValueError(
            f"MoKConfig.expert_precision='fp8_blockwise' needs hidden (H={hidden}) and "
            f"intermediate (I={inter}) sizes that are multiples of {FP8_DIM_MULTIPLE} (the FP8 "
            "scale blocks); pad them or use expert_precision='bf16'"
        )
    why = None
    if not grouped_gemm_fp8_available():
        why = "mok_megatron._C lacks the FP8 grouped-GEMM ops"
    elif device.type != "cuda":
        why = f"the device is {device}, not a CUDA GPU"
    elif torch.cuda.get_device_capability(device) != (9, 0):
        major, minor = torch.cuda.get_device_capability(device)
        why = f"they are built for sm_90a and this GPU is sm_{major}{minor}"
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
