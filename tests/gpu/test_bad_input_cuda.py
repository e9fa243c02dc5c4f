"""The bad-input table (``mok_megatron.testing.bad_input``) on the CUDA backend, bf16: every kind
the reference backend rejects (tests/cpu/test_bad_input.py), and the CUDA backend's own, raises
the same exception with the same message, and nothing is written.

Where: EP 1 on stage 1 (both routed-weight forms) and on the megakernel (the fused form, sm_90a);
virtual ranks W = 2 on one GPU for the schedule and forward kinds (every rank makes the bad call;
each must raise); at EP 2 under torchrun (-m multigpu) a config that differs across the ranks.

Nothing written: before each bad call every tensor the workspace owns (``ws.buffers``: the
symmetric buffer with all its regions and guards, the peer and signal tables, the pinned error
record; the error monitor's device and host words), the good schedule and context, the inputs
and the pre-made outputs (wgrad accumulators, poisoned) are cloned; after the call raised and the
device synchronised each is compared bitwise, the monitor holds no error, and a good pass then
gives the baseline's outputs bitwise (so the bad call left no state behind either).

Deferred kinds (an expert id outside [-1, E)) are found on the device, without a sync: the
schedule call returns and its kernels run (the routing gather writes the workspace's routing
regions and the barrier counters, the schedule kernels write the schedule's own tensors and the
error word, skipping the bad slot); no token is dispatched and no forward runs. Then
``ws.check_errors()`` raises naming the rule, as does the next ``build_schedule`` (its poll)
after a sync; no guard of the workspace is damaged, and a good pass gives the baseline bitwise.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.distributed as dist
from test_cuda_backend import dist_group  # noqa: F401 (the fixture of the EP 2 test)

from mok_megatron import functional as F
from mok_megatron.functional.cuda.mega import unavailable_here
from mok_megatron.testing import bad_input, random_moe_problem
from mok_megatron.testing.virtual import rank_streams, run_ranks

pytestmark = pytest.mark.gpu

H, I, E, K, T, I_S = 128, 64, 8, 2, 40, 64
WAIT_TIMEOUT_MS = 10_000  # virtual ranks wait for each other: a protocol bug times out quickly

CONFIGS = {
    "stage1": F.MoKConfig(cuda_forward="stage1", wait_timeout_ms=WAIT_TIMEOUT_MS),
    "megakernel": F.MoKConfig(cuda_forward="megakernel", fwd_num_comm_sms=8,
                              wait_timeout_ms=WAIT_TIMEOUT_MS),
}  # fmt: skip
VIRTUAL_CONFIGS = {  # as test_cuda_backend's and test_megakernel's virtual ranks
    "stage1": F.MoKConfig(cuda_forward="stage1", schedule_capacity_multiplier=2.0,
                          wait_timeout_ms=WAIT_TIMEOUT_MS),
    "megakernel": F.MoKConfig(cuda_forward="megakernel", fwd_num_comm_sms=4, minibatch_size=128,
                              schedule_capacity_multiplier=2.0, wait_timeout_ms=WAIT_TIMEOUT_MS),
}  # fmt: skip
#: (forward path, routed-weight form): the megakernel takes the fused form only.
VARIANTS = (("stage1", "split"), ("stage1", "fused"), ("megakernel", "fused"))


def _params(calls=bad_input.CALLS) -> list:
    params = []
    for path, form in VARIANTS:
        missing = unavailable_here() if path == "megakernel" else None
        marks = [pytest.mark.skip(reason=missing)] if missing else []
        for kind, _ in bad_input.cases(path, (form,), calls):
            params.append(pytest.param(kind, path, form, marks=marks,
                                       id=f"{path}-{form}-{kind.name}"))  # fmt: skip
    return params


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _problem(tokens: list[int]):
    return random_moe_problem(tokens, H, I, E, K, shared_inter=I_S, seed=3)


SHAPE = dict(num_local_tokens=T, hidden_size=H, topk=K, num_experts=E, intermediate_size=I,
             shared_intermediate_size=I_S, dtype=torch.bfloat16)  # fmt: skip


def _good(config, ws, problem, rank, form) -> bad_input.GoodCall:
    return bad_input.good_call(config, ws, problem, rank, form, torch.bfloat16, _device(),
                               other_device="cpu", backend="cuda")  # fmt: skip


def _good_pass(g: bad_input.GoodCall) -> dict:
    """A good schedule, forward and backward: out and every gradient."""
    sched = F.build_schedule(g.ws, g.config, g.topk, router_weights=g.rw)
    out, ctx = F.forward(g.config, g.ws, sched, g.x, g.rw, *g.shared, *g.routed)
    grads = F.backward(g.config, g.ws, sched, ctx, g.d_out, g.x, g.rw, *g.shared, *g.routed)
    torch.cuda.synchronize()
    return {"out": out, **grads._asdict()}


def _matches(kind, good, exc) -> bool:
    return isinstance(exc, kind.error) and re.search(kind.pattern(good), str(exc)) is not None


# ====================================================================================== EP 1
def _ep1(path: str, form: str) -> bad_input.GoodCall:
    config = CONFIGS[path]
    ws = F.create_workspace(config, None, device=_device(), backend="cuda", **SHAPE)
    assert ws.backend.path(ws) == path
    return _good(config, ws, _problem([T]), 0, form)


@pytest.mark.parametrize("kind,path,form", _params())
def test_bad_input_raises_naming_the_rule_and_writes_nothing(kind, path, form):
    good = _ep1(path, form)
    baseline = _good_pass(good)
    for step in bad_input.PREPARE[kind.call]:
        bad_input.prepare(good, step)
    if kind.deferred:
        _check_deferred(kind, good, baseline)
        return
    bad = kind.spoil(good)
    torch.cuda.synchronize()
    snap = bad_input.snapshot_calls(good, bad)
    with pytest.raises(kind.error, match=kind.pattern(good)):
        bad_input.make_call(kind.call, bad)
    torch.cuda.synchronize()
    assert bad_input.changed(snap) == []
    good.ws.check_errors()  # nothing recorded on the device either
    assert good.ws.buffers.damaged_guards() == []
    assert bad_input.differing(baseline, _good_pass(good)) == []


def _check_deferred(kind, good: bad_input.GoodCall, baseline: dict) -> None:
    """The bad schedule returns; check_errors, and the next schedule's poll, raise."""
    bad = kind.spoil(good)
    bad_input.make_call("schedule", bad).ensure_built()  # the megakernel's is built lazily
    torch.cuda.synchronize()
    with pytest.raises(kind.error, match=kind.pattern(good)):
        good.ws.check_errors()
    assert good.ws.buffers.damaged_guards() == []
    bad_input.make_call("schedule", bad).ensure_built()
    torch.cuda.synchronize()
    with pytest.raises(kind.error, match=kind.pattern(good)):
        bad_input.make_call("schedule", good)  # polls before it plans
    assert bad_input.differing(baseline, _good_pass(good)) == []
    good.ws.check_errors()


