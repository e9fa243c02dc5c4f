"""MoKConfig.expert_precision="fp8_blockwise" on the reference backend, against an independent
float64 oracle of the CUDA path's recipe (ops.grouped_gemm_fp8): rows and the bf16 act quantised
in (1, 128) blocks, the fused gate_up and down weights in (128, 128) blocks; the backward is the
BF16 one at the FP8 forward's activations (straight-through)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as tF

from mok_megatron import functional as F
from mok_megatron.ops import interleave_gate_up
from mok_megatron.ops.fp8_blockwise import fp8_blockwise_quantize_reference
from mok_megatron.testing import random_moe_problem, relative_error
from mok_megatron.testing.runs import problem_workspace

FP8 = F.MoKConfig(expert_precision="fp8_blockwise")
ROUTED_GRADS = ("d_x", "d_router_weights", "d_w_routed_gate", "d_w_routed_up", "d_w_routed_down")


# ------------------------------------------------------------------------------- the oracle
def _fp8(t: torch.Tensor, block) -> torch.Tensor:
    """t through blockwise FP8 (quantised from its float32 values), dequantised in float64."""
    q = fp8_blockwise_quantize_reference(t.float().contiguous(), block)
    br, bc = q.block
    *batch, rows, cols = q.data.shape
    blocks = q.data.double().reshape(*batch, rows // br, br, cols // bc, bc)
    return (blocks * q.scales.double()[..., :, None, :, None]).reshape(q.data.shape)


def _gate_up_rows(inter: int):
    """The rows of the interleaved gate_up holding gate row i and up row i (blocks of 8)."""
    i = torch.arange(inter)
    gate = 16 * (i // 8) + i % 8
    return gate, gate + 8


def _fp8_weights(wg, wu, wd):
    """The (128, 128)-block FP8 weights, gate/up blocked in the interleaved [E, 2I, H] form."""
    experts, inter, hidden = wg.shape
    gate, up = _gate_up_rows(inter)
    gate_up = torch.empty(experts, 2 * inter, hidden, dtype=torch.float64)
    gate_up[:, gate], gate_up[:, up] = wg.detach().double(), wu.detach().double()
    q = _fp8(gate_up, (128, 128))
    return q[:, gate], q[:, up], _fp8(wd.detach(), (128, 128))


def fp8_oracle(x, topk, rw, wg, wu, wd):
    """out [N, H] float64, expert by expert over the slots routed to it (as
    testing.dense_moe): the value is the FP8 forward's, the autograd gradient the BF16 layer's at
    the FP8 activations (each FP8 value is attached straight-through to its float64 product)."""
    qg, qu, qd = _fp8_weights(wg, wu, wd)
    xq = _fp8(x.detach(), (1, 128))  # (1, 128) blocks: each token's row alone
    out = torch.zeros_like(x)
    for e in range(wg.shape[0]):
        tokens, slots = (topk == e).nonzero(as_tuple=True)
        g8, u8 = xq[tokens] @ qg[e].T, xq[tokens] @ qu[e].T
        a8 = _fp8((tF.silu(g8) * u8).bfloat16(), (1, 128))  # the bf16 act, then FP8
        xs = x[tokens]
        g, u = _straight_through(g8, xs @ wg[e].T), _straight_through(u8, xs @ wu[e].T)
        y = _straight_through(a8 @ qd[e].T, (tF.silu(g) * u) @ wd[e].T)
        out = out.index_add(0, tokens, rw[tokens, slots, None] * y)
    return out


def _straight_through(value: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """``value`` forward, ``path``'s gradient backward."""
    return path + (value - path).detach()


# ---------------------------------------------------------------------------------- helpers
def _problem(hidden=256, inter=256, dtype=torch.float64):
    """64 tokens, 8 experts, top-2 (a tenth of the slots empty), one rank; fresh random inputs."""
    return random_moe_problem([64], hidden, inter, 8, 2, empty_slot_fraction=0.1, dtype=dtype)


def _bf16_valued(problem):
    """The problem in float32 holding bf16 values: what the CUDA path's bf16 inputs carry."""
    cast = {n: getattr(problem, n).bfloat16().float() for n in ("x", "w_gate", "w_up", "w_down")}
    return dataclasses.replace(problem, **cast)


