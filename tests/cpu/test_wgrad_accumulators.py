"""``functional.backward(..., wgrad_accumulators=...)`` and ``functional.moe``'s on the reference
backend: the routed-weight gradients are added into caller buffers (Megatron's gradient-
accumulation fusion) instead of being returned.

The buffers must end as exactly ``old + the gradient a non-accumulating run returns`` (float32
and float64 runs, both weight forms, with and without a shared expert, one rank and EP 2); the
float64 sum matches a dense float64 oracle; experts without rows keep their buffer bits (NaN and
-0.0 included); every other gradient is unchanged; bad buffers raise naming the rule.
"""

from __future__ import annotations

import pytest
import torch

from mok_megatron import functional as F
from mok_megatron.ops import deinterleave_gate_up, interleave_gate_up
from mok_megatron.testing import random_moe_problem, relative_error, run_ranks
from mok_megatron.testing.runs import global_d_out, problem_workspace, run_oracle

ROUTED_SLOTS = (2, 3, 4)  # d_w_routed_gate, _up, _down in MoKGradients


class Pass:
    """One rank's forward of a problem, ready for backwards with and without accumulators."""

    def __init__(self, problem, dtype, form="split", rank=0, seed=0):
        self.config = F.MoKConfig(schedule_capacity_multiplier=float(problem.num_ranks))
        x, topk, rw, routed, shared = problem.local(rank, dtype=dtype)
        self.rw = rw.double() if dtype == torch.float64 else rw
        if form == "fused":
            routed = (interleave_gate_up(routed[0], routed[1]), None, routed[2])
        self.x, self.routed = x, routed
        self.weights = (*(shared or (None, None, None)), *routed)
        self.ws = problem_workspace(problem, dtype=dtype, config=self.config)
        self.sched = F.build_schedule(self.ws, self.config, topk, self.ws.num_local_experts)
        _, self.ctx = F.forward(self.config, self.ws, self.sched, x, self.rw, *self.weights)
        d_out = global_d_out(problem, seed)[problem.token_slice(rank)]
        self.d_out = d_out.to(dtype).contiguous()

    def backward(self, accumulators=None) -> F.MoKGradients:
        return F.backward(self.config, self.ws, self.sched, self.ctx, self.d_out, self.x, self.rw,
                          *self.weights, wgrad_accumulators=accumulators)  # fmt: skip

    def buffers(self, dtype=torch.float32, seed=1):
        """Random accumulators in the routed weights' form (None where the weight is None)."""
        gen = torch.Generator().manual_seed(seed)
        return tuple(
            None if w is None else torch.randn(w.shape, generator=gen, dtype=dtype)
            for w in self.routed
        )


def _copies(buffers):
    return tuple(None if b is None else b.clone() for b in buffers)


def _assert_bits_equal(name, got, want):
    assert got.dtype == want.dtype and got.shape == want.shape, name
    bits = {4: torch.int32, 8: torch.int64}[got.element_size()]
    assert torch.equal(got.view(bits), want.view(bits)), f"{name}: not bitwise equal"


@pytest.mark.parametrize("form", ["split", "fused"])
@pytest.mark.parametrize("dtype,acc_dtype", [
    (torch.float32, torch.float32), (torch.float64, torch.float64),
    (torch.float64, torch.float32),
])  # fmt: skip
@pytest.mark.parametrize("shared_inter", [0, 24])
def test_buffers_get_exactly_old_plus_the_returned_gradient(form, dtype, acc_dtype, shared_inter):
    problem = random_moe_problem([53], 32, 48, 8, 3, shared_inter=shared_inter,
                                 empty_slot_fraction=0.1, dtype=dtype, seed=4)  # fmt: skip
    run = Pass(problem, dtype, form)
    plain = run.backward()
    old = run.buffers(acc_dtype)
    buffers = _copies(old)
    fused = run.backward(buffers)
    for slot, buf, before in zip(ROUTED_SLOTS, buffers, old):
        assert fused[slot] is None, f"{fused._fields[slot]} must not be returned"
        if buf is not None:
            _assert_bits_equal(fused._fields[slot], buf, before + plain[slot].to(acc_dtype))
    for name in ("d_x", "d_router_weights", "d_w_shared_gate", "d_w_shared_up", "d_w_shared_down"):
        a, b = getattr(fused, name), getattr(plain, name)
        assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.parametrize("form", ["split", "fused"])
