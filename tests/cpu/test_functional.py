"""The functional API on the reference backend against an independent dense float64 oracle."""

from __future__ import annotations

import pytest
import torch

from mok_megatron import functional as F
from mok_megatron.testing import dense_moe, random_moe_problem, relative_error
from mok_megatron.testing.runs import GRAD_NAMES, problem_workspace, run_local, run_oracle


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("shared_inter", [0, 24])
@pytest.mark.parametrize("topk,empty", [(1, 0.0), (2, 0.25), (4, 0.1)])
def test_forward_and_all_gradients_match_dense_oracle(dtype, tol, shared_inter, topk, empty):
    problem = random_moe_problem([53], 32, 48, 8, topk, shared_inter=shared_inter,
                                 empty_slot_fraction=empty, dtype=dtype)  # fmt: skip
    got = run_local(problem, rank=0, dtype=dtype)
    want = run_oracle(problem, got["d_out"])
    assert relative_error(got["out"], want["out"]) < tol
    for name in GRAD_NAMES:
        if want[name] is None:
            assert got[name] is None, name
            continue
        # router-weight gradients come back in router_weights' float32
        bound = 1e-6 if name == "d_router_weights" and dtype == torch.float64 else tol
        assert relative_error(got[name], want[name]) < bound, name


def test_bf16_error_within_twice_pytorch_bf16():
    problem = random_moe_problem([96], 64, 96, 8, 2, shared_inter=32, dtype=torch.float64)
    got = run_local(problem, rank=0, dtype=torch.bfloat16)
    exact = run_oracle(problem, got["d_out"].double())
    torch_bf16 = dense_moe(problem.x.bfloat16(), problem.topk_experts,
                           problem.router_weights.bfloat16(), problem.w_gate.bfloat16(),
                           problem.w_up.bfloat16(), problem.w_down.bfloat16(),
                           shared=tuple(w.bfloat16() for w in problem.shared))  # fmt: skip
    err = relative_error(got["out"], exact["out"])
    assert err < 1e-2
    assert err <= 2 * relative_error(torch_bf16, exact["out"]) + 1e-3


def test_repeated_runs_are_bitwise_identical():
    problem = random_moe_problem([61], 32, 40, 8, 3, shared_inter=16, dtype=torch.float32)
    first = run_local(problem, rank=0, dtype=torch.float32, seed=7)
    second = run_local(problem, rank=0, dtype=torch.float32, seed=7)
    for name in ("out", *GRAD_NAMES):
        assert torch.equal(first[name], second[name]), name


def test_recompute_forward_context_gives_the_same_backward():
    problem = random_moe_problem([45], 16, 24, 4, 2, dtype=torch.float32)
    cfg = F.MoKConfig()
    x, topk, rw, routed, shared = problem.local(0)
    ws = problem_workspace(problem, dtype=torch.float32, config=cfg)
    sched = F.build_schedule(ws, cfg, topk, ws.num_local_experts)
    weights = (None, None, None, *routed)
    _, ctx = F.forward(cfg, ws, sched, x, rw, *weights)
    d_out = torch.randn_like(x)
    first = F.backward(cfg, ws, sched, ctx, d_out, x, rw, *weights)
    ctx2 = F.recompute_forward_context(cfg, ws, sched, x, rw, *weights)
    second = F.backward(cfg, ws, sched, ctx2, d_out, x, rw, *weights)
    for a, b in zip(first, second):
        assert (a is None and b is None) or torch.equal(a, b)


def test_moe_autograd_matches_functional_backward():
    problem = random_moe_problem([33], 16, 24, 4, 2, shared_inter=8, dtype=torch.float64)
    got = run_local(problem, rank=0, dtype=torch.float64)
    x, topk, rw, routed, shared = problem.local(0)
    leaves = [t.clone().requires_grad_() for t in (x, rw.double(), *routed, *shared)]
    out = F.moe(leaves[0], topk, leaves[1], *leaves[2:5], shared=tuple(leaves[5:]),
                config=F.MoKConfig())  # fmt: skip
    out.backward(got["d_out"])
    assert torch.equal(out.detach(), got["out"])
    for leaf, name in zip(leaves, GRAD_NAMES):
        assert relative_error(leaf.grad, got[name]) < 1e-6, name