def _run(problem, config, dtype, fused, d_out=None):
    """Forward (and backward with ``d_out``) on the reference backend: (out, grads or None)."""
    x, topk, rw, (wg, wu, wd), _ = problem.local(0, dtype=dtype)
    rw = rw.double() if dtype == torch.float64 else rw
    routed = (interleave_gate_up(wg, wu), None, wd) if fused else (wg, wu, wd)
    ws = problem_workspace(problem, dtype=dtype, config=config)
    sched = F.build_schedule(ws, config, topk, ws.num_local_experts)
    out, ctx = F.forward(config, ws, sched, x, rw, None, None, None, *routed)
    if d_out is None:
        return out, None
    grads = F.backward(config, ws, sched, ctx, d_out.to(dtype), x, rw, None, None, None, *routed)
    return out, grads


def _oracle(problem):
    """The oracle's out on the whole problem, and its float64 leaves (x, router_weights, gate,
    up, down) for autograd."""
    names = ("x", "router_weights", "w_gate", "w_up", "w_down")
    leaves = [getattr(problem, n).detach().double().clone().requires_grad_() for n in names]
    return fp8_oracle(leaves[0], problem.topk_experts, *leaves[1:]), leaves


# ------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("fused", [False, True])
def test_fp8_forward_matches_the_float64_oracle(fused):
    # float64 inputs run the backend in float64: only summation order differs from the oracle
    # (~1e-16 relative), and no FP8 / bf16 rounding lands on a different side, so 1e-12.
    problem = _problem()
    out, _ = _run(problem, FP8, torch.float64, fused)
    assert relative_error(out, _oracle(problem)[0].detach()) < 1e-12


@pytest.mark.parametrize("fused", [False, True])
def test_fp8_forward_in_float32_matches_the_oracle_token_by_token(fused):
    # bf16-valued inputs computed in float32, as on the GPU. A float32 g / u sits within ~1e-6
    # relative of the float64 one, so about one act element in 4000 rounds to the other bf16 (and
    # rarely then the other e4m3) neighbour: ~0.3 such tokens per run (measured: 14 in 40 runs,
    # never 2). Every other token matches to float32 summation error (~2e-7 of the RMS token
    # norm over 256 + 256 terms; bound 1e-5); the few that don't stay within a few e4m3 steps
    # of one act element (<5% of the RMS token norm), and at most 4 of 64 do (P ~ 1e-4).
    problem = _bf16_valued(_problem(dtype=torch.float32))
    out, _ = _run(problem, FP8, torch.float32, fused)
    want = _oracle(problem)[0].detach()
    token_err = (out.double() - want).norm(dim=1) / (want.norm() / want.shape[0] ** 0.5)
    assert (token_err > 1e-5).sum() <= 4
    assert token_err.max() < 0.05


def test_fp8_differs_from_bf16_by_the_e4m3_rounding():
    # One e4m3 rounding (3 mantissa bits: half a step is 2^-4 relative for a mantissa of 1) has
    # a relative RMS error of 2^-3 / sqrt(12) * sqrt(E[1/m^2]) ~ 0.0265 (m log-uniform on
    # [1, 2)). x and W_gu add two into g and u (x shared), SwiGLU passes both into act (~0.053),
    # then act and W_down add two more: ~sqrt(0.053^2 + 2 * 0.0265^2) ~ 0.065 (measured
    # 0.061 - 0.066). Bounds: above 0.03 (more than one quantisation ran), below 0.1.
    problem = _bf16_valued(_problem(dtype=torch.float32))
    fp8, _ = _run(problem, FP8, torch.float32, fused=True)
    bf16, _ = _run(problem, F.MoKConfig(expert_precision="bf16"), torch.float32, fused=True)
    assert not torch.equal(fp8, bf16)
    assert 0.03 < relative_error(fp8, bf16) < 0.1


@pytest.mark.parametrize("fused", [False, True])
def test_bf16_precision_is_the_default_bit_for_bit(fused):
    problem = _problem(dtype=torch.bfloat16)
    d_out = torch.randn(problem.x.shape, dtype=torch.bfloat16)
    cfg = F.MoKConfig(expert_precision="bf16")
    got_out, got = _run(problem, cfg, torch.bfloat16, fused, d_out)
    want_out, want = _run(problem, F.MoKConfig(), torch.bfloat16, fused, d_out)
    assert torch.equal(got_out, want_out)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("fused", [False, True])