def test_float64_sum_matches_the_dense_oracle(form):
    problem = random_moe_problem([61], 16, 24, 4, 2, dtype=torch.float64, seed=9)
    run = Pass(problem, torch.float64, form, seed=3)
    buffers = tuple(None if w is None else torch.zeros_like(w) for w in run.routed)
    run.backward(buffers)
    want = run_oracle(problem, global_d_out(problem, 3))
    gate, up, down = buffers
    if form == "fused":
        gate, up = deinterleave_gate_up(gate, dim=-2)
    for name, got in (("d_w_routed_gate", gate), ("d_w_routed_up", up),
                      ("d_w_routed_down", down)):  # fmt: skip
        assert relative_error(got, want[name]) < 1e-12, name


@pytest.mark.parametrize("form", ["split", "fused"])
def test_experts_without_rows_keep_their_bits(form):
    """64 experts, 5 tokens x top-2: most experts get no row; their parts hold NaN and -0.0
    before and must hold the same bits after (adding +0.0 would turn -0.0 into +0.0)."""
    problem = random_moe_problem([5], 16, 24, 64, 2, dtype=torch.float32, seed=2)
    run = Pass(problem, torch.float32, form)
    used = torch.zeros(64, dtype=torch.bool)
    used[problem.topk_experts[problem.topk_experts >= 0]] = True
    assert (~used).sum() > 40
    plain = run.backward()
    old = run.buffers()
    for buf in old:
        if buf is not None:
            buf[~used] = -0.0
            buf[~used, 0, :3] = float("nan")
    buffers = _copies(old)
    run.backward(buffers)
    for slot, buf, before in zip(ROUTED_SLOTS, buffers, old):
        if buf is None:
            continue
        _assert_bits_equal("unused experts", buf[~used], before[~used])
        _assert_bits_equal("used experts", buf[used], before[used] + plain[slot][used])


def test_no_tokens_leave_every_buffer_untouched():
    problem = random_moe_problem([0], 16, 24, 4, 2, dtype=torch.float32, seed=1)
    config = F.MoKConfig()
    x, topk, rw, routed, _ = problem.local(0)
    ws = problem_workspace(problem, dtype=torch.float32, config=config, num_local_tokens=8)
    sched = F.build_schedule(ws, config, topk, ws.num_local_experts)
    weights = (None, None, None, *routed)
    _, ctx = F.forward(config, ws, sched, x, rw, *weights)
    old = tuple(torch.randn(w.shape) for w in routed)
    buffers = _copies(old)
    F.backward(config, ws, sched, ctx, torch.zeros_like(x), x, rw, *weights,
               wgrad_accumulators=buffers)  # fmt: skip
    for buf, before in zip(buffers, old):
        _assert_bits_equal("buffer", buf, before)


def test_mxfp8_weights_accumulate_their_dense_gradient():
    from mok_megatron.ops import mxfp8_quantize

    problem = random_moe_problem([40], 64, 64, 4, 2, dtype=torch.float32, seed=5)
    run = Pass(problem, torch.float32)
    quantized = [mxfp8_quantize(w, rowwise=True, colwise=True) for w in run.routed]
    run.weights = (None, None, None, *quantized)
    _, run.ctx = F.forward(run.config, run.ws, run.sched, run.x, run.rw, *run.weights)
    plain = run.backward()
    old = run.buffers()
    buffers = _copies(old)
    run.backward(buffers)
    for slot, buf, before in zip(ROUTED_SLOTS, buffers, old):
        _assert_bits_equal(plain._fields[slot], buf, before + plain[slot])


def _ep_rank(rank, world_size, problem, form):
    run = Pass(problem, torch.float32, form, rank=rank)
    plain = run.backward()
    old = run.buffers(seed=rank + 10)
    buffers = _copies(old)
    run.backward(buffers)
    return [
        None if buf is None else torch.equal(buf, before + plain[slot])
        for slot, buf, before in zip(ROUTED_SLOTS, buffers, old)
    ]


@pytest.mark.parametrize("form", ["split", "fused"])
def test_expert_parallel_ranks_accumulate_their_own_experts(form):
    problem = random_moe_problem([30, 17], 16, 24, 8, 2, routing="skewed", seed=6)
    for rank, equal in enumerate(run_ranks(_ep_rank, 2, problem, form)):
        assert all(e in (None, True) for e in equal), f"rank {rank}: {equal}"


