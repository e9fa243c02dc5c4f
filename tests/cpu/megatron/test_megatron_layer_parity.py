"""MoKMoELayer against Megatron's MoELayer with the alltoall dispatcher (gloo, spawned ranks).

Same weights (moved through a distributed checkpoint), same tokens (a different count per rank):
the output and every gradient (input, router, each expert's gate/up/down, shared expert) match
to a relative error < 1e-5 in float32, at EP 1 and 2, with and without a shared expert, top-k 1,
2 and 4; for the fused experts (MoKExperts) and for MoKTokenDispatcher feeding SequentialMLP.
"""

from __future__ import annotations

import itertools
import os
import tempfile

import pytest
import torch

from mok_megatron.testing import run_ranks

TOL = 1e-5
TOPKS = (1, 2, 4)
SHARED = (None, 40)
MOK_KINDS = ("mok_fused", "mok_unfused")


def _tokens(rank: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x and d_out: [S, B, H] with S = 6 - rank (ranks hold different token counts)."""
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    shape = (6 - rank, 3, hidden)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _parity_rank(rank: int, world_size: int, ckpt_root: str) -> dict:
    """Every (kind, top-k, shared) case on this rank: {case name: {grad name: rel err}}."""
    from mok_megatron.megatron import parity

    parity.init_megatron_parallel(world_size)
    report = {}
    for i, (kind, topk, shared) in enumerate(itertools.product(MOK_KINDS, TOPKS, SHARED)):
        case = parity.LayerCase(topk=topk, shared_ffn=shared)
        ref = parity.build_moe_layer(case, "alltoall", world_size)
        mok = parity.build_moe_layer(case, kind, world_size)
        assert mok.fuse_shared_experts == (kind == "mok_fused" and shared is not None)
        parity.share_weights(ref, mok, os.path.join(ckpt_root, str(i)))
        parity.assert_same_weights(mok, ref)
        x, d_out = _tokens(rank, case.hidden, seed=i)
        expected = parity.layer_step(ref, x, d_out)
        report[f"{kind} topk={topk} shared={shared}"] = parity.relative_errors(
            parity.layer_step(mok, x, d_out), expected
        )
    return report


@pytest.mark.parametrize("world_size", [1, 2])
def test_mok_layer_matches_alltoall(world_size):
    with tempfile.TemporaryDirectory() as ckpt_root:
        reports = run_ranks(_parity_rank, world_size, ckpt_root)
    bad = [
        f"rank {rank} {case}: {name} rel err {err:.2e}"
        for rank, report in enumerate(reports)
        for case, errors in report.items()
        for name, err in errors.items()
        if not err < TOL
    ]
    assert not bad, "\n".join(bad)
    assert len(reports[0]) == len(MOK_KINDS) * len(TOPKS) * len(SHARED)