def test_fp8_backward_is_bf16_backward_at_the_fp8_activations(fused):
    # float64 backend against autograd through the straight-through oracle: the data gradients
    # use the unquantised weights, the weight gradients the unquantised rows, SwiGLU's backward
    # and d_router_weights = <d_out, y> the FP8 forward's g, u, y. Linear in those, summed in
    # another order: 1e-12 (an FP8 value attached elsewhere, or a quantised x in d_w, is >1e-2).
    problem = _problem()
    d_out = torch.randn(problem.x.shape, dtype=torch.float64)
    _, got = _run(problem, FP8, torch.float64, fused, d_out)
    want_out, leaves = _oracle(problem)
    want_out.backward(d_out)
    want = dict(zip(ROUTED_GRADS, (leaf.grad for leaf in leaves)))
    if fused:
        want["d_w_routed_gate"] = interleave_gate_up(want["d_w_routed_gate"], want["d_w_routed_up"])
        want["d_w_routed_up"] = None
        assert got.d_w_routed_up is None
    for name in ROUTED_GRADS:
        if want[name] is not None:
            assert relative_error(getattr(got, name), want[name]) < 1e-12, name


def fp8_dgrad_oracle(problem, d_out):
    """(d_x, d_w_gate, d_w_up) in float64, expert by expert over the slots routed to it, for
    fp8_backward="dgrad": the data-gradient GEMMs read their rows rounded to bf16 and quantised
    in (1, 128) blocks (d_h in the interleaved [n, 2I] layout, as the CUDA L1 dgrad reads it)
    and the weights' (128, 128) FP8 values; SwiGLU's backward the L2 dgrad's output and the FP8
    forward's g and u, each rounded to bf16 (the CUDA path's tensors); the weight gradients the
    unquantised rows (they stay BF16)."""
    x, wg, wu, wd = (getattr(problem, n).double() for n in ("x", "w_gate", "w_up", "w_down"))
    topk, rw = problem.topk_experts, problem.router_weights.double()
    qg, qu, qd = _fp8_weights(wg, wu, wd)
    xq = _fp8(x, (1, 128))
    gate, up = _gate_up_rows(wg.shape[1])
    d_x, d_wg, d_wu = torch.zeros_like(x), torch.zeros_like(wg), torch.zeros_like(wu)
    for e in range(wg.shape[0]):
        tokens, slots = (topk == e).nonzero(as_tuple=True)
        g8, u8 = xq[tokens] @ qg[e].T, xq[tokens] @ qu[e].T
        dy = rw[tokens, slots, None] * d_out[tokens].double()
        da = (_fp8(dy.bfloat16(), (1, 128)) @ qd[e]).bfloat16().double()
        gb, ub = g8.bfloat16().double(), u8.bfloat16().double()
        sig = torch.sigmoid(gb)
        dg, du = da * ub * sig * (1 + gb * (1 - sig)), da * gb * sig
        d_h = torch.empty(len(tokens), 2 * wg.shape[1], dtype=torch.float64)
        d_h[:, gate], d_h[:, up] = dg, du
        d_hq = _fp8(d_h.bfloat16(), (1, 128))
        d_x = d_x.index_add(0, tokens, d_hq[:, gate] @ qg[e] + d_hq[:, up] @ qu[e])
        d_wg[e], d_wu[e] = dg.T @ x[tokens], du.T @ x[tokens]
    return d_x, d_wg, d_wu