def test_no_tokens_and_experts_without_tokens():
    problem = random_moe_problem([0], 16, 24, 4, 2, dtype=torch.float64)
    got = run_local(problem, rank=0, dtype=torch.float64, num_local_tokens=8)
    assert got["out"].shape == (0, 16)
    assert torch.equal(got["d_w_routed_gate"], torch.zeros_like(got["d_w_routed_gate"]))


def test_mxfp8_weights_are_served_by_dequantizing():
    from mok_megatron.ops import mxfp8_dequantize, mxfp8_quantize

    problem = random_moe_problem([40], 64, 64, 4, 2, dtype=torch.float32)
    cfg = F.MoKConfig()
    x, topk, rw, routed, _ = problem.local(0)
    ws = problem_workspace(problem, dtype=torch.float32, config=cfg)
    sched = F.build_schedule(ws, cfg, topk, ws.num_local_experts)
    quantized = [mxfp8_quantize(w, rowwise=True, colwise=True) for w in routed]
    dense = [mxfp8_dequantize(q.rowwise, dtype=torch.float32) for q in quantized]
    assert all(relative_error(d, w) < 0.05 for d, w in zip(dense, routed))  # e4m3: 3-bit mantissa
    out_q, ctx_q = F.forward(cfg, ws, sched, x, rw, None, None, None, *quantized)
    out_d, ctx_d = F.forward(cfg, ws, sched, x, rw, None, None, None, *dense)
    assert torch.equal(out_q, out_d)
    d_out = torch.randn_like(x)
    grads_q = F.backward(cfg, ws, sched, ctx_q, d_out, x, rw, None, None, None, *quantized)
    grads_d = F.backward(cfg, ws, sched, ctx_d, d_out, x, rw, None, None, None, *dense)
    for a, b in zip(grads_q, grads_d):
        assert (a is None and b is None) or torch.equal(a, b)


def test_fused_gate_up_form_equals_the_split_form():
    """(gate_up interleaved, None, down) gives the split form's results bit for bit, and the
    fused weight's gradient is the split gradients interleaved the same way."""
    from mok_megatron.ops import interleave_gate_up

    problem = random_moe_problem([57], 32, 48, 8, 3, shared_inter=16, dtype=torch.float32)
    cfg = F.MoKConfig()
    x, topk, rw, (wg, wu, wd), shared = problem.local(0)
    ws = problem_workspace(problem, dtype=torch.float32, config=cfg)
    sched = F.build_schedule(ws, cfg, topk, ws.num_local_experts)
    split = (*shared, wg, wu, wd)
    fused = (*shared, interleave_gate_up(wg, wu), None, wd)
    out_s, ctx_s = F.forward(cfg, ws, sched, x, rw, *split)
    out_f, ctx_f = F.forward(cfg, ws, sched, x, rw, *fused)
    assert torch.equal(out_s, out_f)
    d_out = torch.randn_like(x)
    g_s = F.backward(cfg, ws, sched, ctx_s, d_out, x, rw, *split)
    g_f = F.backward(cfg, ws, sched, ctx_f, d_out, x, rw, *fused)
    assert g_f.d_w_routed_up is None
    assert torch.equal(
        g_f.d_w_routed_gate, interleave_gate_up(g_s.d_w_routed_gate, g_s.d_w_routed_up)
    )
    for name in ("d_x", "d_router_weights", "d_w_routed_down", "d_w_shared_gate"):
        assert torch.equal(getattr(g_f, name), getattr(g_s, name)), name


def test_moe_autograd_takes_the_fused_gate_up_form():
    from mok_megatron.ops import deinterleave_gate_up, interleave_gate_up

    problem = random_moe_problem([33], 16, 24, 4, 2, dtype=torch.float64)
    x, topk, rw, (wg, wu, wd), _ = problem.local(0)
    gate_up = interleave_gate_up(wg, wu).requires_grad_()
    down = wd.clone().requires_grad_()
    out = F.moe(x, topk, rw.double(), gate_up, None, down, config=F.MoKConfig())
    d_out = torch.randn_like(out)
    out.backward(d_out)
    want = run_oracle(problem, d_out)
    assert relative_error(out.detach(), want["out"]) < 1e-12
    d_gate, d_up = deinterleave_gate_up(gate_up.grad, dim=-2)
    assert relative_error(d_gate, want["d_w_routed_gate"]) < 1e-12
    assert relative_error(d_up, want["d_w_routed_up"]) < 1e-12
    assert relative_error(down.grad, want["d_w_routed_down"]) < 1e-12