def test_every_kind_of_the_table_runs_on_a_cuda_path():
    """Every kind the reference backend rejects, and every kind of each CUDA path in the weight
    forms that path takes, is among the cases this module runs (skipped cases do not count)."""
    ran = {path: {p.values[0].name for p in _params() if p.values[1] == path and not p.marks}
           for path in ("stage1", "megakernel")}  # fmt: skip
    reference = {k.name for k in bad_input.kinds("reference")}
    on_cuda = ran["stage1"] | ran["megakernel"]
    assert reference <= on_cuda, (
        f"reference kinds not run on the CUDA backend: {reference - on_cuda}"
    )
    for path, names in ran.items():
        forms = tuple(f for p, f in VARIANTS if p == path)  # the megakernel takes fused weights
        wanted = {k.name for k, _ in bad_input.cases(path, forms)}
        assert wanted <= names, f"{path} kinds not run: {wanted - names}"


# ============================================================================ virtual ranks
def _virtual(path: str, form: str):
    """W = 2 virtual ranks of one problem: each rank's GoodCall, and the ranks' streams."""
    config = VIRTUAL_CONFIGS[path]
    if path == "stage1" and form == "fused":  # the engine, as test_cuda_backend's virtual ranks
        config = dataclasses.replace(config, expert_gemm="engine")
    workspaces = F.create_virtual_workspaces(config, 2, device=_device(), **SHAPE)
    assert all(ws.backend.path(ws) == path for ws in workspaces)
    problem = _problem([T, T])
    goods = [_good(config, ws, problem, r, form) for r, ws in enumerate(workspaces)]
    return goods, rank_streams(2)


