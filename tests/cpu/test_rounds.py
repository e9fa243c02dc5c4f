"""The CUDA backend's macrobatch-round plan, checked on the CPU (it is plain tensor code).

The rounds split the padded row layout into equal windows; each window's group ends must give
every expert exactly the rows of its padded group that fall in the window, so that the rounds
together run every row once, in order.
"""

from __future__ import annotations

import math

import pytest
import torch

from mok_megatron.functional.cuda.plan import GROUP_ALIGN, make_rounds, padded_plan, window_offs
from mok_megatron.functional.schedule import build_schedule_from_global


def _schedule(world, t_max, k, e_l, cap, rank, routing):
    num_experts = world * e_l
    if routing == "one_expert":
        topk = torch.full((world, t_max, k), -1, dtype=torch.int64)
        topk[..., 0] = rank * e_l  # every token's first slot on this rank's first expert
    else:
        topk = torch.rand(world, t_max, num_experts).topk(k, -1).indices
        topk[torch.rand(world, t_max, k) < 0.1] = -1
    sched = build_schedule_from_global(
        topk, rank=rank, num_tokens=t_max, num_experts=num_experts, num_local_experts=e_l,
        row_capacity=cap, token_capacity=min(cap, world * t_max),
    )  # fmt: skip
    weights = torch.rand(world, t_max, k)
    return sched, weights


@pytest.mark.parametrize("routing", ["uniform", "one_expert"])
@pytest.mark.parametrize("macrobatch", [128, 384, 1024, 1 << 20])
def test_round_windows_cover_every_padded_row_once(routing, macrobatch):
    torch.manual_seed(macrobatch)
    world, t_max, k, e_l, cap = 2, 150, 4, 6, 640
    sched, weights = _schedule(world, t_max, k, e_l, cap, rank=1, routing=routing)
    plan = padded_plan(sched)
    rounds = make_rounds(macrobatch, sched, plan, weights)
    padded = plan.row_tok.shape[0]
    assert rounds.count == max(1, math.ceil(cap / macrobatch))
    assert rounds.rows % GROUP_ALIGN == 0 or rounds.count == 1
    assert rounds.count * rounds.rows >= padded
    assert (rounds.count - 1) * rounds.rows < padded  # no window is wholly past the rows
    # The windows' row tokens are the padded layout's, then -1.
    assert torch.equal(rounds.row_tok[:padded], plan.row_tok)
    assert (rounds.row_tok[padded:] == -1).all()
    assert (rounds.w_rows[padded:] == 0).all()
    # Each window's group ends give each expert the part of its padded group inside the window.
    ends = plan.offs.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    assert rounds.first_round.dtype == torch.int32
    # Weight gradients: each expert's first round holds its first row; -1 when it has none.
    for e in range(e_l):
        first = int(rounds.first_round[e])
        if int(plan.expert_rows[e]) == 0:
            assert first == -1
        else:
            assert first * rounds.rows <= int(starts[e]) < (first + 1) * rounds.rows
    covered = torch.zeros(e_l, dtype=torch.int64)
    for r in range(rounds.count):
        window = rounds.window(r)
        offs = window_offs(plan, window)
        assert offs.dtype == torch.int32
        assert (torch.diff(offs) >= 0).all() and int(offs[-1]) <= rounds.rows
        sizes = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1).to(torch.int64))
        lo = torch.clamp(starts, window.start, window.stop)
        hi = torch.clamp(ends, window.start, window.stop)
        assert torch.equal(sizes, hi - lo), f"round {r}"
        # every group in a window starts 16-byte aligned (torch._grouped_mm's rule)
        assert ((offs.to(torch.int64) - sizes) % GROUP_ALIGN == 0).all()
        covered += sizes
    assert torch.equal(covered, ends - starts)