def _leaves_of(node) -> set[int]:
    """ids of the leaf tensors whose gradient ``node`` hands to autograd directly."""
    return {id(f.variable) for f, _ in node.next_functions if hasattr(f, "variable")}


def _moe_leaves(problem, requires=(True, True, True, True)):
    from mok_megatron.ops import interleave_gate_up

    x, topk, rw, (wg, wu, wd), _ = problem.local(0)
    leaves = [t.clone().requires_grad_(r)
              for t, r in zip((x, rw.double(), interleave_gate_up(wg, wu), wd), requires)]  # fmt: skip
    return topk, leaves


def _moe(topk, leaves):
    x, rw, gate_up, down = leaves
    return F.moe(x, topk, rw, gate_up, None, down, config=F.MoKConfig())


def test_moe_autograd_hands_over_the_down_gradient_first():
    """moe's graph has two nodes: the output's (its backward is the backward's first step) has
    the edge of the routed down weight, the layer's the others, so autograd adds the down
    gradient into .grad (and lets it go) before the gate/up gradient is made. The gradients are
    the oracle's; the output can be modified in place; a second backward says why it cannot."""
    from mok_megatron.ops import deinterleave_gate_up

    problem = random_moe_problem([33], 16, 24, 4, 2, dtype=torch.float64, seed=11)
    topk, leaves = _moe_leaves(problem)
    x, rw, gate_up, down = leaves
    out = _moe(topk, leaves)
    first = out.grad_fn
    assert _leaves_of(first) == {id(down)}
    (layer,) = [f for f, _ in first.next_functions if f is not None and f.next_functions]
    assert _leaves_of(layer) == {id(x), id(rw), id(gate_up)}
    order = []
    for name, p in (("down", down), ("gate_up", gate_up), ("x", x)):
        p.register_post_accumulate_grad_hook(lambda _, name=name: order.append(name))
    d_out = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))
    out.backward(d_out, retain_graph=True)
    assert order[0] == "down" and set(order) == {"down", "gate_up", "x"}, order
    want = run_oracle(problem, d_out)
    d_gate, d_up = deinterleave_gate_up(gate_up.grad, dim=-2)
    for got, name in ((x.grad, "d_x"), (rw.grad, "d_router_weights"), (d_gate, "d_w_routed_gate"),
                      (d_up, "d_w_routed_up"), (down.grad, "d_w_routed_down")):  # fmt: skip
        assert relative_error(got, want[name]) < 1e-12, name
    with pytest.raises(RuntimeError, match="backward already ran .* run the forward again"):
        out.backward(d_out)

    _, again = _moe_leaves(problem)
    doubled = _moe(topk, again)
    doubled.mul_(2)  # in place on the output
    doubled.backward(d_out)
    assert relative_error(again[3].grad, 2 * want["d_w_routed_down"]) < 1e-12


def test_moe_autograd_with_only_the_down_weight_to_train():
    """Only the routed down weight requires grad: the output's node alone runs the backward."""
    problem = random_moe_problem([21], 16, 24, 4, 2, dtype=torch.float64, seed=12)
    topk, leaves = _moe_leaves(problem, requires=(False, False, False, True))
    out = _moe(topk, leaves)
    d_out = torch.randn_like(out)
    out.backward(d_out)
    want = run_oracle(problem, d_out)
    assert relative_error(leaves[3].grad, want["d_w_routed_down"]) < 1e-12
    assert all(leaf.grad is None for leaf in leaves[:3])