def _virtual_forward(goods, streams) -> list[dict]:
    """A good schedule and forward on every rank: each rank's out."""
    scheds = run_ranks(lambda r: bad_input.make_call("schedule", goods[r]), streams)
    outs = run_ranks(lambda r: F.forward(goods[r].config, goods[r].ws, scheds[r], goods[r].x,
                                         goods[r].rw, *goods[r].shared, *goods[r].routed)[0],
                     streams)  # fmt: skip
    torch.cuda.synchronize()
    return [{"out": out} for out in outs]


def _attempt(call: str, g: bad_input.GoodCall):
    """The exception ``call`` raised, or None: every rank's call is made even when one does not
    raise (a rank left out would leave the others waiting at a barrier until it times out)."""
    try:
        bad_input.make_call(call, g)
    except Exception as exc:  # noqa: BLE001 (checked by the caller)
        return exc
    return None


@pytest.mark.parametrize("kind,path,form", _params(("schedule", "forward")))
def test_virtual_ranks_bad_input_raises_on_every_rank_and_writes_nothing(kind, path, form):
    goods, streams = _virtual(path, form)
    baseline = _virtual_forward(goods, streams)
    if kind.call == "forward":
        scheds = run_ranks(lambda r: bad_input.make_call("schedule", goods[r]), streams)
        for g, sched in zip(goods, scheds):
            g.sched = sched
    if kind.deferred:
        _check_virtual_deferred(kind, goods, streams, baseline)
        return
    bads = run_ranks(lambda r: kind.spoil(goods[r]), streams)  # a spoil may run a rank's plan
    torch.cuda.synchronize()
    snap = bad_input.snapshot_calls(*goods, *bads)
    errors = run_ranks(lambda r: _attempt(kind.call, bads[r]), streams)
    torch.cuda.synchronize()
    for r, exc in enumerate(errors):
        assert _matches(kind, goods[r], exc), f"rank {r}: {exc!r} (want {kind.pattern(goods[r])})"
    assert bad_input.changed(snap) == []
    for g in goods:
        g.ws.check_errors()
        assert g.ws.buffers.damaged_guards() == []
    for r, (want, got) in enumerate(zip(baseline, _virtual_forward(goods, streams))):
        assert bad_input.differing(want, got) == [], f"rank {r}"


def _check_virtual_deferred(kind, goods, streams, baseline) -> None:
    """A bad id on rank 0 only: the schedule is global, so every rank's check raises."""
    calls = [kind.spoil(goods[0]), *goods[1:]]
    run_ranks(lambda r: bad_input.make_call("schedule", calls[r]).ensure_built(), streams)
    torch.cuda.synchronize()
    for r, g in enumerate(goods):
        with pytest.raises(kind.error, match=kind.pattern(g)):
            g.ws.check_errors()
        assert g.ws.buffers.damaged_guards() == [], f"rank {r}"
    for r, (want, got) in enumerate(zip(baseline, _virtual_forward(goods, streams))):
        assert bad_input.differing(want, got) == [], f"rank {r}"


# ============================================================================ EP 2 (torchrun)
@pytest.mark.multigpu
def test_ep2_config_differs_across_ranks_is_rejected(dist_group):  # noqa: F811
    """Every rank raises when making the workspace (before any symmetric memory is allocated),
    and the group still makes a workspace of equal configs afterwards."""
    shape = dict(SHAPE, device=_device(), backend="cuda")
    config = F.MoKConfig(wait_timeout_ms=60_000 + dist.get_rank())
    with pytest.raises(ValueError, match="MoKConfig differs across the ranks of the expert"):
        F.create_workspace(config, dist_group, **shape)
    ws = F.create_workspace(F.MoKConfig(wait_timeout_ms=60_000), dist_group, **shape)
    assert ws.num_ranks == 2 and ws.buffers is not None
