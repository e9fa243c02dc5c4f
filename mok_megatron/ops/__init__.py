"""Layer 1: thin ``torch.library`` ops over ``mok_megatron._C`` (with fake implementations).

The ``moe_*`` and ``grouped_gemm_*`` ops exist only where the extension provides them (CUDA
tensors); nothing falls back silently: the CUDA backend checks for every op it needs and backend
selection names what is missing. ``mxfp8_quantize`` has a pure-PyTorch path
(``mxfp8_quantize_reference``), which it uses for CPU tensors or without the extension;
``fp8_blockwise_quantize`` uses its reference for CPU tensors only (a CUDA tensor without the
kernel raises).
:func:`extension_available`, :func:`has_op` and :func:`extension_error` say what the extension
offers.
"""

from mok_megatron.ops import moe  # stage-1 expert-parallel MoE ops (and their fakes)
from mok_megatron.ops._extension import extension_available, extension_error, has_op
from mok_megatron.ops.fp8_blockwise import (  # Hopper's blockwise FP8 recipe (issue 15)
    FP8BlockTensor,
    fp8_blockwise_dequantize,
    fp8_blockwise_quantize,
    fp8_blockwise_quantize_reference,
    requantize_mxfp8,
)
from mok_megatron.ops.grouped_gemm import (  # expert GEMM engine (issue 7)
    GemmTuning,
    deinterleave_gate_up,
    grouped_gemm_available,
    grouped_gemm_dswiglu,
    grouped_gemm_l1_swiglu,
    grouped_gemm_nn,
    grouped_gemm_nt,
    grouped_gemm_tn,
    grouped_gemm_tn_accumulate,
    interleave_gate_up,
)
from mok_megatron.ops.grouped_gemm_fp8 import (  # blockwise-FP8 expert GEMMs (issue 15)
    fp8_gemm_weight,
    grouped_gemm_fp8_available,
    grouped_gemm_fp8_l1_swiglu,
    grouped_gemm_fp8_nt,
)
from mok_megatron.ops.mxfp8 import (
    MXFP8Tensor,
    MXFP8Weight,
    mxfp8_dequantize,
    mxfp8_quantize,
    mxfp8_quantize_reference,
)

__all__ = [
    "FP8BlockTensor",
    "GemmTuning",
    "MXFP8Tensor",
    "MXFP8Weight",
    "deinterleave_gate_up",
    "extension_available",
    "extension_error",
    "fp8_blockwise_dequantize",
    "fp8_blockwise_quantize",
    "fp8_blockwise_quantize_reference",
    "requantize_mxfp8",
    "fp8_gemm_weight",
    "grouped_gemm_fp8_available",
    "grouped_gemm_fp8_l1_swiglu",
    "grouped_gemm_fp8_nt",
    "grouped_gemm_available",
    "grouped_gemm_dswiglu",
    "grouped_gemm_l1_swiglu",
    "grouped_gemm_nn",
    "grouped_gemm_nt",
    "grouped_gemm_tn",
    "grouped_gemm_tn_accumulate",
    "has_op",
    "interleave_gate_up",
    "moe",
    "mxfp8_dequantize",
    "mxfp8_quantize",
    "mxfp8_quantize_reference",
]
