"""MXFP8 (OCP microscaling FP8) quantisation of weights: CUDA op and pure-PyTorch reference.

Format
------
A tensor ``w: [..., R, C]`` is cut into blocks of ``BLOCK_SIZE = 32`` consecutive elements along
the reduction axis, and each block shares one scale:

* ``rowwise``: blocks run along the last dim; ``scales: [..., R, C // 32]``; needs ``C % 32 == 0``.
* ``colwise``: blocks run along dim -2; ``scales: [..., R // 32, C]``; needs ``R % 32 == 0``.

``data`` always has ``w``'s shape, dtype ``torch.float8_e4m3fn``. ``scales`` are ``torch.uint8``
holding E8M0: a biased exponent ``s`` with value ``2^(s - 127)``; ``s = 255`` is NaN.

Rules (the CUDA kernel and the reference agree bit for bit)
------------------------------------------------------------
* ``amax = max |x|`` over the block, in float32 (inputs are bf16, fp16 or fp32; converting them
  to float32 is exact).
* The block exponent ``e`` is the smallest integer with ``amax <= 448 * 2^e`` (448 is the largest
  finite e4m3 value), computed exactly from the float32 bits: with ``amax = m * 2^x``,
  ``m in [0.5, 1)`` (frexp), and ``448 = 0.875 * 2^9``, ``e = x - 9`` if ``m <= 0.875`` else
  ``x - 8``; then ``e`` is clamped to ``[-127, 127]`` and stored as ``s = e + 127``. Any finite
  float32 ``amax`` gives ``e <= 120``; tiny blocks (``amax < 448 * 2^-127``) clamp to ``-127``.
* An all-zero block has ``e = 0`` (``s = 127``) and zero data (the sign of each zero is kept).
* A block holding any NaN or +-Inf gets ``s = 255`` and every element NaN (``0x7F``).
* ``data = float8_e4m3fn(clamp(x * 2^-e, -448, 448))``, rounding to nearest, ties to even.
  ``2^-e`` is an exact normal float32 built from its bits, and one float32 multiply by it is
  exact unless the product is below float32's normal range, where it rounds to zero in e4m3
  anyway. Subnormals are never flushed: no fast-math anywhere.
* Dequantisation: ``data.float() * 2^(s - 127)``, NaN where ``s = 255``. (Values within 2^-4
  of float32's maximum may round up to 2^128, which dequantises to inf in float32: ask for
  float64 there.)

Round-trip error: for a block with exponent ``e``, ``|x - dequant(quant(x))| <=
max(2^-4 * |x|, 2^-10 * 2^e)`` (half an e4m3 ulp: 3 mantissa bits for normals, the subnormal step
``2^-9`` below ``2^-6``).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from mok_megatron.ops._extension import extension_available, extension_error, has_op

__all__ = [
    "BLOCK_SIZE",
    "MXFP8Tensor",
    "MXFP8Weight",
    "mxfp8_dequantize",
    "mxfp8_quantize",
    "mxfp8_quantize_reference",
]

BLOCK_SIZE = 32
SCALE_BIAS = 127
SCALE_NAN = 255
DATA_NAN = 0x7F  # float8_e4m3fn NaN
DATA_MAX = 448.0  # largest finite float8_e4m3fn
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

Backend = Literal["auto", "reference", "cuda"]


class MXFP8Tensor(NamedTuple):
    """One quantised direction: ``data`` float8_e4m3fn with the weight's shape, ``scales`` uint8
    E8M0 (``[..., R, C/32]`` rowwise or ``[..., R/32, C]`` colwise)."""

    data: torch.Tensor
    scales: torch.Tensor


class MXFP8Weight(NamedTuple):
    """A weight quantised rowwise (blocks along dim -1), colwise (along dim -2), or both."""

    rowwise: MXFP8Tensor | None
    colwise: MXFP8Tensor | None


def mxfp8_part(w: MXFP8Tensor | MXFP8Weight) -> MXFP8Tensor:
    """The quantised direction an MXFP8 weight is used through: an MXFP8Tensor itself, or of a
    (rowwise, colwise) pair (an MXFP8Weight) the rowwise part when there is one, else the
    colwise part."""
    if isinstance(w, MXFP8Tensor):
        return w
    # NOTE: any (rowwise, colwise) pair, as the functional API takes them, not only MXFP8Weight.
    parts = tuple(w) if isinstance(w, tuple) and len(w) == 2 else ()
    if all(p is None or isinstance(p, MXFP8Tensor) for p in parts) and any(parts):
        return parts[0] if parts[0] is not None else parts[1]
    raise TypeError(f"expected an MXFP8Tensor or MXFP8Weight (one part not None), got {w!r:.80}")


# ---------------------------------------------------------------------------------------------
# Validation (shared by both backends)
# ---------------------------------------------------------------------------------------------


def _check_input(w: torch.Tensor, rowwise: bool, colwise: bool) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"mxfp8_quantize: w must be a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"mxfp8_quantize: w.dtype={w.dtype} is not supported; use bfloat16, float16 or float32"
        )
    if w.dim() < 2:
        raise ValueError(
            f"mxfp8_quantize: w must have at least 2 dims ([..., rows, cols]), got shape "
            f"{tuple(w.shape)}; for a vector use w.unsqueeze(0)"
        )
    if not (rowwise or colwise):
        raise ValueError("mxfp8_quantize: rowwise and colwise are both False; ask for at least one")
    if not w.is_contiguous():
        raise ValueError("mxfp8_quantize: w must be contiguous; call w.contiguous() first")
    for wanted, dim, name in ((rowwise, -1, "rowwise"), (colwise, -2, "colwise")):
        if wanted and w.shape[dim] % BLOCK_SIZE != 0:
            size = w.shape[dim]
            padded = -(-size // BLOCK_SIZE) * BLOCK_SIZE
            raise ValueError(
                f"mxfp8_quantize: {name} quantises blocks of {BLOCK_SIZE} along dim {dim}, but "
                f"w.shape[{dim}]={size} is not a multiple of {BLOCK_SIZE}; pad it to {padded}"
            )


# ---------------------------------------------------------------------------------------------
# Reference backend (pure PyTorch, any device): the oracle for the CUDA kernel
# ---------------------------------------------------------------------------------------------


def _quantize_last_dim(x: torch.Tensor) -> MXFP8Tensor:
    """Rowwise MXFP8 of ``x: [..., C]`` float32, ``C % 32 == 0``."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    # Max of |x| on the bits: NaN and Inf sort above every finite value, so one max finds both.
    amax_bits = (blocks.view(torch.int32) & 0x7FFFFFFF).amax(dim=-1)
    nonfinite = amax_bits >= 0x7F800000
    amax = torch.where(nonfinite, 0, amax_bits).view(torch.float32)
    mantissa, exponent = torch.frexp(amax)
    e = torch.where(mantissa <= 0.875, exponent - 9, exponent - 8)
    e = torch.where(amax == 0, 0, e).clamp(-SCALE_BIAS, SCALE_BIAS)
    # 2^-e from its float32 bits: exact and normal, since -127 <= e <= 120 for finite amax.
    inv_scale = ((SCALE_BIAS - e) << 23).view(torch.float32)
    scaled = (blocks * inv_scale.unsqueeze(-1)).clamp(-DATA_MAX, DATA_MAX)
    data = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    data = torch.where(nonfinite.unsqueeze(-1), DATA_NAN, data)
    scales = torch.where(nonfinite, SCALE_NAN, e + SCALE_BIAS).to(torch.uint8)
    return MXFP8Tensor(data.view(torch.float8_e4m3fn).reshape(x.shape), scales)