# ------------------------------------------------------------------------------ autograd
def test_moe_autograd_accumulates_and_hands_autograd_what_it_is_told():
    problem = random_moe_problem([33], 16, 24, 4, 2, shared_inter=8, dtype=torch.float32, seed=7)
    x, topk, rw, routed, shared = problem.local(0)
    gate_up, down = interleave_gate_up(routed[0], routed[1]), routed[2]
    config = F.MoKConfig()
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))

    def step(accumulators=None, accumulated_grad=None):
        leaves = [t.clone().requires_grad_() for t in (x, rw, gate_up, down, *shared)]
        out = F.moe(leaves[0], topk, leaves[1], leaves[2], None, leaves[3],
                    shared=tuple(leaves[4:]), config=config, wgrad_accumulators=accumulators,
                    accumulated_grad=accumulated_grad)  # fmt: skip
        out.backward(d_out)
        return [leaf.grad for leaf in leaves]

    plain = step()
    old = (torch.randn(gate_up.shape), None, torch.randn(down.shape))
    buffers = _copies(old)
    got = step(buffers)
    assert got[2] is None and got[3] is None  # default: the weights get no gradient
    for i in (0, 1, 4, 5, 6):
        assert torch.equal(got[i], plain[i]), i
    _assert_bits_equal("gate_up", buffers[0], old[0] + plain[2])
    _assert_bits_equal("down", buffers[2], old[2] + plain[3])

    seen = []

    def placeholder(weight, buffer):
        seen.append((tuple(weight.shape), buffer))
        return torch.zeros_like(weight)

    got = step(_copies(old), placeholder)
    # down first: its gradient is handed to autograd before gate_up's is made (functional.moe)
    assert [s for s, _ in seen] == [tuple(down.shape), tuple(gate_up.shape)]
    assert torch.count_nonzero(got[2]) == 0 and torch.count_nonzero(got[3]) == 0


# ----------------------------------------------------------------------------- bad input
def _misaligned(t):
    return torch.zeros(t.numel() + 1)[1:].view(t.shape)  # 4 bytes past an aligned address


BAD_BUFFERS = [  # (form, buffers from (g, u, d, gu), error, match)
    ("split", lambda g, u, d, gu: (g, u), TypeError,
     r"3 buffers in the routed weights' order, \(gate, up, down\); got tuple of 2"),
    ("split", lambda g, u, d, gu: g, TypeError, "3 buffers .*; got Tensor"),
    ("fused", lambda g, u, d, gu: (gu, u, d), ValueError,
     r"wgrad_accumulators\[1\] must be None with the fused gate/up form"),
    ("split", lambda g, u, d, gu: (g.bfloat16(), u, d), TypeError,
     r"wgrad_accumulators\[0\] has dtype torch.bfloat16; .* pass a float32 buffer"),
    ("split", lambda g, u, d, gu: (g, u.double(), d), TypeError,
     r"wgrad_accumulators\[1\] has dtype torch.float64"),
    ("split", lambda g, u, d, gu: (g, u, gu), ValueError,
     r"wgrad_accumulators\[2\] has shape \(4, 48, 16\); .* weight's shape \(4, 16, 24\)"),
    ("split", lambda g, u, d, gu: (g.to("meta"), u, d), ValueError,
     "is on meta but the workspace is on cpu"),
    ("split", lambda g, u, d, gu: (g, u, d.transpose(1, 2).contiguous().transpose(1, 2)),
     ValueError, "must be contiguous"),
    ("split", lambda g, u, d, gu: (g, u, _misaligned(d)), ValueError,
     "not 16-byte aligned .* multiple of 4 float32"),
    ("fused", lambda g, u, d, gu: (gu.requires_grad_(), None, d), ValueError,
     "requires grad; .* pass it detached"),
    ("split", lambda g, u, d, gu: (g, "main_grad", d), TypeError,
     r"wgrad_accumulators\[1\] must be a torch.Tensor"),
]  # fmt: skip


@pytest.mark.parametrize("form,make,error,match", BAD_BUFFERS)
def test_bad_buffers_raise_naming_the_rule(form, make, error, match):
    problem = random_moe_problem([20], 16, 24, 4, 2, dtype=torch.float32, seed=8)
    run = Pass(problem, torch.float32, form)
    g, u, d = Pass(problem, torch.float32).buffers()
    gu = Pass(problem, torch.float32, "fused").buffers()[0]
    with pytest.raises(error, match=match):
        run.backward(make(g, u, d, gu))


def test_moe_checks_buffers_at_the_forward():
    problem = random_moe_problem([9], 16, 24, 4, 2, dtype=torch.float32, seed=3)
    x, topk, rw, (wg, wu, wd), _ = problem.local(0)
    with pytest.raises(TypeError, match="has dtype torch.bfloat16"):
        F.moe(x, topk, rw, wg, wu, wd, config=F.MoKConfig(),
              wgrad_accumulators=(torch.zeros(wg.shape, dtype=torch.bfloat16), None, None))  # fmt: skip
    with pytest.raises(ValueError, match="accumulated_grad is for wgrad_accumulators"):
        F.moe(x, topk, rw, wg, wu, wd, config=F.MoKConfig(), accumulated_grad=lambda w, b: None)
