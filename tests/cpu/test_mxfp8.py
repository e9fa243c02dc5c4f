"""MXFP8 quantisation on CPU: the reference against an independent float64 oracle, edge blocks,
round-trip bounds, bad input, and the op's fake (meta) implementation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mok_megatron import ops
from mok_megatron.ops import MXFP8Tensor, mxfp8_dequantize, mxfp8_quantize

BLOCK = 32
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


# ---------------------------------------------------------------------------------------------
# Independent oracle: float64 arithmetic and an e4m3 table built from the format's definition
# ---------------------------------------------------------------------------------------------


def _e4m3_table() -> tuple[np.ndarray, np.ndarray]:
    """Finite non-negative e4m3fn values (ascending) and their codes, from bias 7, 3 mantissa
    bits, subnormals below 2^-6, and 0x7F the only NaN among positive codes."""
    codes = np.arange(0x7F)
    exponent, mantissa = codes >> 3, codes & 7
    values = np.where(
        exponent == 0,
        mantissa / 8.0 * 2.0**-6,
        (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0),
    )
    return values, codes


E4M3_VALUES, E4M3_CODES = _e4m3_table()
assert E4M3_VALUES[-1] == 448.0


def oracle_e4m3(v: np.ndarray) -> np.ndarray:
    """Round float64 ``v`` (|v| <= 448) to e4m3fn codes, nearest with ties to the even code."""
    mag = np.abs(v)
    hi = np.clip(np.searchsorted(E4M3_VALUES, mag, side="left"), 0, len(E4M3_VALUES) - 1)
    lo = np.clip(hi - 1, 0, None)
    d_lo, d_hi = mag - E4M3_VALUES[lo], E4M3_VALUES[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (E4M3_CODES[hi] % 2 == 0))
    code = np.where(pick_hi, E4M3_CODES[hi], E4M3_CODES[lo]).astype(np.uint8)
    return np.where(np.signbit(v), code | 0x80, code).astype(np.uint8)


def oracle_exponent(amax: float) -> int:
    """Smallest integer e with amax <= 448 * 2^e, clamped to [-127, 127]; 0 for amax == 0."""
    if amax == 0.0:
        return 0
    e = math.ceil(math.log2(amax / 448.0))
    while amax > math.ldexp(448.0, e):
        e += 1
    while amax <= math.ldexp(448.0, e - 1):
        e -= 1
    return max(-127, min(127, e))


def oracle_rowwise(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(data codes uint8 [..., C], scale bytes uint8 [..., C/32]) for rowwise blocks."""
    v = x.double().numpy().reshape(-1, BLOCK)
    data = np.empty(v.shape, np.uint8)
    scales = np.empty(v.shape[0], np.uint8)
    for i, block in enumerate(v):
        if not np.all(np.isfinite(block)):
            data[i], scales[i] = 0x7F, 255
            continue
        e = oracle_exponent(float(np.max(np.abs(block))))
        data[i] = oracle_e4m3(np.clip(block * 2.0**-e, -448.0, 448.0))
        scales[i] = e + 127
    return data.reshape(x.shape), scales.reshape(*x.shape[:-1], x.shape[-1] // BLOCK)


def oracle(x: torch.Tensor, rowwise: bool) -> tuple[np.ndarray, np.ndarray]:
    if rowwise:
        return oracle_rowwise(x)
    data, scales = oracle_rowwise(x.transpose(-1, -2).contiguous())
    return data.swapaxes(-1, -2), scales.swapaxes(-1, -2)


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy() if t.dtype == torch.float8_e4m3fn else t.numpy()


def check_against_oracle(w: torch.Tensor, rowwise: bool, colwise: bool, backend="reference"):
    q = mxfp8_quantize(w, rowwise, colwise, backend=backend)
    for wanted, got, is_row in ((rowwise, q.rowwise, True), (colwise, q.colwise, False)):
        if not wanted:
            assert got is None
            continue
        data, scales = oracle(w, is_row)
        assert got.data.dtype == torch.float8_e4m3fn and got.data.shape == w.shape
        assert got.scales.dtype == torch.uint8 and got.scales.shape == scales.shape
        np.testing.assert_array_equal(as_bytes(got.scales), scales)
        np.testing.assert_array_equal(as_bytes(got.data), data)
    return q


def random_weight(shape, dtype, seed=None, spread=20):
    """Normal values with a random power-of-two magnitude per row, so block exponents vary."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    lo, hi = (-spread, spread) if dtype == torch.float32 else (-8, 8)
    mag = torch.randint(lo, hi + 1, (*shape[:-1], 1), generator=g).double()
    return (x * torch.exp2(mag)).to(dtype)


# ---------------------------------------------------------------------------------------------
# Reference against the oracle
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("direction", ["rowwise", "colwise", "both"])
@pytest.mark.parametrize("shape", [(32, 32), (64, 96), (3, 64, 128)])
def test_reference_matches_oracle(dtype, direction, shape):
    w = random_weight(shape, dtype)
    check_against_oracle(w, direction != "colwise", direction != "rowwise")


def test_colwise_is_rowwise_of_transpose():
    w = random_weight((2, 96, 64), torch.bfloat16)
    q = mxfp8_quantize(w, rowwise=False, colwise=True).colwise
    t = mxfp8_quantize(w.transpose(-1, -2).contiguous()).rowwise
    assert torch.equal(q.data.view(torch.uint8), t.data.view(torch.uint8).transpose(-1, -2))
    assert torch.equal(q.scales, t.scales.transpose(-1, -2))


def test_rowwise_allows_rows_not_multiple_of_32():
    check_against_oracle(random_weight((5, 64), torch.float32), True, False)


def test_colwise_allows_cols_not_multiple_of_32():
    check_against_oracle(random_weight((64, 7), torch.float32), False, True)


# ---------------------------------------------------------------------------------------------
# Round trip
# ---------------------------------------------------------------------------------------------


def roundtrip_error_ratio(w: torch.Tensor, t: MXFP8Tensor, rowwise: bool) -> torch.Tensor:
    """|x - dq| / bound, elementwise (must be <= 1), with the bound derived below.

    Element x with block exponent e is stored as q = round_e4m3(x * 2^-e), |x * 2^-e| <= 448.
    For |x * 2^-e| in [2^k, 2^(k+1)), k >= -6 (e4m3 normals), the spacing is 2^(k-3), so the
    error is at most 2^(k-4) <= 2^-4 * |x * 2^-e|; below 2^-6 (subnormals) the spacing is 2^-9
    and the error at most 2^-10. Scaling back by 2^e: |x - dq| <= max(2^-4 |x|, 2^-10 * 2^e).
    Compared in float64: float32 cannot hold 2^128, which FLT_MAX may round to."""
    dq = mxfp8_dequantize(t, torch.float64)
    x = w.double()
    e = (t.scales.double() - 127).repeat_interleave(BLOCK, dim=-1 if rowwise else -2)
    bound = torch.maximum(2.0**-4 * x.abs(), torch.exp2(e - 10))
    return (x - dq).abs() / bound


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rowwise", [True, False])
def test_roundtrip_error_bound(dtype, rowwise):
    w = random_weight((4, 64, 128), dtype)
    q = mxfp8_quantize(w, rowwise, not rowwise)
    ratio = roundtrip_error_ratio(w, q.rowwise if rowwise else q.colwise, rowwise)
    assert ratio.max().item() <= 1.0
    assert ratio.max().item() > 0.5  # and the bound is nearly attained: it is not vacuous


@pytest.mark.parametrize("rowwise", [True, False])
def test_representable_values_roundtrip_exactly(rowwise):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    codes = torch.randint(0, 256, (2, 64, 96), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes; 0x38 is 1.0
    values = codes.view(torch.float8_e4m3fn).double()
    block_shape = (2, 64, 3, 1) if rowwise else (2, 2, 1, 96)
    k = torch.randint(-100, 101, block_shape, generator=g).double()
    if rowwise:
        x = values.reshape(2, 64, 3, 32) * torch.exp2(k)
    else:
        x = values.reshape(2, 2, 32, 96) * torch.exp2(k)
    w = x.reshape(2, 64, 96).float()
    t = mxfp8_quantize(w, rowwise, not rowwise)
    dq = mxfp8_dequantize(t.rowwise if rowwise else t.colwise)
    assert torch.equal(dq, w)


# ---------------------------------------------------------------------------------------------
# Edge blocks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rowwise", [True, False])
def test_all_zero_blocks(rowwise):
    w = random_weight((64, 64), torch.float32)
    w[:32, :32] = 0.0
    w[32:, 32:] = -0.0
    q = check_against_oracle(w, rowwise, not rowwise)
    t = q.rowwise if rowwise else q.colwise
    scales = t.scales.reshape(-1)
    data = t.data.view(torch.uint8)
    blocks_zero = (w == 0).reshape(2, 32, 2, 32).all(-1).all(1)  # quadrants
    assert blocks_zero[0, 0] and blocks_zero[1, 1]
    assert torch.all(data[:32, :32] == 0x00) and torch.all(data[32:, 32:] == 0x80)
    assert (scales == 127).sum() >= 64  # the 2 zero quadrants hold 32 blocks each


@pytest.mark.parametrize("dtype", DTYPES)
def test_huge_values(dtype):
    big = torch.finfo(dtype).max
    w = random_weight((32, 64), dtype)
    w[3, :32] = big
    w[5, 32:40] = -big
    w[7, 40] = big / 3
    q = check_against_oracle(w, True, True)
    if dtype == torch.float32:
        assert q.rowwise.scales[3, 0] == 127 + 120  # the largest exponent a finite block needs
    assert roundtrip_error_ratio(w, q.rowwise, True).max().item() <= 1.0
    assert roundtrip_error_ratio(w, q.colwise, False).max().item() <= 1.0


def test_subnormal_inputs():
    tiny = torch.finfo(torch.float32).tiny  # 2^-126, smallest normal
    w = torch.zeros(64, 64)
    w[0, :32] = torch.linspace(-tiny, tiny, 32) / 3  # a block of subnormals: e clamps to -127
    w[1, :32] = torch.full((32,), 2.0**-149)  # smallest subnormal
    w[2, :32] = torch.randn(32)  # normal block with subnormal neighbours
    w[2, 5], w[2, 6] = 2.0**-140, -(2.0**-145)
    w[3, :32] = torch.full((32,), 2.0**-127)  # scaled by 2^127 is exactly 1.0
    q = check_against_oracle(w, True, True)
    assert q.rowwise.scales[0, 0] == 0 and q.rowwise.scales[1, 0] == 0
    assert q.rowwise.data.view(torch.uint8)[2, 6] == 0x80  # -tiny -> -0 keeps its sign
    assert torch.all(q.rowwise.data[3, :32].float() == 1.0)
    subnormal_bf16 = torch.full((32, 32), 2.0**-130).to(torch.bfloat16)
    check_against_oracle(subnormal_bf16, True, True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_blocks(dtype, bad):
    w = random_weight((64, 96), dtype)
    w[1, 40] = bad  # rowwise block (1, 1); colwise block (0, 40)
    q = check_against_oracle(w, True, True)
    row, col = q.rowwise, q.colwise
    assert row.scales[1, 1] == 255 and torch.all(row.data.view(torch.uint8)[1, 32:64] == 0x7F)
    assert torch.all(row.scales[1, [0, 2]] != 255) and torch.all(row.scales[0] != 255)
    assert col.scales[0, 40] == 255 and torch.all(col.data.view(torch.uint8)[:32, 40] == 0x7F)
    assert (col.scales == 255).sum() == 1 and (row.scales == 255).sum() == 1
    assert torch.isnan(mxfp8_dequantize(row)[1, 32:64]).all()


# ---------------------------------------------------------------------------------------------
# Dequantisation
# ---------------------------------------------------------------------------------------------


def test_dequantize_scale_range():
    data = torch.full((2, 32), 1.0).to(torch.float8_e4m3fn)
    for s, expected in ((0, 2.0**-127), (1, 2.0**-126), (127, 1.0), (254, 2.0**127)):
        scales = torch.full((2, 1), s, dtype=torch.uint8)
        out = mxfp8_dequantize(MXFP8Tensor(data, scales))
        assert torch.all(out == expected), s
    nan = mxfp8_dequantize(MXFP8Tensor(data, torch.full((2, 1), 255, dtype=torch.uint8)))
    assert torch.isnan(nan).all()


def test_dequantize_rejects_mismatched_scales():
    data = torch.zeros(64, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fits neither"):
        mxfp8_dequantize(MXFP8Tensor(data, torch.zeros(64, 3, dtype=torch.uint8)))


# ---------------------------------------------------------------------------------------------
# Bad input and backends
# ---------------------------------------------------------------------------------------------


def test_rejects_dim_not_multiple_of_32():
    with pytest.raises(ValueError, match=r"rowwise .* w.shape\[-1\]=48 .* multiple of 32; pad"):
        mxfp8_quantize(torch.randn(32, 48))
    with pytest.raises(ValueError, match=r"colwise .* w.shape\[-2\]=40 .* pad it to 64"):
        mxfp8_quantize(torch.randn(40, 32), rowwise=False, colwise=True)


def test_rejects_integer_dtype():
    with pytest.raises(TypeError, match="dtype=torch.int32 is not supported"):
        mxfp8_quantize(torch.ones(32, 32, dtype=torch.int32))


def test_rejects_1d_tensor():
    with pytest.raises(ValueError, match="at least 2 dims"):
        mxfp8_quantize(torch.randn(64))


def test_rejects_non_contiguous_and_no_direction():
    with pytest.raises(ValueError, match="contiguous"):
        mxfp8_quantize(torch.randn(64, 64).t())
    with pytest.raises(ValueError, match="at least one"):
        mxfp8_quantize(torch.randn(64, 64), rowwise=False, colwise=False)


def test_backend_argument():
    w = random_weight((32, 64), torch.bfloat16)
    auto = mxfp8_quantize(w)  # CPU tensor: the reference
    ref = mxfp8_quantize(w, backend="reference")
    assert torch.equal(auto.rowwise.data.view(torch.uint8), ref.rowwise.data.view(torch.uint8))
    with pytest.raises(ValueError, match="backend='fast'"):
        mxfp8_quantize(w, backend="fast")
    with pytest.raises((RuntimeError, ValueError), match="backend='cuda'"):
        mxfp8_quantize(w, backend="cuda")  # a CPU tensor, and maybe no extension


def test_extension_status_is_consistent():
    assert isinstance(ops.extension_available(), bool)
    if ops.extension_available():
        assert ops.extension_error() is None
    else:
        assert isinstance(ops.extension_error(), str)
        assert not ops.has_op("mxfp8_quantize")
    assert not ops.has_op("no_such_op")


# ---------------------------------------------------------------------------------------------
# Fake (meta) implementation: shapes and dtypes without running the kernel
# ---------------------------------------------------------------------------------------------

needs_extension = pytest.mark.skipif(
    not ops.extension_available(), reason=f"extension not built: {ops.extension_error()}"
)


@needs_extension
@pytest.mark.parametrize("rowwise,colwise", [(True, False), (False, True), (True, True)])
def test_fake_impl_shapes(rowwise, colwise):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        w = torch.empty(4, 64, 128, dtype=torch.bfloat16, device="cuda")
        row_data, row_scales, col_data, col_scales = torch.ops.mok.mxfp8_quantize(
            w, rowwise, colwise
        )
        q = mxfp8_quantize(w, rowwise, colwise, backend="cuda")
    assert row_data.device.type == "cuda"
    expect_row = ((4, 64, 128), (4, 64, 4)) if rowwise else ((0,), (0,))
    expect_col = ((4, 64, 128), (4, 2, 128)) if colwise else ((0,), (0,))
    assert (tuple(row_data.shape), tuple(row_scales.shape)) == expect_row
    assert (tuple(col_data.shape), tuple(col_scales.shape)) == expect_col
    for data, scales in ((row_data, row_scales), (col_data, col_scales)):
        assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8
    assert (q.rowwise is None) != rowwise and (q.colwise is None) != colwise


@needs_extension
def test_meta_tensors_use_fake_impl():
    w = torch.empty(2, 96, 64, dtype=torch.float32, device="meta")
    row_data, row_scales, col_data, col_scales = torch.ops.mok.mxfp8_quantize(w, True, True)
    assert row_scales.shape == (2, 96, 2) and col_scales.shape == (2, 3, 64)
    assert row_data.shape == col_data.shape == w.shape
    torch.ops.mok.mxfp8_quantize_out(w, True, True, row_data, row_scales, col_data, col_scales)


def test_mxfp8_part_picks_rowwise_first_and_refuses_what_is_not_mxfp8():
    """mxfp8_part: the part an MXFP8 weight is read through (the functional API and
    requantize_mxfp8 both use it): rowwise when there, else colwise; an MXFP8Tensor itself."""
    from mok_megatron.ops.mxfp8 import mxfp8_part

    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(5))
    both = mxfp8_quantize(w, rowwise=True, colwise=True)
    assert mxfp8_part(both) is both.rowwise
    assert mxfp8_part((None, both.colwise)) is both.colwise  # a plain pair, as the API takes
    assert mxfp8_part(both.colwise) is both.colwise
    for bad in ((None, None), (w, w), w, (both.rowwise,)):
        with pytest.raises(TypeError, match="MXFP8Tensor or MXFP8Weight"):
            mxfp8_part(bad)
