"""The schedule's integers against a plain-Python construction of the same plan (bitwise)."""

from __future__ import annotations

import pytest
import torch

from mok_megatron.functional.schedule import MOK_ERR_ROW_OVERFLOW, build_schedule_from_global


def _python_plan(global_topk, rank, e_l, cap):
    """Rows sorted by (local expert, s, t, k), with a dict-and-sort, no tensor tricks."""
    w, t_max, k = global_topk.shape
    rows = sorted(
        (int(e) - rank * e_l, s, t, slot)
        for s in range(w) for t in range(t_max) for slot in range(k)
        if rank * e_l <= (e := global_topk[s, t, slot]) < (rank + 1) * e_l
    )  # fmt: skip
    kept = rows[:cap]
    tokens = sorted({(s, t) for _, s, t, _ in kept})
    return rows, kept, tokens


@pytest.mark.parametrize(
    "world,t_max,k,e_l,mult_rows",
    [(1, 37, 3, 8, 128), (2, 50, 2, 3, 128), (4, 40, 4, 2, 128), (2, 100, 2, 1, 128)],
)
def test_schedule_matches_plain_python(world, t_max, k, e_l, mult_rows):
    num_experts = world * e_l
    for rank in range(world):
        scores = torch.rand(world, t_max, num_experts)
        topk = scores.topk(k, -1).indices
        topk[torch.rand(world, t_max, k) < 0.15] = -1
        topk[0, t_max - 3 :] = -1  # padding tokens
        sched = build_schedule_from_global(
            topk, rank=rank, num_tokens=t_max - 3, num_experts=num_experts,
            num_local_experts=e_l, row_capacity=mult_rows, token_capacity=min(mult_rows, world * t_max),
        )  # fmt: skip
        rows, kept, tokens = _python_plan(topk, rank, e_l, mult_rows)
        n = len(kept)
        assert sched.num_rows.tolist() == [len(rows)]
        assert sched.row_expert[:n].tolist() == [r[0] for r in kept]
        assert sched.row_src_rank[:n].tolist() == [r[1] for r in kept]
        assert sched.row_src_token[:n].tolist() == [r[2] for r in kept]
        assert sched.row_src_slot[:n].tolist() == [r[3] for r in kept]
        assert (sched.row_expert[n:] == e_l).all() and (sched.row_src_rank[n:] == -1).all()
        counts = [sum(1 for r in kept if r[0] == e) for e in range(e_l)]
        assert sched.expert_offsets.tolist() == [sum(counts[:e]) for e in range(e_l + 1)]
        src = [s * t_max + t for s, t in tokens]
        assert sched.recv_token_src.tolist()[: len(src)] == src
        assert sched.num_recv_tokens.tolist() == [len(src)]
        assert sched.row_token_idx[:n].tolist() == [tokens.index((r[1], r[2])) for r in kept]
        for j, (s, t) in enumerate(tokens):
            assert sched.recv_token_pos[s * t_max + t] == j
            want = [kept.index((int(topk[s, t, kk]) - rank * e_l, s, t, kk))
                    if (int(topk[s, t, kk]) - rank * e_l, s, t, kk) in kept else -1
                    for kk in range(k)]  # fmt: skip
            assert sched.token_rows[j].tolist() == want
        for t in range(t_max):
            dests = {int(e) // e_l for e in topk[rank, t] if e >= 0}
            assert sched.send_to[t].tolist() == [d in dests for d in range(world)]
        overflow = any(
            int(((topk >= 0) & (topk // e_l == d)).sum()) > mult_rows for d in range(world)
        )
        assert bool(sched.error_flags.item() & MOK_ERR_ROW_OVERFLOW) == overflow
