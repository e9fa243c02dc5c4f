"""The CUDA MXFP8 quantiser against the reference, bit for bit: fresh random inputs with edge
blocks, poisoned outputs, no host synchronisation, CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch

from mok_megatron import ops
from mok_megatron.ops import mxfp8_quantize, mxfp8_quantize_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not ops.has_op("mxfp8_quantize"),
        reason=f"mok::mxfp8_quantize not built: {ops.extension_error()}",
    ),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [
    (32, 32),
    (64, 256),
    (96, 4096),
    (4, 128, 2048),  # expert weights [E, I, H]
    (2, 2048, 768),
    (8, 96, 7168),
]
POISONS = (0xA5, 0x7F)  # 0x7F also equals the NaN byte and scale 127 (a zero block's scale)


def random_weight(shape, dtype, *, edge_blocks=True):
    """Fresh normal values, a random power-of-two magnitude per row, and (edge_blocks) a few
    zero, NaN, +-Inf, huge and subnormal blocks at random places."""
    x = torch.randn(shape, device="cuda", dtype=torch.float32)
    lo, hi = (-30, 30) if dtype == torch.float32 else (-8, 8)
    x *= torch.exp2(torch.randint(lo, hi + 1, (*shape[:-1], 1), device="cuda").float())
    x = x.to(dtype)
    if not edge_blocks:
        return x
    flat = x.view(-1, shape[-1])
    rows, cols = flat.shape
    big = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).tiny
    specials = [0.0, -0.0, float("nan"), float("inf"), float("-inf"), big, -big, tiny / 4]
    picks = torch.randint(0, rows * cols, (4 * len(specials),)).tolist()
    for i, pos in enumerate(picks):
        flat[pos // cols, pos % cols] = specials[i % len(specials)]
    r = torch.randint(0, rows, ()).item()
    c0 = torch.randint(0, max(cols // 32, 1), ()).item() * 32
    flat[r, c0 : c0 + 32] = tiny / 2 if r % 2 else 0.0  # a whole subnormal or zero block
    return x


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str):
    got_b = got.view(torch.uint8).cpu()
    want_b = want.view(torch.uint8).cpu()
    assert got_b.shape == want_b.shape, what
    bad = (got_b != want_b).nonzero()
    assert bad.numel() == 0, (
        f"{what}: {bad.shape[0]} of {got_b.numel()} bytes differ; first at {bad[0].tolist()}: "
        f"got {got_b[tuple(bad[0])].item():#04x} want {want_b[tuple(bad[0])].item():#04x}"
    )


def assert_matches_reference(w: torch.Tensor, rowwise: bool, colwise: bool, q):
    ref = mxfp8_quantize_reference(w.cpu(), rowwise, colwise)
    for name, got, want in (
        ("rowwise", q.rowwise, ref.rowwise),
        ("colwise", q.colwise, ref.colwise),
    ):
        if want is None:
            assert got is None, name
            continue
        assert got.data.dtype == torch.float8_e4m3fn and got.scales.dtype == torch.uint8
        assert_same_bytes(got.scales, want.scales, f"{name} scales")
        assert_same_bytes(got.data, want.data, f"{name} data")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rowwise,colwise", [(True, False), (False, True), (True, True)])
def test_matches_reference_bitwise(shape, dtype, rowwise, colwise):
    w = random_weight(shape, dtype)
    q = mxfp8_quantize(w, rowwise, colwise, backend="cuda")
    assert_matches_reference(w, rowwise, colwise, q)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,rowwise,colwise",
    [
        ((5, 64), True, False),  # rows not a multiple of 32 (rowwise only)
        ((33, 96), True, False),
        ((64, 7), False, True),  # odd columns: the scalar (unvectorised) path
        ((2, 64, 40), False, True),  # a warp tile only partly filled
        ((32, 300), False, True),
        ((1, 32, 32), True, True),
    ],
)
def test_odd_shapes(shape, dtype, rowwise, colwise):
    w = random_weight(shape, dtype)
    assert_matches_reference(w, rowwise, colwise, mxfp8_quantize(w, rowwise, colwise))


@pytest.mark.parametrize("dtype", DTYPES)
def test_misaligned_input_pointer(dtype):
    """A contiguous view whose data pointer is not 16-byte aligned takes the scalar path."""
    base = random_weight((64 * 128 + 1,), dtype, edge_blocks=False)
    w = base[1:].view(64, 128)
    assert w.data_ptr() % 16 != 0
    assert_matches_reference(w, True, True, mxfp8_quantize(w, True, True))


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_out_variant_writes_every_byte(poison, dtype):
    w = random_weight((3, 96, 512), dtype)
    row_data = torch.full(w.shape, poison, dtype=torch.uint8, device="cuda")
    col_data = torch.full(w.shape, poison, dtype=torch.uint8, device="cuda")
    row_scales = torch.full((3, 96, 16), poison, dtype=torch.uint8, device="cuda")
    col_scales = torch.full((3, 3, 512), poison, dtype=torch.uint8, device="cuda")
    fp8 = torch.float8_e4m3fn
    torch.ops.mok.mxfp8_quantize_out(
        w, True, True, row_data.view(fp8), row_scales, col_data.view(fp8), col_scales
    )
    ref = mxfp8_quantize_reference(w.cpu(), True, True)
    assert_same_bytes(row_data, ref.rowwise.data, "rowwise data")
    assert_same_bytes(row_scales, ref.rowwise.scales, "rowwise scales")
    assert_same_bytes(col_data, ref.colwise.data, "colwise data")
    assert_same_bytes(col_scales, ref.colwise.scales, "colwise scales")


def test_no_host_sync():
    w = random_weight((4, 256, 1024), torch.bfloat16)
    mxfp8_quantize(w, True, True)  # first call outside: lazy initialisation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        q = mxfp8_quantize(w, True, True, backend="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_matches_reference(w, True, True, q)


def test_cuda_graph_capture():
    static_w = random_weight((2, 128, 1024), torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mxfp8_quantize(static_w, True, True)  # warm up off the default stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_q = mxfp8_quantize(static_w, True, True, backend="cuda")
    for _ in range(2):
        fresh = random_weight(tuple(static_w.shape), torch.bfloat16)
        static_w.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(fresh, True, True, static_q)


def test_runs_on_current_stream_and_device():
    w = random_weight((64, 512), torch.float32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        q = mxfp8_quantize(w, True, True)
    stream.synchronize()
    assert_matches_reference(w, True, True, q)


def test_rejects_bad_input_on_gpu():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8_quantize(torch.randn(32, 48, device="cuda"), backend="cuda")
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.mok.mxfp8_quantize(torch.randn(32, 48, device="cuda"), True, False)
    with pytest.raises(RuntimeError, match="not supported"):
        torch.ops.mok.mxfp8_quantize(
            torch.ones(32, 32, device="cuda", dtype=torch.int32), True, False
        )


def test_bandwidth_report():
    """Prints the achieved HBM bandwidth for the record and holds a loose floor: a quantiser
    this memory-bound must move at least a quarter of the 4.28 TB/s HBM ceiling."""
    w = torch.randn(32, 2048, 4096, device="cuda", dtype=torch.bfloat16)
    for rowwise, colwise in ((True, False), (True, True)):
        for _ in range(3):
            mxfp8_quantize(w, rowwise, colwise)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        iters = 20
        start.record()
        for _ in range(iters):
            mxfp8_quantize(w, rowwise, colwise)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / iters
        outputs = int(rowwise) + int(colwise)
        moved = w.numel() * (w.element_size() + outputs * (1 + 1 / 32))
        print(
            f"mxfp8_quantize {tuple(w.shape)} bf16 rowwise={rowwise} colwise={colwise}: "
            f"{ms * 1e3:.1f} us, {moved / (ms * 1e-3) / 1e9:.0f} GB/s"
        )
        assert moved / (ms * 1e-3) > 1.07e12, "below a quarter of the HBM ceiling"