@pytest.mark.parametrize("routing", ["uniform", "one_expert"])
@pytest.mark.parametrize("macrobatch,tokens", [(128, 150), (384, 150), (128, 20), (1 << 20, 150)])
def test_rounds_last_first_name_each_experts_first_visit_and_the_held_round(
    routing, macrobatch, tokens
):
    """The backward megakernel takes the rounds last first (functional/cuda/mega.py,
    _backward_rounds): visit i is round count - 1 - i, each expert's ``first_round`` is the visit
    that holds its first rows in that order (its last round), -1 without rows, and ``held`` is
    the last round with any rows (the one the forward's rings end holding), -1 without rows.
    With few tokens the last rounds are empty."""
    torch.manual_seed(macrobatch + tokens)
    world, t_max, k, e_l, cap = 2, tokens, 4, 6, 640
    sched, weights = _schedule(world, t_max, k, e_l, cap, rank=0, routing=routing)
    plan = padded_plan(sched)
    rounds = make_rounds(macrobatch, sched, plan, weights)
    visits, held = rounds.last_first(plan)
    assert visits.count == rounds.count and visits.rows == rounds.rows
    assert visits.row_tok is rounds.row_tok and visits.first_round.dtype == torch.int32
    with_rows = [r for r in range(rounds.count)
                 if int(window_offs(plan, rounds.window(r))[-1]) > 0]  # fmt: skip
    assert int(held) == (max(with_rows) if with_rows else -1)
    for e in range(e_l):
        seen = [i for i, r in enumerate(reversed(range(rounds.count)))
                if int(torch.diff(window_offs(plan, rounds.window(r)),
                                  prepend=torch.zeros(1, dtype=torch.int32))[e]) > 0]  # fmt: skip
        assert int(visits.first_round[e]) == (seen[0] if seen else -1), f"expert {e}"


class _EngineExperts:
    """Experts' weight-gradient side with the engine's accumulating GEMM, written in torch (its
    rule: each group's a_g^T @ b_g added in fp32, rounded once to acc's type; a group without
    rows untouched), recording which op each call took."""

    accumulate_on_engine = True

    def __init__(self):
        self.calls = []

    def mm_tn(self, a, b, offs):
        raise AssertionError("rounds on the engine must not make a weight-sized part per round")

    def mm_tn_accumulate(self, a, b, offs, acc):
        self.calls.append(acc)
        start = 0
        for g, end in enumerate(offs.tolist()):
            if end > start:
                acc[g] = (acc[g].float() + a[start:end].float().T @ b[start:end].float()).to(
                    acc.dtype
                )
            start = end


def test_weight_grad_in_rounds_adds_into_one_zeroed_total_on_the_engine():
    """In rounds, .grad mode on the engine: stage1._weight_grad makes one zeroed bf16 total on
    the first call and each round's GEMM adds into it in place (no part per round: the rounds'
    peak memory); an expert with rows in no round stays exact zeros."""
    from types import SimpleNamespace

    from mok_megatron.functional.cuda.stage1 import _weight_grad

    torch.manual_seed(0)
    experts, rounds = _EngineExperts(), SimpleNamespace(count=3)
    p, q = 8, 16
    # three rounds' group ends over 3 experts: expert 1 has rows in no round, expert 2 only later
    ends = [torch.tensor(e, dtype=torch.int32) for e in ([4, 4, 4], [2, 2, 6], [0, 0, 3])]
    total, want = None, torch.zeros(3, p, q)
    for r, offs in enumerate(ends):
        rows = int(offs[-1])
        a, b = torch.randn(rows, p).bfloat16(), torch.randn(rows, q).bfloat16()
        out = _weight_grad(experts, a, b, offs, rounds, None, 0, total, r)
        assert out.dtype == torch.bfloat16 and out.shape == (3, p, q)
        assert total is None or out is total, "every round adds into the first round's total"
        total = out
        start = 0
        for g, end in enumerate(offs.tolist()):
            if end > start:
                want[g] = (want[g] + a[start:end].float().T @ b[start:end].float()).bfloat16()
            start = end
    assert len(experts.calls) == 3 and all(c is total for c in experts.calls)
    assert torch.equal(total.float(), want)
    assert torch.count_nonzero(total[1]) == 0
