"""The CUDA backend's local kernels: ``moe_accumulate_groups``, ``moe_gather_rows``,
``moe_swiglu`` / ``moe_swiglu_backward`` and their interleaved (fused gate/up) twins.

moe_accumulate_groups (per-expert weight-gradient accumulation over rounds): each group is checked bitwise against what the rule says it must hold: zeros for a group with no
rows (round 0 only), untouched when it has no rows in the round, a copy of the part in its first
round, bf16(float(total) + float(part)) in later rounds. Inputs are fresh random values (never
zeros), so an untouched or wrongly written group shows.
"""

from __future__ import annotations

import pytest
import torch

from mok_megatron import ops
from mok_megatron.ops.moe import (
    moe_accumulate_groups,
    moe_gather_rows,
    moe_swiglu,
    moe_swiglu_backward,
    moe_swiglu_interleaved,
    moe_swiglu_interleaved_backward,
)
from mok_megatron.testing import relative_error
from mok_megatron.testing.poison import poisoned_memory

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not ops.has_op("moe_accumulate_groups"),
        reason="needs a CUDA GPU and mok_megatron._C with the stage-1 moe ops",
    ),
]


def _random(shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.rand(shape, generator=g, device="cuda") + 0.5).to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(7, 24, 40), (5, 96, 2048), (3, 8, 8)])
def test_each_group_follows_the_rule(shape):
    groups = shape[0]
    # group: rows in this window, first round
    rows = torch.tensor([0, 5, 0, 8, 3, 0, 16][:groups], dtype=torch.int32, device="cuda")
    first = torch.tensor([-1, 2, 1, 1, 0, -1, 2][:groups], dtype=torch.int32, device="cuda")
    offs = torch.cumsum(rows, 0).to(torch.int32)
    for round_index in (0, 1, 2):
        total, part = _random(shape, 1 + round_index), _random(shape, 100 + round_index)
        before = total.clone()
        moe_accumulate_groups(total, part, offs, first, round_index)
        for g in range(groups):
            f, n = int(first[g]), int(rows[g])
            if f < 0:
                want = torch.zeros_like(before[g]) if round_index == 0 else before[g]
            elif n == 0:
                want = before[g]
            elif round_index == f:
                want = part[g]
            else:
                want = (before[g].float() + part[g].float()).to(torch.bfloat16)
            assert torch.equal(total[g], want), (round_index, g, f, n)


def test_in_place_first_round_writes_only_empty_groups():
    """One round with total == part: only groups with no rows are written (zeros)."""
    shape = (6, 32, 64)
    rows = torch.tensor([4, 0, 8, 0, 0, 2], dtype=torch.int32, device="cuda")
    first = torch.where(rows > 0, 0, -1).to(torch.int32)
    offs = torch.cumsum(rows, 0).to(torch.int32)
    grad = _random(shape, 7)
    before = grad.clone()
    moe_accumulate_groups(grad, grad, offs, first, 0)
    for g in range(shape[0]):
        want = before[g] if rows[g] > 0 else torch.zeros_like(before[g])
        assert torch.equal(grad[g], want), g


def test_bad_input_names_the_tensor():
    grad = _random((2, 8, 8), 3)
    offs = torch.tensor([1, 2], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="offs"):
        moe_accumulate_groups(grad, grad, offs.long(), offs, 0)
    with pytest.raises(RuntimeError, match="total and part"):
        moe_accumulate_groups(grad, grad[:1], offs, offs, 0)


# ------------------------------------------------------------------------------- gather
@pytest.mark.parametrize("hidden", [8, 72, 2048, 7168])
def test_gather_rows_matches_indexing_bitwise(hidden):
    src = _random((50, hidden), hidden) - 1.0  # signed values, never zero
    g = torch.Generator(device="cuda").manual_seed(hidden)
    row_tok = torch.randint(-1, 50, (333,), generator=g, device="cuda")
    with poisoned_memory() as mem:
        out = moe_gather_rows(src, row_tok)
    mem.assert_covers(out=out)
    want = torch.where((row_tok >= 0)[:, None], src[row_tok.clamp(min=0)], 0)
    assert torch.equal(out, want)
    assert torch.equal(moe_gather_rows(src, row_tok[:0]), src[:0])