@pytest.mark.parametrize("fused", [False, True])
def test_fp8_dgrad_matches_the_float64_oracle(fused):
    # float64 backend against fp8_dgrad_oracle: the same roundings (bf16, then e4m3 in the same
    # blocks) of values that differ by summation order only (~1e-16 relative, so a rounding
    # lands on the other side with probability ~1e-13 per element), then linear: 1e-12. The
    # other gradients are fp8_backward="bf16"'s, bit for bit.
    problem = _problem()
    d_out = torch.randn(problem.x.shape, dtype=torch.float64)
    dgrad = dataclasses.replace(FP8, fp8_backward="dgrad")
    _, got = _run(problem, dgrad, torch.float64, fused, d_out)
    _, bf16_bwd = _run(problem, FP8, torch.float64, fused, d_out)
    want_dx, want_wg, want_wu = fp8_dgrad_oracle(problem, d_out)
    got_wg, got_wu = got.d_w_routed_gate, got.d_w_routed_up
    if fused:
        from mok_megatron.ops.grouped_gemm import deinterleave_gate_up

        got_wg, got_wu = deinterleave_gate_up(got_wg, dim=-2)
    assert relative_error(got.d_x, want_dx) < 1e-12
    assert relative_error(got_wg, want_wg) < 1e-12
    assert relative_error(got_wu, want_wu) < 1e-12
    # Against the BF16 backward: each data-gradient GEMM now rounds two operands to e4m3 (~0.0265
    # relative RMS each, test_fp8_differs_from_bf16_by_the_e4m3_rounding), and d_x takes both
    # GEMMs' (d_h carries da's): ~sqrt(4) * 0.0265 ~ 0.053 (measured 0.050-0.051). Bounds:
    # above 0.03 (the operands were quantised), below 0.1.
    assert 0.03 < relative_error(got.d_x, bf16_bwd.d_x) < 0.1
    for name in ("d_router_weights", "d_w_routed_down"):
        assert torch.equal(getattr(got, name), getattr(bf16_bwd, name)), name


def test_fp8_backward_values_are_checked():
    with pytest.raises(ValueError, match="fp8_backward='wgrad' must be one of"):
        F.MoKConfig(expert_precision="fp8_blockwise", fp8_backward="wgrad")
    with pytest.raises(ValueError, match="needs expert_precision='fp8_blockwise'"):
        F.MoKConfig(fp8_backward="dgrad")
    assert F.MoKConfig(expert_precision="fp8_blockwise", fp8_backward="dgrad").fp8_backward == (
        "dgrad"
    )


def test_fp8_backward_in_bf16_runs_and_is_finite():
    problem = _problem(dtype=torch.bfloat16)
    d_out = torch.randn(problem.x.shape, dtype=torch.bfloat16)
    _, got = _run(problem, FP8, torch.bfloat16, True, d_out)
    _, bf16 = _run(problem, F.MoKConfig(), torch.bfloat16, True, d_out)
    for name in ("d_x", "d_router_weights", "d_w_routed_gate", "d_w_routed_down"):
        grad = getattr(got, name)
        assert torch.isfinite(grad).all() and grad.abs().max() > 0, name
    # the activations differ, so d_router_weights = <d_out, y> does too
    assert not torch.equal(got.d_router_weights, bf16.d_router_weights)


@pytest.mark.parametrize("hidden,inter", [(96, 128), (128, 64)])
@pytest.mark.parametrize("fused", [False, True])
def test_fp8_sizes_must_be_multiples_of_128(hidden, inter, fused):
    problem = random_moe_problem([16], hidden, inter, 4, 2, dtype=torch.float32)
    _run(problem, F.MoKConfig(), torch.float32, fused)  # bf16 takes these sizes
    match = rf"\(H={hidden}\) and intermediate \(I={inter}\) sizes that are multiples of 128"
    with pytest.raises(ValueError, match=match):
        _run(problem, FP8, torch.float32, fused)


def test_expert_precision_values_are_checked():
    with pytest.raises(ValueError, match="expert_precision='fp8' must be one of"):
        F.MoKConfig(expert_precision="fp8")
    # the FP8 megakernel forward: without clusters, its backward stage 1's
    with pytest.raises(ValueError, match="megakernel_cluster=2"):
        F.MoKConfig(expert_precision="fp8_blockwise", cuda_forward="megakernel",
                    megakernel_cluster=2)  # fmt: skip
    with pytest.raises(ValueError, match="cuda_backward='megakernel'"):
        F.MoKConfig(expert_precision="fp8_blockwise", cuda_forward="megakernel",
                    cuda_backward="megakernel")  # fmt: skip
    for forward in ("stage1", "megakernel"):
        cfg = F.MoKConfig(expert_precision="fp8_blockwise", cuda_forward=forward)
        assert (cfg.expert_precision, cfg.cuda_forward) == ("fp8_blockwise", forward)


