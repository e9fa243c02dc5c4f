"""Blockwise FP8 (E4M3) quantisation, the Hopper FP8 recipe: CUDA op and pure-PyTorch reference.

The format Megatron's ``--fp8-recipe blockwise`` and DeepGEMM use on Hopper (issue 15): a tensor
``x: [..., R, C]`` is cut into blocks of ``block = (BR, BC)`` elements, each with one float32
scale ``s``; ``x ~= data * s`` elementwise, ``data`` float8_e4m3fn with ``x``'s shape.

* ``(1, 128)``: activations, 128 consecutive elements of a row (the GEMM's K axis);
  ``scales: [..., R, C / 128]``.
* ``(128, 1)``: the transposed activation form the weight gradients reduce over (128 rows of
  one column); ``scales: [..., R / 128, C]``.
* ``(128, 128)``: weights; ``scales: [..., R / 128, C / 128]``.

Rules (the CUDA kernel and the reference agree bit for bit)
------------------------------------------------------------
* ``amax = max |x|`` over the block, in float32 (bf16 / fp16 inputs convert exactly).
* A block holding NaN or +-Inf: ``s = NaN`` and every element NaN (``0x7F``).
* An all-zero block: ``s = 1``, zero data (each zero keeps its sign).
* Otherwise, by default: ``s = max(amax / 448, 2^-126)`` (one float32 division, round to
  nearest even; 448 is e4m3's largest finite value; the floor keeps ``s`` a normal float32),
  and ``data = e4m3(clamp(x / s, -448, 448))`` (one float32 division, then round to nearest
  even into e4m3). Subnormals are never flushed.
* With ``pow2_scales``: ``s = 2^e`` for the smallest integer ``e`` with ``amax <= 448 * 2^e``
  (exact, from the float32 bits, as MXFP8's exponent; clamped to ``[-126, 120]``, where 120
  covers every finite float32), and ``data = e4m3(clamp(x * 2^-e, -448, 448))`` (the multiply is
  exact unless it underflows float32's normal range, which e4m3 rounds to zero anyway).
* Dequantisation: ``data.float() * s``.

Round-trip error per element: ``|x - dequant(quant(x))| <= max(2^-4 |x|, 2^-10 s) * (1 + 2^-20)``
(half an e4m3 step: 3 mantissa bits for normals, the subnormal step ``2^-9 s`` below
``2^-6 s``; the factor covers the float32 roundings of ``x / s`` and of the dequantising
product).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from mok_megatron.ops._extension import extension_available, extension_error, has_op

__all__ = [
    "BLOCKS",
    "FP8BlockTensor",
    "fp8_blockwise_dequantize",
    "fp8_blockwise_dequantize_exact",
    "fp8_blockwise_quantize",
    "fp8_blockwise_quantize_reference",
    "requantize_mxfp8",
]

BLOCK = 128
#: The block shapes (rows, cols) the recipe uses: activations, their transposed form, weights.
BLOCKS = ((1, BLOCK), (BLOCK, 1), (BLOCK, BLOCK))
DATA_MAX = 448.0  # largest finite float8_e4m3fn
DATA_NAN = 0x7F
MIN_EXPONENT, MAX_EXPONENT = -126, 120
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

Backend = Literal["auto", "reference", "cuda"]


class FP8BlockTensor(NamedTuple):
    """``data`` float8_e4m3fn (the input's shape), ``scales`` float32 (one per block), and the
    ``block`` shape (rows, cols) they were made with."""

    data: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int]


def _check(x: torch.Tensor, block: tuple[int, int]) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"fp8_blockwise_quantize: x must be a torch.Tensor, got {type(x).__name__}")
    block = tuple(block)
    if block not in BLOCKS:
        raise ValueError(f"fp8_blockwise_quantize: block={block} is not one of {BLOCKS}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"fp8_blockwise_quantize: x.dtype={x.dtype} is not supported; use bfloat16, float16 "
            "or float32"
        )
    if x.dim() < 2:
        raise ValueError(
            f"fp8_blockwise_quantize: x must have at least 2 dims ([..., rows, cols]), got shape "
            f"{tuple(x.shape)}; for a vector use x.unsqueeze(0)"
        )
    if not x.is_contiguous():
        raise ValueError("fp8_blockwise_quantize: x must be contiguous; call x.contiguous() first")
    for size, dim, name in ((block[0], -2, "rows"), (block[1], -1, "cols")):
        if x.shape[dim] % size:
            padded = -(-x.shape[dim] // size) * size
            raise ValueError(
                f"fp8_blockwise_quantize: block={block} needs x.shape[{dim}] ({name}) to be a "
                f"multiple of {size}, got {x.shape[dim]}; pad it to {padded}"
            )
    return block


def scale_shape(shape: torch.Size, block: tuple[int, int]) -> list[int]:
    return [*shape[:-2], shape[-2] // block[0], shape[-1] // block[1]]


# ---------------------------------------------------------------------------------------------
# Reference backend (pure PyTorch, any device): the oracle for the CUDA kernel
# ---------------------------------------------------------------------------------------------


def _pow2_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The smallest e with amax <= 448 * 2^e, from frexp (amax = m 2^x, m in [0.5, 1); 448 =
    0.875 * 2^9), clamped to [MIN_EXPONENT, MAX_EXPONENT]."""
    mantissa, exponent = torch.frexp(amax)
    e = torch.where(mantissa <= 0.875, exponent - 9, exponent - 8)
    return e.clamp(MIN_EXPONENT, MAX_EXPONENT)


def fp8_blockwise_quantize_reference(
    x: torch.Tensor, block: tuple[int, int] = (1, BLOCK), pow2_scales: bool = False
) -> FP8BlockTensor:
    """Pure-PyTorch blockwise FP8 (any device); same contract as :func:`fp8_blockwise_quantize`."""
    return _quantize_reference(x, _check(x, block), pow2_scales)


def _quantize_reference(x: torch.Tensor, block: tuple[int, int], pow2_scales: bool):
    """The reference on an input ``_check`` passed."""
    br, bc = block
    *batch, rows, cols = x.shape
    f = x.float()
    # [..., R/br, br, C/bc, bc]: block (i, j) is [..., i, :, j, :]
    blocks = f.reshape(*batch, rows // br, br, cols // bc, bc)
    # Max of |x| on the bits: NaN and Inf sort above every finite value, so one max finds both.
    amax_bits = (blocks.view(torch.int32) & 0x7FFFFFFF).amax(dim=(-3, -1))
    nonfinite = amax_bits >= 0x7F800000
    amax = torch.where(nonfinite, 0, amax_bits).view(torch.float32)
    zero = amax == 0
    if pow2_scales:
        e = _pow2_exponent(amax)
        scale = ((e + 127) << 23).view(torch.float32)  # 2^e, exact
        inv = ((127 - e) << 23).view(torch.float32)  # 2^-e, exact
        scaled = blocks * inv[..., :, None, :, None]
    else:
        scale = torch.maximum(amax / DATA_MAX, torch.tensor(2.0**-126, device=x.device))
        scaled = blocks / scale[..., :, None, :, None]
    scale = torch.where(zero, 1.0, scale)
    data = scaled.clamp(-DATA_MAX, DATA_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    # a zero block: x / 1 or x * 1 keeps each signed zero; a non-finite block: all NaN
    data = torch.where(nonfinite[..., :, None, :, None], DATA_NAN, data)
    scale = torch.where(nonfinite, float("nan"), scale)
    return FP8BlockTensor(data.view(torch.float8_e4m3fn).reshape(x.shape), scale, block)


# ---------------------------------------------------------------------------------------------
# CUDA backend: torch.ops.mok.fp8_blockwise_quantize (csrc/apis/fp8_blockwise.cpp)
# ---------------------------------------------------------------------------------------------


def _quantize_fake(x: torch.Tensor, block_rows: int, block_cols: int, pow2_scales: bool):
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(
        scale_shape(x.shape, (block_rows, block_cols)), dtype=torch.float32, device=x.device
    )
    return data, scales


def _quantize_out_fake(x, block_rows, block_cols, pow2_scales, data, scales):
    return None


if has_op("fp8_blockwise_quantize"):
    torch.library.register_fake("mok::fp8_blockwise_quantize")(_quantize_fake)
    torch.library.register_fake("mok::fp8_blockwise_quantize_out")(_quantize_out_fake)


def _cuda_op_usable(x: torch.Tensor) -> bool:
    return x.device.type in ("cuda", "meta") and has_op("fp8_blockwise_quantize")


def fp8_blockwise_quantize(
    x: torch.Tensor,
    block: tuple[int, int] = (1, BLOCK),
    pow2_scales: bool = False,
    backend: Backend = "auto",
) -> FP8BlockTensor:
    """Quantise ``x: [..., R, C]`` (bf16 / fp16 / fp32, contiguous) to blockwise FP8.

    ``block``: one of ``BLOCKS`` (module docstring); ``pow2_scales``: power-of-two scales.
    ``backend``: ``"cuda"`` (the kernel; CUDA tensors and the built extension), ``"reference"``
    (pure PyTorch, any device), or ``"auto"``: the kernel for CUDA tensors, the reference for
    CPU ones; a CUDA tensor without the kernel raises rather than running the reference.
    """
    if backend not in ("auto", "reference", "cuda"):
        raise ValueError(f"fp8_blockwise_quantize: backend={backend!r}: auto, reference or cuda")
    block = _check(x, block)
    if backend == "reference" or (backend == "auto" and x.device.type == "cpu"):
        return _quantize_reference(x, block, pow2_scales)
    if not _cuda_op_usable(x):
        why = extension_error() if not extension_available() else "the op is not in the build"
        raise RuntimeError(
            f"fp8_blockwise_quantize: the CUDA kernel can't run for a {x.device} tensor ({why}); "
            "build the extension (pip install -e .) or pass backend='reference'"
        )
    data, scales = torch.ops.mok.fp8_blockwise_quantize(x, block[0], block[1], pow2_scales)
    return FP8BlockTensor(data, scales, block)


def fp8_blockwise_dequantize(t: FP8BlockTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * s`` per block, in ``dtype`` (computed in float32)."""
    br, bc = t.block
    if list(t.scales.shape) != scale_shape(t.data.shape, t.block):
        raise ValueError(
            f"fp8_blockwise_dequantize: scales.shape={tuple(t.scales.shape)} does not match "
            f"data.shape={tuple(t.data.shape)} with block={t.block}"
        )
    *batch, rows, cols = t.data.shape
    blocks = t.data.float().reshape(*batch, rows // br, br, cols // bc, bc)
    out = blocks * t.scales.float()[..., :, None, :, None]
    return out.reshape(t.data.shape).to(dtype)


def fp8_blockwise_dequantize_exact(t: FP8BlockTensor) -> torch.Tensor:
    """``data * s`` per block in float64, exact (4 + 24 significant bits): the oracles' form
    (:func:`fp8_blockwise_dequantize` rounds the product to float32)."""
    br, bc = t.block
    *batch, rows, cols = t.data.shape
    blocks = t.data.to(torch.float64).reshape(*batch, rows // br, br, cols // bc, bc)
    return (blocks * t.scales.to(torch.float64)[..., :, None, :, None]).reshape(t.data.shape)


def requantize_mxfp8(w, block: tuple[int, int] = (BLOCK, BLOCK), pow2_scales: bool = False,
                     backend: Backend = "auto") -> FP8BlockTensor:  # fmt: skip
    """An MXFP8 weight (``ops.mxfp8_quantize``'s ``MXFP8Weight`` or one ``MXFP8Tensor``; the
    rowwise part when both are there) in this recipe's blocks: its exact value, float32
    ``data * 2^(scale - 127)``, quantised by :func:`fp8_blockwise_quantize` (``backend`` as
    there). The Hopper FP8 GEMMs take no MXFP8 (a scale per 32 elements would need a promotion
    every 32 of K), so an MXFP8 weight runs as this copy (``functional.fp8_weights`` makes it
    once per weight update).

    Error: the requantised value ``q`` of an element whose MXFP8 value is ``v`` obeys the
    module's round-trip bound with ``x = v``: ``|v - q| <= max(2^-4 |v|, 2^-10 s) * (1 + 2^-20)``,
    ``s`` the new block's scale; against the weight ``w`` MXFP8 quantised, add MXFP8's own
    rounding (half an e4m3 step at its 32-element block's power-of-two scale, ``ops.mxfp8``).
    """
    from mok_megatron.ops.mxfp8 import mxfp8_dequantize, mxfp8_part

    try:
        part = mxfp8_part(w)
    except TypeError as e:
        raise TypeError(f"requantize_mxfp8: {e}") from None
    return fp8_blockwise_quantize(mxfp8_dequantize(part, torch.float32).contiguous(), block,
                                  pow2_scales, backend)  # fmt: skip