# --------------------------------------------------------------------- FP8 token rows
@pytest.mark.skipif(not ops.has_op("moe_gather_rows_fp8"), reason="needs the FP8 token-row ops")
@pytest.mark.parametrize("hidden", [128, 2048, 7168])
def test_fp8_packed_rows_gather_like_indexing_bitwise(hidden):
    """moe_fp8_pack_rows then moe_gather_rows_fp8 (what the FP8 dispatch moves, less the move)
    give each row's data bytes and scales, and where the row index is -1 an all-zero row's
    quantisation (data 0, scales 1). Data bytes are random in [0, 0x7E] (finite e4m3, never a
    poison byte) and scales random positive floats, so an unwritten element shows."""
    from mok_megatron.ops.moe import (
        moe_fp8_pack_rows,
        moe_fp8_packed_row_width,
        moe_gather_rows_fp8,
    )

    tokens, rows = 50, 333
    g = torch.Generator(device="cuda").manual_seed(hidden)
    data = torch.randint(0, 0x7F, (tokens, hidden), generator=g, device="cuda", dtype=torch.uint8)
    data = data.view(torch.float8_e4m3fn)
    scales = torch.rand(tokens, hidden // 128, generator=g, device="cuda") + 0.25
    row_tok = torch.randint(-1, tokens, (rows,), generator=g, device="cuda")
    with poisoned_memory() as mem:
        packed = moe_fp8_pack_rows(data, scales)
        got_data, got_scales = moe_gather_rows_fp8(packed, row_tok, hidden)
    mem.assert_covers(packed=packed, data=got_data, scales=got_scales)
    assert packed.dtype == torch.bfloat16 and packed.shape == (
        tokens,
        moe_fp8_packed_row_width(hidden),
    )
    assert 2 * packed.shape[1] >= hidden + 4 * (hidden // 128)  # data and scales fit
    assert 2 * packed.shape[1] < 2 * hidden  # and the row is narrower than the bf16 token's
    used = (row_tok >= 0)[:, None]
    src = row_tok.clamp(min=0)
    want_data = torch.where(used, data.view(torch.uint8)[src], 0)
    want_scales = torch.where(used, scales[src], 1.0)
    assert torch.equal(got_data.view(torch.uint8), want_data)
    assert torch.equal(got_scales.view(torch.int32), want_scales.view(torch.int32))
    empty = moe_gather_rows_fp8(packed, row_tok[:0], hidden)
    assert empty[0].shape == (0, hidden) and empty[1].shape == (0, hidden // 128)


@pytest.mark.skipif(not ops.has_op("moe_gather_rows_fp8"), reason="needs the FP8 token-row ops")
def test_fp8_packed_rows_reject_what_is_not_their_format():
    from mok_megatron.ops.moe import moe_fp8_pack_rows, moe_gather_rows_fp8

    data = torch.zeros(4, 192, dtype=torch.float8_e4m3fn, device="cuda")
    with pytest.raises(RuntimeError, match="multiple of 128"):
        moe_fp8_pack_rows(data, torch.ones(4, 1, device="cuda"))
    packed = torch.zeros(4, 64, dtype=torch.bfloat16, device="cuda")
    row_tok = torch.zeros(2, dtype=torch.long, device="cuda")
    with pytest.raises(RuntimeError, match="packed FP8 rows of hidden=128"):
        moe_gather_rows_fp8(packed, row_tok, 128)


# ------------------------------------------------------------------------------- swiglu
def _swiglu64(g, u, da):
    g, u, da = g.double(), u.double(), da.double()
    s = torch.sigmoid(g)
    return g * s * u, da * u * s * (1 + g * (1 - s)), da * g * s


@pytest.mark.parametrize("rows,inter", [(1, 8), (37, 96), (1000, 768), (129, 12)])
def test_swiglu_matches_float64_and_strided_equals_contiguous(rows, inter):
    g = (_random((rows, 2 * inter), inter) - 1.0) * 4  # gate and up halves of one [P, 2I]
    da = _random((rows, inter), rows) - 1.0
    gate, up = g[:, :inter], g[:, inter:]
    with poisoned_memory() as mem:
        a = moe_swiglu(gate, up)
        dg, du = moe_swiglu_backward(da, gate, up)
    mem.assert_covers(a=a, dg=dg, du=du)
    a64, dg64, du64 = _swiglu64(gate, up, da)
    for name, got, want in (("a", a, a64), ("dg", dg, dg64), ("du", du, du64)):
        assert got.is_contiguous() and got.dtype == torch.bfloat16
        err = relative_error(got.double(), want)
        assert err < 1e-2, f"{name}: rel err {err:.3e}"
    # strided halves and contiguous copies give the same bits
    assert torch.equal(a, moe_swiglu(gate.contiguous(), up.contiguous()))
    dg2, du2 = moe_swiglu_backward(da, gate.contiguous(), up.contiguous())
    assert torch.equal(dg, dg2) and torch.equal(du, du2)


def test_swiglu_bad_input_names_the_rule():
    g = _random((4, 16), 1)
    with pytest.raises(RuntimeError, match="one shape"):
        moe_swiglu(g, g[:, :8])
    with pytest.raises(RuntimeError, match="unit column stride"):
        moe_swiglu(g.T, g.T)
    with pytest.raises(RuntimeError, match="unit column stride"):  # one row, strided columns
        moe_swiglu(g[:1, ::2], g[:1, ::2])


@pytest.mark.parametrize("offset", [16, 4])  # 16: 16-byte vectors; 4: 8-byte aligned, one by one
@pytest.mark.parametrize("rows,inter", [(1, 8), (37, 96), (1000, 768), (129, 2048)])
def test_interleaved_swiglu_matches_float64_and_the_split_kernels(rows, inter, offset):
    """h [P, 2I] with gate and up columns alternating in blocks of 8: the same bits as the split
    kernels on the de-interleaved halves, d_h interleaved like h; strided rows, and rows that
    start off a 16-byte boundary (the element-by-element path)."""
    wide = (_random((rows, 2 * inter + 16), inter + offset) - 1.0) * 4
    h = wide[:, offset : offset + 2 * inter]
    da = _random((rows, inter), rows + 1) - 1.0
    gate, up = ops.deinterleave_gate_up(h)
    with poisoned_memory() as mem:  # outputs in poisoned memory: a skipped element stays NaN
        a = moe_swiglu_interleaved(h)
        d_h = moe_swiglu_interleaved_backward(da, h)
    mem.assert_covers(a=a, d_h=d_h)
    assert a.shape == (rows, inter) and d_h.shape == (rows, 2 * inter) and d_h.is_contiguous()
    assert not a.isnan().any() and not d_h.isnan().any()
    dg, du = ops.deinterleave_gate_up(d_h)
    a64, dg64, du64 = _swiglu64(gate, up, da)
    for name, got, want in (("a", a, a64), ("dg", dg, dg64), ("du", du, du64)):
        err = relative_error(got.double(), want)
        assert err < 1e-2, f"{name}: rel err {err:.3e}"
    assert torch.equal(a, moe_swiglu(gate, up))
    dg2, du2 = moe_swiglu_backward(da, gate, up)
    assert torch.equal(dg, dg2) and torch.equal(du, du2)
    assert torch.equal(d_h, ops.interleave_gate_up(dg2.T, du2.T).T)
    assert torch.equal(a, moe_swiglu_interleaved(h.contiguous()))


def test_swiglu_backward_with_misaligned_da_uses_the_safe_path():
    """A contiguous da that starts 8 bytes off a 16-byte boundary: no misaligned vector loads."""
    h = _random((64, 2 * 96), 5) - 1.0
    da = (_random((64 * 96 + 4,), 6) - 1.0)[4:].view(64, 96)  # contiguous, offset 8 bytes
    want = moe_swiglu_interleaved_backward(da.clone(), h)
    torch.cuda.synchronize()
    assert torch.equal(moe_swiglu_interleaved_backward(da, h), want)
    gate, up = ops.deinterleave_gate_up(h)
    dg, du = moe_swiglu_backward(da, gate, up)
    dg2, du2 = moe_swiglu_backward(da.clone(), gate, up)
    assert torch.equal(dg, dg2) and torch.equal(du, du2)


def test_interleaved_swiglu_bad_input_names_the_rule():
    h = _random((4, 48), 2)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        moe_swiglu_interleaved(h[:, :40])
    with pytest.raises(RuntimeError, match="unit column stride"):
        moe_swiglu_interleaved(_random((32, 4), 3).T)
    with pytest.raises(RuntimeError, match=r"must be \[P, I\]"):
        moe_swiglu_interleaved_backward(_random((4, 16), 4), h)