def test_prequantised_weights_are_used_as_given():
    """(128, 128) FP8BlockTensor weights (functional.forward dequantises them for the checks and
    the backward, and keeps them as the weights' FP8 copies): the FP8 forward reads them as
    they are, so it gives what the same bf16 weights give when quantised by the layer; a BF16
    forward reads their dense values."""
    from mok_megatron.ops.fp8_blockwise import fp8_blockwise_dequantize, fp8_blockwise_quantize

    problem = _problem()
    x, topk, rw, (wg, wu, wd), _ = problem.local(0, dtype=torch.bfloat16)
    dense = (interleave_gate_up(wg, wu), None, wd)
    quantised = (fp8_blockwise_quantize(dense[0], (128, 128)), None,
                 fp8_blockwise_quantize(wd, (128, 128)))  # fmt: skip

    def forward(config, routed):
        ws = problem_workspace(problem, dtype=torch.bfloat16, config=config)
        sched = F.build_schedule(ws, config, topk, ws.num_local_experts)
        return F.forward(config, ws, sched, x, rw, None, None, None, *routed)[0]

    fp8 = F.MoKConfig(expert_precision="fp8_blockwise")
    assert torch.equal(forward(fp8, quantised), forward(fp8, dense))
    bf16 = F.MoKConfig()
    as_dense = tuple(None if q is None else fp8_blockwise_dequantize(q, torch.bfloat16)
                     for q in quantised)  # fmt: skip
    assert torch.equal(forward(bf16, quantised), forward(bf16, as_dense))


def _mxfp8(w: torch.Tensor):
    from mok_megatron.ops import mxfp8_quantize

    return mxfp8_quantize(w, rowwise=True, colwise=False)


def test_requantised_mxfp8_is_the_exact_value_quantised_within_the_stated_bound():
    """ops.requantize_mxfp8: the (128, 128)-block quantisation of the MXFP8 weight's exact value
    (bitwise), each element within max(2^-4 |v|, 2^-10 s) * (1 + 2^-20) of that value."""
    from mok_megatron.ops import mxfp8_dequantize, requantize_mxfp8
    from mok_megatron.ops.fp8_blockwise import fp8_blockwise_dequantize, fp8_blockwise_quantize

    w = torch.randn(2, 256, 384) * torch.logspace(-3, 2, 384)  # blocks of unlike magnitudes
    mx = _mxfp8(w.bfloat16())
    v = mxfp8_dequantize(mx.rowwise, torch.float32)
    q = requantize_mxfp8(mx)
    want = fp8_blockwise_quantize(v, (128, 128))
    assert q.block == (128, 128)
    assert torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(q.scales, want.scales)
    err = (fp8_blockwise_dequantize(q) - v).abs()
    s = q.scales.repeat_interleave(128, dim=-2).repeat_interleave(128, dim=-1)
    bound = torch.maximum(v.abs() * 2.0**-4, s * 2.0**-10) * (1 + 2.0**-20)
    assert (err <= bound).all()
    assert err.max() > 0  # it rounds: the bound is what is checked, not a copy
    colwise_only = (None, mx.rowwise)  # an MXFP8Weight's other slot works the same
    assert torch.equal(requantize_mxfp8(colwise_only).scales, q.scales)
    with pytest.raises(TypeError, match="MXFP8Tensor or MXFP8Weight"):
        requantize_mxfp8(w)


