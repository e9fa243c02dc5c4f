"""Blockwise FP8 quantisation (ops.fp8_blockwise): the PyTorch reference against an independent
float64 oracle (value by value, signed zeros included), the block forms, special blocks, the
round-trip bound and the errors. The CUDA kernel is checked against the reference in
tests/gpu/test_fp8_blockwise_cuda.py."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from mok_megatron.ops import fp8_blockwise as fb

E4M3_MIN_NORMAL = 2.0**-6
E4M3_SUBNORMAL_STEP = 2.0**-9


def e4m3_round(v: float) -> float:
    """Round a float64 to the nearest float8_e4m3fn value (ties to even), |v| <= 448."""
    if v == 0 or math.isnan(v):
        return v
    a = abs(v)
    if a < E4M3_MIN_NORMAL:
        step = E4M3_SUBNORMAL_STEP
    else:
        step = 2.0 ** (math.floor(math.log2(a)) - 3)
        if a / step >= 16:  # log2 landed one below at an exact power of two
            step *= 2
    q = a / step
    r = math.floor(q)
    if q - r > 0.5 or (q - r == 0.5 and r % 2 == 1):
        r += 1
    return math.copysign(r * step, v)


def oracle_block(values: list[float], pow2: bool) -> tuple[float, list[float]]:
    """(scale, dequantisable data values) of one block, in float64 arithmetic."""
    if any(math.isnan(v) or math.isinf(v) for v in values):
        return math.nan, [math.nan] * len(values)
    amax = max(abs(v) for v in values)
    if amax == 0:
        return 1.0, [math.copysign(0.0, v) for v in values]
    f32 = lambda v: float(torch.tensor(v, dtype=torch.float64).float())  # one rounding
    if pow2:
        e = math.ceil(math.log2(amax / 448.0))
        while amax > 448.0 * 2.0**e:
            e += 1
        while amax <= 448.0 * 2.0 ** (e - 1):
            e -= 1
        e = min(max(e, -126), 120)
        s = 2.0**e
        q = [f32(v * 2.0**-e) for v in values]
    else:
        s = max(f32(amax / 448.0), 2.0**-126)  # float64 quotient rounded once: exact RN
        q = [f32(v / s) for v in values]
    return s, [e4m3_round(min(max(v, -448.0), 448.0)) for v in q]


def random_input(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g))
    tiny = torch.rand(shape, generator=g) < 0.05
    x = torch.where(tiny, x * 2.0**-130, x)  # float32 subnormals (they flush to 0 in bf16)
    return x.to(dtype)


def check_against_oracle(x: torch.Tensor, q: fb.FP8BlockTensor, pow2: bool):
    br, bc = q.block
    f = x.float()
    data = q.data.float()
    rows, cols = x.shape[-2:]
    flat_x = f.reshape(-1, rows, cols)
    flat_d = data.reshape(-1, rows, cols)
    flat_s = q.scales.reshape(-1, rows // br, cols // bc)
    for b in range(flat_x.shape[0]):
        for i in range(rows // br):
            for j in range(cols // bc):
                xs = flat_x[b, i * br : (i + 1) * br, j * bc : (j + 1) * bc].flatten().tolist()
                ds = flat_d[b, i * br : (i + 1) * br, j * bc : (j + 1) * bc].flatten().tolist()
                s, want = oracle_block([float(v) for v in xs], pow2)
                got_s = float(flat_s[b, i, j])
                assert (math.isnan(s) and math.isnan(got_s)) or s == got_s, (b, i, j, s, got_s)
                for w, d in zip(want, ds):
                    if math.isnan(w):
                        assert math.isnan(d)
                    else:
                        assert w == d and math.copysign(1, w) == math.copysign(1, d), (w, d)


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
@pytest.mark.parametrize("block", fb.BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_matches_float64_oracle(dtype, block, pow2):
    shape = (2, 256, 256) if block == (128, 128) else (256, 256)
    x = random_input(shape, dtype, seed=zlib.crc32(repr((dtype, block, pow2)).encode()))
    q = fb.fp8_blockwise_quantize_reference(x, block, pow2)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == x.shape
    assert q.scales.dtype == torch.float32
    assert list(q.scales.shape) == fb.scale_shape(x.shape, block)
    check_against_oracle(x, q, pow2)


@pytest.mark.parametrize("pow2", [False, True])
def test_column_blocks_are_row_blocks_of_the_transpose(pow2):
    x = random_input((384, 256), torch.bfloat16, seed=3)
    col = fb.fp8_blockwise_quantize_reference(x, (128, 1), pow2)
    row = fb.fp8_blockwise_quantize_reference(x.T.contiguous(), (1, 128), pow2)
    assert torch.equal(col.data.view(torch.uint8), row.data.view(torch.uint8).T)
    assert torch.equal(col.scales, row.scales.T)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("block", fb.BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
def test_round_trip_bound(block, pow2):
    x = random_input((256, 256), torch.float32, seed=5)
    q = fb.fp8_blockwise_quantize_reference(x, block, pow2)
    back = fb.fp8_blockwise_dequantize(q)
    br, bc = block
    s = q.scales.repeat_interleave(br, 0).repeat_interleave(bc, 1)
    bound = torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * s) * (1 + 2.0**-20)
    assert bool(((x - back).abs() <= bound).all())
    assert not torch.equal(back, x)  # it does quantise


def test_special_blocks():
    x = random_input((256, 256), torch.float32, seed=9)
    x[:128, :128] = 0.0
    x[0, 1] = -0.0
    x[130, 5] = float("nan")
    x[200, 140] = float("inf")
    q = fb.fp8_blockwise_quantize_reference(x, (128, 128))
    assert q.scales[0, 0] == 1.0
    assert torch.equal(q.data[:128, :128].view(torch.uint8) & 0x7F,
                       torch.zeros(128, 128, dtype=torch.uint8))  # fmt: skip
    assert q.data.view(torch.uint8)[0, 1] == 0x80  # the signed zero kept
    assert torch.isnan(q.scales[1, 0]) and torch.isnan(q.scales[1, 1])
    assert bool((q.data.view(torch.uint8)[128:, :] == fb.DATA_NAN).all())
    assert bool(torch.isfinite(q.scales[0, 1])) and q.scales[0, 1] != 1.0
    clean = fb.fp8_blockwise_quantize_reference(x[:128, 128:].contiguous(), (128, 128))
    assert torch.equal(clean.data.view(torch.uint8), q.data.view(torch.uint8)[:128, 128:])


def test_pow2_scales_are_powers_of_two_and_exact():
    x = random_input((128, 512), torch.bfloat16, seed=11)
    q = fb.fp8_blockwise_quantize_reference(x, (1, 128), pow2_scales=True)
    mantissa, _ = torch.frexp(q.scales)
    assert bool((mantissa == 0.5).all())
    # values that are e4m3 numbers times the scale round-trip exactly
    exact = fb.fp8_blockwise_dequantize(q)
    again = fb.fp8_blockwise_quantize_reference(exact, (1, 128), pow2_scales=True)
    assert torch.equal(fb.fp8_blockwise_dequantize(again), exact)


@pytest.mark.parametrize(
    "make,block,error,match",
    [
        (lambda: torch.zeros(128, 130), (1, 128), ValueError, r"multiple of 128, got 130; pad it to 256"),
        (lambda: torch.zeros(100, 128), (128, 1), ValueError, r"multiple of 128, got 100"),
        (lambda: torch.zeros(128, 128), (64, 64), ValueError, "is not one of"),
        (lambda: torch.zeros(128, 128, dtype=torch.int32), (1, 128), TypeError, "not supported"),
        (lambda: torch.zeros(128), (1, 128), ValueError, "at least 2 dims"),
        (lambda: torch.zeros(256, 128).T, (1, 128), ValueError, "contiguous"),
    ],
    ids=["cols", "rows", "block", "dtype", "1d", "strided"],
)  # fmt: skip
def test_bad_input_is_named(make, block, error, match):
    with pytest.raises(error, match=match):
        fb.fp8_blockwise_quantize(make(), block)


def test_backends():
    x = random_input((128, 256), torch.bfloat16, seed=1)
    auto = fb.fp8_blockwise_quantize(x)  # CPU: the reference
    ref = fb.fp8_blockwise_quantize(x, backend="reference")
    assert torch.equal(auto.data.view(torch.uint8), ref.data.view(torch.uint8))
    with pytest.raises(RuntimeError, match="CUDA kernel can't run for a cpu tensor"):
        fb.fp8_blockwise_quantize(x, backend="cuda")
    with pytest.raises(ValueError, match="backend="):
        fb.fp8_blockwise_quantize(x, backend="gpu")


def test_dequantize_rejects_mismatched_scales():
    q = fb.fp8_blockwise_quantize_reference(torch.ones(128, 256), (1, 128))
    with pytest.raises(ValueError, match="does not match"):
        fb.fp8_blockwise_dequantize(q._replace(block=(128, 128)))
