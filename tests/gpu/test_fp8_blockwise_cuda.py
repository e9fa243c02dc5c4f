"""The CUDA blockwise-FP8 quantiser against the reference (ops.fp8_blockwise), bit for bit:
fresh random inputs with edge blocks, every block form, both scale kinds, poisoned outputs, no
host synchronisation, CUDA-graph capture."""

from __future__ import annotations

import zlib

import pytest
import torch

from mok_megatron.ops import fp8_blockwise as fb
from mok_megatron.ops._extension import extension_error, has_op

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not has_op("fp8_blockwise_quantize"),
        reason=f"mok::fp8_blockwise_quantize not built: {extension_error()}",
    ),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (shape, blocks it fits): rows not a multiple of 128 only for (1, 128), cols only for (128, 1)
SHAPES = [
    ((256, 256), fb.BLOCKS),
    ((1024, 7168), fb.BLOCKS),  # tokens x deepseek-v3's H
    ((4, 256, 2048), fb.BLOCKS),  # expert weights [E, 2I, H]
    ((97, 2048), [(1, 128)]),
    ((384, 200), [(128, 1)]),
]
CASES = [
    pytest.param(shape, block, id=f"{'x'.join(map(str, shape))}-{block[0]}x{block[1]}")
    for shape, blocks in SHAPES
    for block in blocks
]
# (data byte, scale bits): any e4m3 byte is a possible output, so each case runs with both
# poisons, and an element left unwritten cannot match the reference twice; the scales' poisons
# are NaNs with payloads, which no scale (finite, or the canonical NaN) has.
POISONS = ((0x7E, 0x7FA5A5A5), (0xA5, 0x7F812345))


def random_input(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=g)
    lo, hi = (-40, 40) if dtype == torch.float32 else (-8, 8)
    x *= torch.exp2(torch.randint(lo, hi + 1, (*shape[:-1], 1), device="cuda", generator=g).float())
    x = x.to(dtype)
    flat = x.view(-1, shape[-1])
    rows, cols = flat.shape
    big, tiny = torch.finfo(dtype).max, torch.finfo(dtype).tiny
    specials = [0.0, -0.0, float("nan"), float("inf"), float("-inf"), big, -big, tiny / 4]
    picks = torch.randint(0, rows * cols, (3 * len(specials),), generator=g, device="cuda")
    for i, pos in enumerate(picks.tolist()):
        flat[pos // cols, pos % cols] = specials[i % len(specials)]
    flat[rows // 2, :128] = 0.0  # a zero row block (and part of a column / tile block)
    return x


def quantize_poisoned(x, block, pow2, poison):
    data = torch.full(x.shape, poison[0], dtype=torch.uint8, device="cuda")
    scales = torch.full(fb.scale_shape(x.shape, block), poison[1], dtype=torch.int32,
                        device="cuda")  # fmt: skip
    data, scales = data.view(torch.float8_e4m3fn), scales.view(torch.float32)
    torch.ops.mok.fp8_blockwise_quantize_out(x, block[0], block[1], pow2, data, scales)
    return fb.FP8BlockTensor(data, scales, block)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str):
    view = torch.uint8 if got.element_size() == 1 else torch.int32
    g, w = got.view(view).cpu(), want.view(view).cpu()
    bad = (g != w).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} differ, first at {bad[0].tolist()}"


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,block", CASES)
def test_kernel_matches_reference_bitwise(shape, block, dtype, pow2):
    x = random_input(shape, dtype, seed=zlib.crc32(repr((shape, block, dtype, pow2)).encode()))
    want = fb.fp8_blockwise_quantize_reference(x.cpu(), block, pow2)
    for poison in POISONS:
        got = quantize_poisoned(x, block, pow2, poison)
        assert_same_bits(got.data, want.data, f"data (poison {poison[0]:#x})")
        assert_same_bits(got.scales, want.scales, f"scales (poison {poison[1]:#x})")
    auto = fb.fp8_blockwise_quantize(x, block, pow2)  # the allocating op, "auto" = the kernel
    assert_same_bits(auto.data, want.data, "data (allocating op)")
    assert_same_bits(auto.scales, want.scales, "scales (allocating op)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_misaligned_input_takes_the_tile_kernel_and_matches(dtype):
    """(1, 128) blocks run a row-block kernel for 16-byte aligned inputs and the tile kernel
    otherwise (a contiguous view one element into its storage): both give the reference bits."""
    shape = (300, 1024)
    flat = torch.empty(shape[0] * shape[1] + 1, dtype=dtype, device="cuda")
    x = flat[1:].view(shape)
    x.copy_(random_input(shape, dtype, seed=5))
    assert x.data_ptr() % 16 != 0 and x.is_contiguous()
    want = fb.fp8_blockwise_quantize_reference(x.cpu(), (1, 128))
    for poison in POISONS:
        got = quantize_poisoned(x, (1, 128), False, poison)
        assert_same_bits(got.data, want.data, f"misaligned data (poison {poison[0]:#x})")
        assert_same_bits(got.scales, want.scales, f"misaligned scales (poison {poison[1]:#x})")


def test_no_host_sync_and_graph_capture():
    x = random_input((1024, 2048), torch.bfloat16, seed=1)
    want = fb.fp8_blockwise_quantize(x, (1, 128))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for block in fb.BLOCKS:
            fb.fp8_blockwise_quantize(x, block, pow2_scales=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    data = torch.empty_like(want.data)
    scales = torch.empty_like(want.scales)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        torch.ops.mok.fp8_blockwise_quantize_out(x, 1, 128, False, data, scales)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_bits(data, want.data, "replayed data")
    assert_same_bits(scales, want.scales, "replayed scales")


def test_kernel_rejects_bad_input():
    x = torch.zeros(128, 256, device="cuda", dtype=torch.bfloat16)
    for args, match in [
        ((x, 64, 64, False), r"block \(64, 64\) is not"),
        ((x[:100].contiguous(), 128, 1, False), "whole number of"),
        ((x.int(), 1, 128, False), "not supported"),
        ((x.T, 1, 128, False), "contiguous"),
    ]:  # fmt: skip
        with pytest.raises(RuntimeError, match=match):
            torch.ops.mok.fp8_blockwise_quantize(*args)


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_kernel_quantises_no_rows(block):
    """No rows (a rank without tokens quantising its tokens): empty data and scales of the
    right shapes, no error (empty outputs may have null data pointers)."""
    x = torch.empty(0, 256, device="cuda", dtype=torch.bfloat16)
    got = fb.fp8_blockwise_quantize(x, block)
    assert got.data.shape == (0, 256) and got.data.dtype == torch.float8_e4m3fn
    assert tuple(got.scales.shape) == tuple(fb.scale_shape(x.shape, block))
