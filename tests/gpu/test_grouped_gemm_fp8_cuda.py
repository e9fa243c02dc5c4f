"""The blockwise-FP8 grouped GEMMs (ops.grouped_gemm_fp8) against a float64 oracle on the same
quantised operands, on scaled-down benchmark shapes with uneven and empty groups; the L1 op's
fused quantisation bit for bit against ops.fp8_blockwise on its own bf16 act; poisoned outputs
(in each output's own dtype); bitwise run to run; no host synchronisation; CUDA-graph capture;
bad input."""

from __future__ import annotations

import zlib

import pytest
import torch

from mok_megatron.ops import fp8_blockwise as fb
from mok_megatron.ops import grouped_gemm_fp8 as gf
from mok_megatron.ops._extension import extension_error
from mok_megatron.ops.grouped_gemm import GemmTuning, deinterleave_gate_up

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not gf.grouped_gemm_fp8_available(),
        reason=f"mok::grouped_gemm_fp8_* not built: {extension_error()}",
    ),
]

BF16_NAN = 0xFFC1 - 0x10000  # poison of the bf16 outputs, as int16 (a NaN no kernel writes)
SCALE_POISON = 0x7FA5A5A5  # a NaN with a payload: no scale (finite or canonical NaN) has it
FP8_POISONS = (0x7E, 0xA5)  # any e4m3 byte is a possible output: each case runs with both
# (name, hidden, intermediate, rows per group): the benchmark models scaled down; uneven groups,
# an empty one, row counts that are not multiples of the 128-row tile.
SHAPES = [
    ("qwen3-30b-a3b", 2048, 768, [300, 0, 77, 513, 128, 1]),
    ("deepseek-v3", 7168, 2048, [129, 0, 260]),
    ("mixtral-8x7b", 4096, 14336, [200, 57]),
    # last tiles of 64, 65, 63 and 1 rows: the second consumer warpgroup idle (its slice past
    # the group's end: roles/fp8_mainloop.cuh) or not, groups before and after
    ("idle_warpgroup", 1024, 256, [64, 193, 191, 0, 129, 65]),
]
IDS = [s[0] for s in SHAPES]


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def activations(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """bf16 rows with per-row magnitudes over 2^-6..2^6 (fresh, never zeros)."""
    x = torch.randn(rows, cols, device="cuda", generator=g)
    return (x * torch.exp2(torch.randint(-6, 7, (rows, 1), device="cuda", generator=g))).bfloat16()


def weights(groups: int, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    w = torch.randn(groups, n, k, device="cuda", generator=g) * k**-0.5
    block_scale = torch.exp2(
        torch.randint(-3, 4, (groups, n // 128, 1), device="cuda", generator=g)
    )
    return (w * block_scale.repeat_interleave(128, 1)).bfloat16()


def offsets(rows_per_group: list[int]) -> torch.Tensor:
    return torch.tensor(rows_per_group, device="cuda").cumsum(0).int()


def bf16_poisoned(rows: int, cols: int) -> torch.Tensor:
    return torch.full((rows, cols), BF16_NAN, dtype=torch.int16, device="cuda").view(torch.bfloat16)


def assert_close_to_oracle(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str):
    """|got - want| <= 2^-8 |want| (the bf16 output) + 2^-9 * bound (FP8 wgmma accumulation:
    `bound` is the sum of |products|), elementwise."""
    err = (got.double() - want).abs()
    tol = want.abs() * 2.0**-8 + bound * 2.0**-9
    bad = ~(err <= tol)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} elements off; worst excess "
        f"{float((err - tol).max()):.3e} at {bad.nonzero()[0].tolist()}"
    )


def abs_bound(a: fb.FP8BlockTensor, w: fb.FP8BlockTensor, offs: torch.Tensor) -> torch.Tensor:
    def absolute(t):
        return fb.FP8BlockTensor(t.data.float().abs().to(torch.float8_e4m3fn), t.scales.abs(),
                                 t.block)  # fmt: skip

    return gf.grouped_gemm_fp8_reference(absolute(a), absolute(w), offs)


def nt_case(name, hidden, inter, rows_per_group):
    g = gen(zlib.crc32(name.encode()))
    rows = sum(rows_per_group)
    x = fb.fp8_blockwise_quantize(activations(rows + 5, inter, g), (1, 128))  # 5 rows past offs
    w = gf.fp8_gemm_weight(weights(len(rows_per_group), hidden, inter, g))
    return x, w, offsets(rows_per_group)


@pytest.mark.parametrize("schedule", ["cooperative", "pingpong"])
@pytest.mark.parametrize("name,hidden,inter,rows_per_group", SHAPES, ids=IDS)
def test_nt_matches_float64_oracle(name, hidden, inter, rows_per_group, schedule):
    a, w, offs = nt_case(name, hidden, inter, rows_per_group)
    rows = int(offs[-1])
    want = gf.grouped_gemm_fp8_reference(a, w, offs)[:rows]
    outs = []
    for _ in range(2):
        out = bf16_poisoned(a.data.shape[0], hidden)
        torch.ops.mok.grouped_gemm_fp8_nt_out(a.data, a.scales, w.data, w.scales, offs, out,
                                              *GemmTuning(schedule).op_args())  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), "run to run"
    assert (outs[0][rows:].view(torch.int16) == BF16_NAN).all(), "rows past offs written"
    assert_close_to_oracle(outs[0][:rows], want, abs_bound(a, w, offs)[:rows], f"{name} nt")


def l1_poisoned_run(x, w_gu, offs, pow2, fp8_poison):
    rows, inter = x.data.shape[0], w_gu.data.shape[1] // 2
    act_q = torch.full((rows, inter), fp8_poison, dtype=torch.uint8, device="cuda")
    act_q_scales = torch.full((rows, inter // 128), SCALE_POISON, dtype=torch.int32, device="cuda")
    act, h = bf16_poisoned(rows, inter), bf16_poisoned(rows, 2 * inter)
    act_q, act_q_scales = act_q.view(torch.float8_e4m3fn), act_q_scales.view(torch.float32)
    torch.ops.mok.grouped_gemm_fp8_l1_swiglu_out(x.data, x.scales, w_gu.data, w_gu.scales,
                                                 offs, act_q, act_q_scales, act, h, pow2)  # fmt: skip
    return fb.FP8BlockTensor(act_q, act_q_scales, (1, 128)), act, h


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
@pytest.mark.parametrize("name,hidden,inter,rows_per_group", SHAPES, ids=IDS)
def test_l1_swiglu_and_its_quantised_act(name, hidden, inter, rows_per_group, pow2):
    g = gen(zlib.crc32(repr((name, pow2)).encode()))
    rows = sum(rows_per_group)
    x = fb.fp8_blockwise_quantize(activations(rows + 3, hidden, g), (1, 128))
    w_gu = gf.fp8_gemm_weight(weights(len(rows_per_group), 2 * inter, hidden, g))
    offs = offsets(rows_per_group)
    h_want = gf.grouped_gemm_fp8_reference(x, w_gu, offs)[:rows]
    h_bound = abs_bound(x, w_gu, offs)[:rows]
    runs = [l1_poisoned_run(x, w_gu, offs, pow2, p) for p in FP8_POISONS]
    act_q, act, h = runs[0]
    for other_q, other_act, other_h in runs[1:]:  # the rows before offs[-1]: past it, poison
        for got, want in ((other_q.data.view(torch.uint8), act_q.data.view(torch.uint8)),
                          (other_q.scales.view(torch.int32), act_q.scales.view(torch.int32)),
                          (other_act.view(torch.int16), act.view(torch.int16)),
                          (other_h.view(torch.int16), h.view(torch.int16))):  # fmt: skip
            assert torch.equal(got[:rows], want[:rows]), "run to run"
    assert_close_to_oracle(h[:rows], h_want, h_bound, f"{name} h")
    # act (from the fp32 accumulators) against silu(g) * u of the kernel's bf16 h: h's rounding
    # (2^-9 relative in g and u; |silu'| < 1.1) plus act's own
    gate, up = deinterleave_gate_up(h[:rows].double())
    act_from_h = gate * torch.sigmoid(gate) * up
    err = (act[:rows].double() - act_from_h).abs()
    tol = 2.0**-8 * (1.1 * gate.abs() * up.abs() + 2 * act_from_h.abs())
    assert (err <= tol).all(), f"{name} act vs its h: worst excess {float((err - tol).max()):.3e}"
    # the fused quantisation is the quantiser's, bit for bit, on the kernel's bf16 act
    want_q = fb.fp8_blockwise_quantize(act[:rows].contiguous(), (1, 128), pow2)
    assert torch.equal(act_q.data[:rows].view(torch.uint8), want_q.data.view(torch.uint8))
    assert torch.equal(act_q.scales[:rows].view(torch.int32), want_q.scales.view(torch.int32))
    for t, poison in ((act_q.data.view(torch.uint8), FP8_POISONS[0]),
                      (act_q.scales.view(torch.int32), SCALE_POISON)):  # fmt: skip
        assert (t[rows:] == poison).all(), "rows past offs written"


def test_l1_without_bf16_outputs_gives_the_same_act_q():
    g = gen(7)
    x = fb.fp8_blockwise_quantize(activations(640, 2048, g), (1, 128))
    w_gu = gf.fp8_gemm_weight(weights(3, 1536, 2048, g))
    offs = offsets([300, 40, 300])
    full = gf.grouped_gemm_fp8_l1_swiglu(x, w_gu, offs, save_act=True, save_h=True)
    lean = gf.grouped_gemm_fp8_l1_swiglu(x, w_gu, offs)
    assert lean.act is None and lean.h is None
    assert torch.equal(full.act_q.data.view(torch.uint8), lean.act_q.data.view(torch.uint8))
    assert torch.equal(full.act_q.scales, lean.act_q.scales)


def test_no_host_sync_and_graph_capture():
    g = gen(11)
    x = fb.fp8_blockwise_quantize(activations(1000, 2048, g), (1, 128))
    w_gu = gf.fp8_gemm_weight(weights(4, 1536, 2048, g))
    w_down = gf.fp8_gemm_weight(weights(4, 2048, 768, g))
    offs = offsets([250, 0, 500, 250])

    def layer():
        l1 = gf.grouped_gemm_fp8_l1_swiglu(x, w_gu, offs)
        return gf.grouped_gemm_fp8_nt(l1.act_q, w_down, offs)

    want = layer()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer()  # warm-up on the capture stream
        with torch.cuda.graph(graph, stream=stream):
            got = layer()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_ops_reject_bad_input():
    g = gen(3)
    a = fb.fp8_blockwise_quantize(activations(256, 512, g), (1, 128))
    w = gf.fp8_gemm_weight(weights(2, 256, 512, g))
    offs = offsets([128, 128])
    out = torch.empty(256, 256, device="cuda", dtype=torch.bfloat16)
    nt = torch.ops.mok.grouped_gemm_fp8_nt_out
    cases = [
        ((a.data.view(torch.uint8), a.scales, w.data, w.scales, offs, out), "float8_e4m3fn"),
        ((a.data, a.scales, w.data, w.scales[:, :1].contiguous(), offs, out), "b_scales.shape"),
        ((a.data, a.scales[:, :2].contiguous(), w.data, w.scales, offs, out), "a_scales"),
        ((a.data[:, :200].contiguous(), a.scales, w.data, w.scales, offs, out), "multiple of 128"),
        ((a.data, a.scales, w.data, w.scales, offs.long(), out), "int32"),
        ((a.data, a.scales, w.data, w.scales, offs, out.float()), "bfloat16"),
        ((a.data, a.scales, w.data, w.scales, offs, out[:, :128]), "contiguous"),
    ]  # fmt: skip
    for args, match in cases:
        with pytest.raises(RuntimeError, match=match):
            nt(*args)
    with pytest.raises(ValueError, match=r"\(1, 128\) blocks"):
        gf.grouped_gemm_fp8_nt(fb.fp8_blockwise_quantize(activations(256, 512, g), (128, 128)), w,
                               offs)  # fmt: skip
    w_gu = gf.fp8_gemm_weight(weights(2, 384, 512, g))  # I = 192: not whole act blocks
    with pytest.raises(RuntimeError, match="multiple of 256"):
        gf.grouped_gemm_fp8_l1_swiglu(a, w_gu, offs)
    with pytest.raises(RuntimeError, match="cooperative"):
        gf.grouped_gemm_fp8_l1_swiglu(a, gf.fp8_gemm_weight(weights(2, 512, 512, g)), offs,
                                      tuning=GemmTuning("pingpong"))  # fmt: skip
