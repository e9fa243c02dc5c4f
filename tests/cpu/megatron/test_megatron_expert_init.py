"""Same seed, same starting model: MoKExperts' initial weights are Megatron's experts', bitwise.

An MoE layer built with the alltoall dispatcher and SequentialMLP and one built with MoK
(MoKExperts) from the same seed hold the same weights (every expert's gate / up / down after
de-interleaving, and the router and shared expert), at EP 1 and 2 (each rank's experts those of
that rank's SequentialMLP), for several expert counts and sizes, float32 and bf16, with
``use_cpu_initialization`` and without it (Megatron's device path: the expert-parallel RNG
state), and give the same forward output. TEGroupedMLP's order (TE is not installed here) is
checked against TE GroupedLinear's init as written in its ``reset_parameters``; the MoK layer
specs pick it exactly where the stock spec builds TEGroupedMLP.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from mok_megatron.testing import run_ranks

SEED = 1234
SIZES = ((8, 32, 48), (4, 16, 16), (6, 24, 32))  # (num_experts, hidden, ffn)
DTYPES = (torch.float32, torch.bfloat16)
CPU_INIT = (True, False)
FORWARD_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _build(case, kind: str, world_size: int, cpu_init: bool):
    """A layer of ``kind`` built right after Megatron's seeding (as training does)."""
    from mok_megatron.megatron import parity

    parity.init_megatron_parallel(world_size, seed=SEED)
    return parity.build_moe_layer(case, kind, world_size, use_cpu_initialization=cpu_init)


def _init_rank(rank: int, world_size: int) -> dict:
    """Per case: which weights differ (none expected), this rank's expert weights, and the
    forward output's relative error."""
    from mok_megatron.megatron import parity

    report = {}
    for (num_experts, hidden, ffn), dtype, cpu_init in itertools.product(SIZES, DTYPES, CPU_INIT):
        case = parity.LayerCase(
            num_experts=num_experts, hidden=hidden, ffn=ffn, dtype=dtype, shared_ffn=16
        )
        stock = _build(case, "alltoall", world_size, cpu_init)
        mok = _build(case, "mok_fused", world_size, cpu_init)
        expected, actual = parity.canonical_weights(stock), parity.canonical_weights(mok)
        name = f"E={num_experts} H={hidden} I={ffn} {dtype} cpu_init={cpu_init}"
        differ = sorted(k for k in expected if not torch.equal(actual.get(k), expected[k]))
        gen = torch.Generator().manual_seed(7 + rank)
        x = torch.randn(5 - rank, 2, hidden, generator=gen).to(dtype)
        with torch.no_grad():
            out_mok, out_ref = (layer(x)[0].double() for layer in (mok, stock))
        error = float((out_mok - out_ref).norm() / out_ref.norm())
        experts = {k: v for k, v in expected.items() if k.startswith("expert")}
        report[name] = {"differ": differ, "experts": experts, "forward": (dtype, error)}
    return report


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"ep{w}")
def reports(request):
    return run_ranks(_init_rank, request.param)


def test_same_seed_gives_megatrons_weights(reports):
    bad = [
        f"rank {rank} {case}: {r['differ']}"
        for rank, report in enumerate(reports)
        for case, r in report.items()
        if r["differ"]
    ]
    assert not bad, "\n".join(bad)


def test_same_seed_gives_the_same_forward(reports):
    bad = [
        f"rank {rank} {case}: rel err {err:.2e}"
        for rank, report in enumerate(reports)
        for case, r in report.items()
        for dtype, err in [r["forward"]]
        if not err < FORWARD_TOL[dtype]
    ]
    assert not bad, "\n".join(bad)


def test_expert_ranks_draw_their_own_experts(reports):
    """Megatron's device path draws each EP rank's experts from its own RNG state (so matching
    per rank is not trivial); its CPU path draws the same values on every rank."""
    if len(reports) == 1:
        pytest.skip("one EP rank")
    for case, r0 in reports[0].items():
        r1 = reports[1][case]["experts"]
        same = all(torch.equal(r0["experts"][k], r1[k]) for k in r1)
        assert same == ("cpu_init=True" in case), case


def _te_order_rank(rank: int, world_size: int) -> dict:
    """MoKExperts(init_order='te_grouped_mlp') and TE GroupedLinear's init order: every
    weight{e} of fc1 then of fc2, each in params_dtype on its device under the expert RNG."""
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        get_expert_parallel_rng_tracker_name,
    )
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from mok_megatron.megatron import parity
    from mok_megatron.megatron.experts import TE_GROUPED_MLP, MoKExperts

    del rank
    result = {}
    for (num_experts, hidden, ffn), dtype, cpu_init in itertools.product(SIZES, DTYPES, CPU_INIT):
        case = parity.LayerCase(num_experts=num_experts, hidden=hidden, ffn=ffn, dtype=dtype)
        config = parity.tiny_moe_config(case, "mok", world_size)
        config.use_cpu_initialization = cpu_init
        num_local = num_experts // world_size
        parity.init_megatron_parallel(world_size, seed=SEED)
        experts = MoKExperts(
            num_local, config, pg_collection=get_default_pg_collection(), init_order=TE_GROUPED_MLP
        )
        parity.init_megatron_parallel(world_size, seed=SEED)
        fc1, fc2 = (
            torch.empty(num_local, 2 * ffn, hidden, dtype=dtype),
            torch.empty(num_local, hidden, ffn, dtype=dtype),
        )
        for weights, init in ((fc1, config.init_method), (fc2, config.output_layer_init_method)):
            for e in range(num_local):
                with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                    init(weights[e])
        weights = parity._mok_expert_tensors(experts.weight_gate_up, experts.weight_down)
        ok = all(
            torch.equal(weights[f"expert{e}.gate"], fc1[e, :ffn])
            and torch.equal(weights[f"expert{e}.up"], fc1[e, ffn:])
            and torch.equal(weights[f"expert{e}.down"], fc2[e])
            for e in range(num_local)
        )
        result[f"E={num_experts} {dtype} cpu_init={cpu_init}"] = ok
    return result


def test_te_grouped_mlp_order():
    results = run_ranks(_te_order_rank, 2)
    bad = [
        f"rank {r} {case}" for r, res in enumerate(results) for case, ok in res.items() if not ok
    ]
    assert not bad, bad


def test_specs_pick_the_init_order_of_the_experts_they_replace():
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules

    from mok_megatron.megatron.experts import TE_GROUPED_MLP, MoKExperts
    from mok_megatron.megatron.layer_specs import mokify_spec

    def experts_of(stock_experts):
        stock = functools.partial(MoELayer, submodules=MoESubmodules(experts=stock_experts))
        return mokify_spec(stock).keywords["submodules"].experts

    assert experts_of(functools.partial(SequentialMLP, submodules=None)) is MoKExperts
    te = experts_of(functools.partial(TEGroupedMLP, submodules=None))
    assert te.func is MoKExperts and te.keywords == {"init_order": TE_GROUPED_MLP}


def test_init_order_must_be_known():
    from types import SimpleNamespace

    from mok_megatron.megatron import parity
    from mok_megatron.megatron.experts import MoKExperts

    config = parity.tiny_moe_config(parity.LayerCase(), "mok", ep_size=1)
    with pytest.raises(ValueError, match="init_order='grouped' must be one of"):
        MoKExperts(2, config, pg_collection=SimpleNamespace(ep=None, expt_dp=None),
                   init_order="grouped")  # fmt: skip