@pytest.mark.parametrize("inter,shape_fix,match", [
    (24, lambda w: w[:, :-8], r"w_routed_gate_up .* has shape \(4, 40, 16\), expected \(4, 48, 16\)"),
    (20, None, "multiple of 8"),
])  # fmt: skip
def test_fused_gate_up_form_rejects_bad_weights(inter, shape_fix, match):
    problem = random_moe_problem([9], 16, inter, 4, 2, dtype=torch.float32)
    cfg = F.MoKConfig()
    x, topk, rw, (wg, wu, wd), _ = problem.local(0)
    ws = problem_workspace(problem, dtype=torch.float32, config=cfg)
    sched = F.build_schedule(ws, cfg, topk, ws.num_local_experts)
    gate_up = torch.cat([wg, wu], dim=1)  # the interleave itself needs I % 8 == 0
    if shape_fix is not None:
        gate_up = shape_fix(gate_up).contiguous()
    with pytest.raises(ValueError, match=match):
        F.forward(cfg, ws, sched, x, rw, None, None, None, gate_up, None, wd)


def test_expert_gemm_setting_is_checked():
    from mok_megatron.functional.cuda.experts import engine_steps

    assert engine_steps("torch", torch.device("cpu")) == ()
    with pytest.raises(ValueError, match="list of"):
        engine_steps("l1,fp8", torch.device("cpu"))
    with pytest.raises(RuntimeError, match="expert_gemm='l1\\+l2' but the expert GEMM engine"):
        engine_steps("l1+l2", torch.device("cpu"))  # asked for explicitly where it can't run


def test_engine_weight_gradients_run_in_the_wgrad_tuning(monkeypatch):
    """Both weight-gradient ops on the engine take experts.WGRAD_TUNING, read at the call (the
    bench's pingpong contender replaces it), and no other GEMM step does."""
    from mok_megatron.functional.cuda import experts as cuda_experts
    from mok_megatron.functional.types import FusedExpertWeights
    from mok_megatron.ops import grouped_gemm as gg

    seen = []
    monkeypatch.setattr(gg, "grouped_gemm_tn", lambda *a, tuning=None: seen.append(("tn", tuning)))
    monkeypatch.setattr(gg, "grouped_gemm_tn_accumulate",
                        lambda *a, tuning=None: seen.append(("acc", tuning)))  # fmt: skip
    monkeypatch.setattr(gg, "grouped_gemm_nt", lambda *a, tuning=None: seen.append(("nt", tuning)))
    gen = torch.Generator().manual_seed(3)
    routed = FusedExpertWeights(torch.randn(2, 32, 16, generator=gen),
                                torch.randn(2, 16, 16, generator=gen))  # fmt: skip
    experts = cuda_experts.Experts(routed, "torch", torch.device("cpu"), accumulate=True)
    experts.engine, experts.accumulate_on_engine = ("l2", "wgrad"), True  # as on Hopper
    pingpong = gg.GemmTuning(schedule="pingpong")
    monkeypatch.setattr(cuda_experts, "WGRAD_TUNING", pingpong)
    a, b, offs = torch.randn(8, 16), torch.randn(8, 16), torch.tensor([3, 8], dtype=torch.int32)
    experts.mm_tn(a, b, offs)
    experts.mm_tn_accumulate(a, b, offs, torch.zeros(2, 16, 16))
    experts.mm_nt(a, routed.down, offs)
    assert seen == [("tn", pingpong), ("acc", pingpong), ("nt", None)]


@pytest.mark.parametrize("hidden, inter", [(128, 64), (64, 128)])
def test_backward_reads_y_only_for_the_fused_dswiglu(hidden, inter):
    """The forward keeps the L2 output rows y [M, H] only where the backward reads them: with
    the engine's fused L2 dgrad + dSwiGLU (or FP8 experts, not built on CPU); I < H or I > H."""
    from mok_megatron.functional.cuda.experts import Experts
    from mok_megatron.functional.types import ExpertWeights, FusedExpertWeights

    gen = torch.Generator().manual_seed(hidden + inter)
    down = torch.randn(4, hidden, inter, generator=gen)
    fused = FusedExpertWeights(torch.randn(4, 2 * inter, hidden, generator=gen), down)
    split = ExpertWeights(*torch.randn(2, 4, inter, hidden, generator=gen), down)
    for routed in (fused, split):
        assert not Experts(routed, "torch", torch.device("cpu")).backward_reads_y
    experts = Experts(fused, "torch", torch.device("cpu"))
    experts.engine = ("l1", "dswiglu")  # as on Hopper with expert_gemm="l1,dswiglu"
    assert experts.backward_reads_y