def test_fp8_forward_runs_mxfp8_weights_requantised_once_per_update(monkeypatch):
    """MXFP8 weights (the fused form's gate_up and down) in an fp8_blockwise forward: the output
    is that of their requantisation passed as FP8BlockTensors, and the requantisation runs once
    per weight (kept across passes) until the weights change (an optimizer step, or
    invalidate_fp8_weight_cache)."""
    import mok_megatron.ops.fp8_blockwise as fb
    from mok_megatron.functional.fp8_weights import invalidate_fp8_weight_cache

    problem = _problem()
    x, topk, rw, (wg, wu, wd), _ = problem.local(0, dtype=torch.bfloat16)
    mx = (_mxfp8(interleave_gate_up(wg, wu)), None, _mxfp8(wd))
    requantised = (fb.requantize_mxfp8(mx[0]), None, fb.requantize_mxfp8(mx[2]))
    calls = []
    real = fb.requantize_mxfp8
    monkeypatch.setattr(
        fb, "requantize_mxfp8", lambda w, *a, **k: calls.append(1) or real(w, *a, **k)
    )
    fp8 = F.MoKConfig(expert_precision="fp8_blockwise")
    ws = problem_workspace(problem, dtype=torch.bfloat16, config=fp8)

    def forward(routed):
        sched = F.build_schedule(ws, fp8, topk, ws.num_local_experts)
        return F.forward(fp8, ws, sched, x, rw, None, None, None, *routed)[0]

    first = forward(mx)
    assert len(calls) == 2  # gate_up and down
    assert torch.equal(forward(mx), first) and len(calls) == 2  # kept
    assert torch.equal(forward(requantised), first)
    invalidate_fp8_weight_cache()
    assert torch.equal(forward(mx), first) and len(calls) == 4


def test_the_transposed_fp8_weight_is_the_transpose_quantised_and_follows_updates():
    """fp8_weight_transposed: bit for bit the (128, 128) quantisation of the transposed weight
    (a block holds the same values either way); kept while the weight is unchanged, made again
    after an in-place update."""
    from mok_megatron.functional.fp8_weights import fp8_weight_transposed
    from mok_megatron.ops.grouped_gemm_fp8 import fp8_gemm_weight

    gen = torch.Generator().manual_seed(7)
    w = torch.randn(3, 256, 384, generator=gen).bfloat16()
    w[1, :128, 128:256] *= 64  # blocks of very different scales
    got = fp8_weight_transposed(w)
    want = fp8_gemm_weight(w.transpose(1, 2).contiguous())
    assert got.data.shape == (3, 384, 256) and tuple(got.block) == (128, 128)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scales, want.scales)
    assert fp8_weight_transposed(w) is got  # kept
    w.mul_(2)  # the version counter moves: both copies are made again
    again = fp8_weight_transposed(w)
    assert again is not got and torch.equal(again.scales, 2 * got.scales)
    # a caller's own quantisation (attach_fp8_weight), written in place: transposed again
    from mok_megatron.functional.fp8_weights import attach_fp8_weight

    dense = w.clone()
    q = fp8_gemm_weight(dense)
    attach_fp8_weight(dense, q)
    first = fp8_weight_transposed(dense)
    assert fp8_weight_transposed(dense) is first
    q.scales.mul_(4)
    assert torch.equal(fp8_weight_transposed(dense).scales, 4 * first.scales)


def test_functional_moe_quantises_each_weight_once_per_update(monkeypatch):
    """Through functional.moe (the Megatron layer's path), whose autograd hands the FP8 forward a
    fresh detached alias of down on every call: each weight is quantised on the first call and
    its copy kept across calls (down's too), then quantised again after an in-place update.
    (At 8e5394a..e35e316 down was quantised on every call: +10 ms per forward on deepseek-v3.)"""
    import mok_megatron.ops.grouped_gemm_fp8 as gf

    problem = _problem()
    x, topk, rw, (wg, wu, wd), _ = problem.local(0, dtype=torch.bfloat16)
    gate_up = interleave_gate_up(wg, wu).requires_grad_()
    down = wd.clone().requires_grad_()
    ws = problem_workspace(problem, dtype=torch.bfloat16, config=FP8)
    shapes = []
    real = gf.fp8_gemm_weight
    monkeypatch.setattr(gf, "fp8_gemm_weight",
                        lambda w, *a, **k: shapes.append(tuple(w.shape)) or real(w, *a, **k))  # fmt: skip

    def step():
        out = F.moe(x, topk, rw, gate_up, None, down, config=FP8, workspace=ws)
        out.float().square().sum().backward()
        return out.detach()

    first = step()
    assert sorted(shapes) == sorted([tuple(gate_up.shape), tuple(down.shape)])
    for _ in range(2):
        assert torch.equal(step(), first)
    assert len(shapes) == 2, f"quantised again without an update: {shapes[2:]}"
    with torch.no_grad():
        down.mul_(0.5)  # an in-place update: the kept copy is stale
    step()
    assert shapes[2:] == [tuple(down.shape)]
