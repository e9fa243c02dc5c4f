"""Blockwise-FP8 grouped GEMMs of the MoE expert MLP on Hopper (issue 15):
``torch.ops.mok.grouped_gemm_fp8_*``.

The DeepSeek-V3 / Megatron ``--fp8-recipe blockwise`` recipe: E4M3 operands, activations with one
float32 scale per row and 128-element K block (:mod:`ops.fp8_blockwise`'s ``(1, 128)`` form),
weights with one per 128 x 128 block; wgmma partial sums promoted into float32 accumulators once
per 128-K block, each multiplied by its two scales. Groups and ``offs`` as
:mod:`ops.grouped_gemm` (int32 END rows on the device; never read by the host). Deterministic:
every output tile is reduced by one CTA over K in a fixed order.

==================================  =========================================================
``grouped_gemm_fp8_nt``             a (1,128) [R,K], w [G,N,K] -> bf16 a @ w[g]^T [R,N]   (L2)
``grouped_gemm_fp8_l1_swiglu``      x (1,128) [R,H], w_gu [G,2I,H] -> act as (1,128) FP8 [R,I]
                                    (+ bf16 act, h if asked)                              (L1)
==================================  =========================================================

The L1 op returns its output quantised for the L2: ``act = silu(g) * u`` (bf16) cut into
``(1, 128)`` blocks, bit for bit what :func:`~mok_megatron.ops.fp8_blockwise.fp8_blockwise_quantize`
gives for that bf16 act. It is two kernels, the GEMM (SwiGLU in its epilogue) and the row-block
quantiser: an in-epilogue quantisation needs a row's 256 h columns in one CTA, and the FP8 tile
is 128 wide (csrc/include/mok/roles/grouped_gemm_fp8_config.cuh says why). w_gu is gate/up
interleaved in blocks of 8 rows (:func:`~mok_megatron.ops.grouped_gemm.interleave_gate_up`).

Weights are :class:`~mok_megatron.ops.fp8_blockwise.FP8BlockTensor` s in ``(128, 128)`` blocks
(:func:`fp8_gemm_weight`); make them once per weight update.

:func:`grouped_gemm_fp8_reference` is the pure-PyTorch reference (dequantise, then matmul in
float64 or float32), any device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mok_megatron.ops._extension import has_op
from mok_megatron.ops.fp8_blockwise import (
    BLOCK,
    FP8BlockTensor,
    fp8_blockwise_dequantize_exact,
    fp8_blockwise_quantize,
)
from mok_megatron.ops.grouped_gemm import GemmTuning, _tuning_args

__all__ = [
    "FP8L1Output",
    "fp8_gemm_weight",
    "grouped_gemm_fp8_available",
    "grouped_gemm_fp8_l1_swiglu",
    "grouped_gemm_fp8_nt",
    "grouped_gemm_fp8_reference",
]


def fp8_gemm_weight(w: torch.Tensor | FP8BlockTensor, pow2_scales: bool = False) -> FP8BlockTensor:
    """A grouped weight ``w: [G, N, K]`` (bf16 / fp16 / fp32; N and K multiples of 128)
    quantised in (128, 128) blocks (or one already so, checked): data ``[G, N, K]`` e4m3,
    scales ``[G, N/128, K/128]``."""
    t = (
        w
        if isinstance(w, FP8BlockTensor)
        else fp8_blockwise_quantize(w, (BLOCK, BLOCK), pow2_scales)
    )
    if tuple(t.block) != (BLOCK, BLOCK) or t.data.dim() != 3:
        raise ValueError(
            f"fp8_gemm_weight: need a [G, N, K] weight in (128, 128) blocks, got data "
            f"{tuple(t.data.shape)} in blocks {tuple(t.block)}"
        )
    return t


def grouped_gemm_fp8_available() -> bool:
    """True when the CUDA extension provides the FP8 grouped-GEMM ops."""
    return has_op("grouped_gemm_fp8_nt_out") and has_op("grouped_gemm_fp8_l1_swiglu_out")


def _check_act(a: FP8BlockTensor, op: str) -> None:
    if tuple(a.block) != (1, BLOCK):
        raise ValueError(
            f"{op}: the activations must be quantised in (1, 128) blocks, got {tuple(a.block)}; "
            "use ops.fp8_blockwise_quantize(x, (1, 128))"
        )


def grouped_gemm_fp8_nt(
    a: FP8BlockTensor, w: FP8BlockTensor, offs: torch.Tensor, tuning: GemmTuning | None = None
) -> torch.Tensor:
    """a: (1, 128)-quantised ``[R, K]``, w: ``[G, N, K]`` -> bf16 ``[R, N]``, group g's rows
    times ``dequant(w[g])^T`` (the FP8 L2 forward)."""
    _check_act(a, "grouped_gemm_fp8_nt")
    out = torch.empty(a.data.shape[0], w.data.shape[1], dtype=torch.bfloat16, device=a.data.device)
    torch.ops.mok.grouped_gemm_fp8_nt_out(
        a.data, a.scales, w.data, w.scales, offs, out, *_tuning_args(tuning)
    )
    return out


class FP8L1Output(NamedTuple):
    """act quantised (the FP8 L2's input), and the bf16 act and h when asked for."""

    act_q: FP8BlockTensor
    act: torch.Tensor | None
    h: torch.Tensor | None


def grouped_gemm_fp8_l1_swiglu(
    x: FP8BlockTensor, w_gu: FP8BlockTensor, offs: torch.Tensor, save_act: bool = False,
    save_h: bool = False, pow2_scales: bool = False, tuning: GemmTuning | None = None,
) -> FP8L1Output:  # fmt: skip
    """x: (1, 128)-quantised ``[R, H]``, w_gu: ``[G, 2I, H]`` (gate/up interleaved; I a multiple
    of 128) -> act = silu(g) * u as (1, 128) FP8 ``[R, I]`` (``pow2_scales``: power-of-two
    scales), plus bf16 act ``[R, I]`` / h ``[R, 2I]`` when asked. Cooperative schedule only."""
    _check_act(x, "grouped_gemm_fp8_l1_swiglu")
    rows, inter, dev = x.data.shape[0], w_gu.data.shape[1] // 2, x.data.device
    act_q = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=dev)
    act_q_scales = torch.empty(rows, inter // BLOCK, dtype=torch.float32, device=dev)
    act = torch.empty(rows, inter, dtype=torch.bfloat16, device=dev) if save_act else None
    h = torch.empty(rows, 2 * inter, dtype=torch.bfloat16, device=dev) if save_h else None
    torch.ops.mok.grouped_gemm_fp8_l1_swiglu_out(
        x.data, x.scales, w_gu.data, w_gu.scales, offs, act_q, act_q_scales, act, h,
        pow2_scales, *_tuning_args(tuning),
    )  # fmt: skip
    return FP8L1Output(FP8BlockTensor(act_q, act_q_scales, (1, BLOCK)), act, h)


def grouped_gemm_fp8_reference(
    a: FP8BlockTensor, w: FP8BlockTensor, offs: torch.Tensor,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:  # fmt: skip
    """``dequant(a)`` group g's rows times ``dequant(w[g])^T`` in ``dtype`` (float64: the
    oracle); rows at or past ``offs[-1]`` are zero. Pure PyTorch, any device (reads offs)."""
    # NOTE: exact in float64, then one rounding to dtype: the product a float32 one would give
    a_f = fp8_blockwise_dequantize_exact(a).to(dtype)
    w_f = fp8_blockwise_dequantize_exact(w).to(dtype)
    out = a_f.new_zeros(a_f.shape[0], w_f.shape[1])
    ends = offs.tolist()
    begin = 0
    for g, end in enumerate(ends):
        if end > begin:
            out[begin:end] = a_f[begin:end] @ w_f[g].transpose(0, 1)
        begin = end
    return out


def _out_fake(*args, **kwargs) -> None:  # the ops write into caller-provided outputs
    return None


for _name in ("grouped_gemm_fp8_nt_out", "grouped_gemm_fp8_l1_swiglu_out"):
    if has_op(_name):
        torch.library.register_fake(f"mok::{_name}")(_out_fake)