def mxfp8_quantize_reference(
    w: torch.Tensor, rowwise: bool = True, colwise: bool = False
) -> MXFP8Weight:
    """Pure-PyTorch MXFP8 quantisation (any device); same contract as :func:`mxfp8_quantize`."""
    _check_input(w, rowwise, colwise)
    x = w.float()
    row = _quantize_last_dim(x) if rowwise else None
    col = None
    if colwise:
        t = _quantize_last_dim(x.transpose(-1, -2).contiguous())
        col = MXFP8Tensor(
            t.data.transpose(-1, -2).contiguous(), t.scales.transpose(-1, -2).contiguous()
        )
    return MXFP8Weight(row, col)


# ---------------------------------------------------------------------------------------------
# CUDA backend: torch.ops.mok.mxfp8_quantize (csrc/apis/mxfp8.cpp) and its fake impls
# ---------------------------------------------------------------------------------------------


def _scale_shapes(shape: torch.Size) -> tuple[list[int], list[int]]:
    row = [*shape[:-1], shape[-1] // BLOCK_SIZE]
    col = [*shape[:-2], shape[-2] // BLOCK_SIZE, shape[-1]]
    return row, col


def _mxfp8_quantize_fake(w: torch.Tensor, rowwise: bool, colwise: bool):
    row_shape, col_shape = _scale_shapes(w.shape)
    fp8, u8 = torch.float8_e4m3fn, torch.uint8
    return (
        w.new_empty(w.shape if rowwise else (0,), dtype=fp8),
        w.new_empty(row_shape if rowwise else (0,), dtype=u8),
        w.new_empty(w.shape if colwise else (0,), dtype=fp8),
        w.new_empty(col_shape if colwise else (0,), dtype=u8),
    )


def _mxfp8_quantize_out_fake(w, rowwise, colwise, row_data, row_scales, col_data, col_scales):
    return None


if extension_available():
    torch.library.register_fake("mok::mxfp8_quantize")(_mxfp8_quantize_fake)
    torch.library.register_fake("mok::mxfp8_quantize_out")(_mxfp8_quantize_out_fake)


def _mxfp8_quantize_cuda(w: torch.Tensor, rowwise: bool, colwise: bool) -> MXFP8Weight:
    row_data, row_scales, col_data, col_scales = torch.ops.mok.mxfp8_quantize(w, rowwise, colwise)
    return MXFP8Weight(
        MXFP8Tensor(row_data, row_scales) if rowwise else None,
        MXFP8Tensor(col_data, col_scales) if colwise else None,
    )


def _cuda_op_usable(w: torch.Tensor) -> bool:
    return w.is_cuda and has_op("mxfp8_quantize")


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def mxfp8_quantize(
    w: torch.Tensor,
    rowwise: bool = True,
    colwise: bool = False,
    *,
    backend: Backend = "auto",
) -> MXFP8Weight:
    """Quantise ``w`` to MXFP8 (format and rules in this module's docstring).

    Args:
        w: ``[..., rows, cols]``, bfloat16 / float16 / float32, contiguous (e.g. expert weights
            ``[num_experts, intermediate, hidden]``).
        rowwise: blocks of 32 along dim -1 (``cols % 32 == 0``); scales ``[..., rows, cols/32]``.
        colwise: blocks of 32 along dim -2 (``rows % 32 == 0``); scales ``[..., rows/32, cols]``.
        backend: ``"auto"`` (the CUDA op for CUDA tensors when the extension has it, else the
            reference), ``"reference"``, or ``"cuda"`` (raises if the op cannot run).

    Returns:
        :class:`MXFP8Weight` with ``rowwise`` / ``colwise`` set for the directions asked for.
        The CUDA path never synchronises with the host and can be captured in a CUDA graph.
    """
    _check_input(w, rowwise, colwise)
    if backend == "reference":
        return mxfp8_quantize_reference(w, rowwise, colwise)
    if backend == "cuda":
        if not has_op("mxfp8_quantize"):
            raise RuntimeError(
                "mxfp8_quantize(backend='cuda'): torch.ops.mok.mxfp8_quantize is not available "
                f"({extension_error() or 'the extension has no CUDA kernel for it'}); build it "
                "with `pip install -e . --no-build-isolation` or use backend='reference'"
            )
        if not w.is_cuda:
            raise ValueError(
                f"mxfp8_quantize(backend='cuda'): w is on {w.device}; move it to a CUDA device"
            )
        return _mxfp8_quantize_cuda(w, rowwise, colwise)
    if backend != "auto":
        raise ValueError(
            f"mxfp8_quantize: backend={backend!r} is not one of 'auto', 'reference', 'cuda'"
        )
    if _cuda_op_usable(w):
        return _mxfp8_quantize_cuda(w, rowwise, colwise)
    return mxfp8_quantize_reference(w, rowwise, colwise)


def _scale_values(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E8M0 bytes -> exact powers of two ``2^(s-127)`` (NaN for 255), built from float32 bits."""
    s = scales.to(torch.int32)
    bits = torch.where(s == 0, 0x00400000, s << 23)  # s = 0: 2^-127 is a float32 subnormal
    bits = torch.where(s == SCALE_NAN, 0x7FC00000, bits)
    return bits.view(torch.float32).to(dtype)


def mxfp8_dequantize(t: MXFP8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data.float() * 2^(scales - 127)`` (NaN where a scale is 255), returned as ``dtype``.

    Args:
        t: :class:`MXFP8Tensor`; the direction (rowwise or colwise) follows from the shapes.
        dtype: output dtype; the product is taken in float64 for float64, else in float32.
    """
    data, scales = t
    if data.dim() < 2 or data.dtype != torch.float8_e4m3fn or scales.dtype != torch.uint8:
        raise ValueError(
            "mxfp8_dequantize: expected data float8_e4m3fn [..., R, C] and uint8 scales, got "
            f"{data.dtype} {tuple(data.shape)} and {scales.dtype} {tuple(scales.shape)}"
        )
    row_shape, col_shape = _scale_shapes(data.shape)
    if list(scales.shape) == row_shape and data.shape[-1] % BLOCK_SIZE == 0:
        dim = -1
    elif list(scales.shape) == col_shape and data.shape[-2] % BLOCK_SIZE == 0:
        dim = -2
    else:
        raise ValueError(
            f"mxfp8_dequantize: scales shape {tuple(scales.shape)} fits neither rowwise "
            f"{tuple(row_shape)} nor colwise {tuple(col_shape)} for data {tuple(data.shape)}"
        )
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    scale = _scale_values(scales, compute).repeat_interleave(BLOCK_SIZE, dim=dim)
    return (data.to(compute) * scale).to(dtype)
