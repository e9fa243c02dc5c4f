"""Bad input gets a clear error that names the rule, and the rejected call writes nothing
(reference backend, one rank): every kind of ``mok_megatron.testing.bad_input``'s table, in both
routed-weight forms; tests/gpu/test_bad_input_cuda.py runs the same table on the CUDA backend.

A config that differs across the ranks of a group needs ranks: test_functional_ep.py's
test_configs_that_differ_across_ranks_are_rejected (gloo, EP 2).
"""

from __future__ import annotations

import re

import pytest
import torch

from mok_megatron import functional as F
from mok_megatron.testing import bad_input, random_moe_problem
from mok_megatron.testing.runs import problem_workspace

H, I, E, K, T, I_S = 16, 24, 4, 2, 20, 8
CASES = bad_input.cases("reference")


def _good(form: str) -> bad_input.GoodCall:
    problem = random_moe_problem([T], H, I, E, K, shared_inter=I_S, dtype=torch.float32, seed=1)
    config = F.MoKConfig()
    ws = problem_workspace(problem, dtype=torch.float32, config=config)
    return bad_input.good_call(config, ws, problem, 0, form, torch.float32, "cpu",
                               other_device="meta", backend="reference")  # fmt: skip


@pytest.mark.parametrize("kind,form", CASES, ids=[f"{k.name}-{f}" for k, f in CASES])
def test_bad_input_raises_naming_the_rule_and_writes_nothing(kind, form):
    good = _good(form)
    for step in bad_input.PREPARE[kind.call]:
        bad_input.prepare(good, step)
    bad = kind.spoil(good)
    snap = bad_input.snapshot_calls(good, bad)
    with pytest.raises(kind.error, match=kind.pattern(good)):
        bad_input.make_call(kind.call, bad)
    assert bad_input.changed(snap) == []


def test_every_kind_of_the_table_runs_here():
    """Each reference kind is in CASES (the count a report prints comes from the same table)."""
    assert {k.name for k, _ in CASES} == {k.name for k in bad_input.kinds("reference")}
    count = len(bad_input.kinds("reference")) + len(bad_input.ELSEWHERE)
    assert bad_input.kinds_line("reference").startswith(f"{count} kinds tried")


#: Issue 17's kinds of bad input (item 3), and the kind names of the table that show each.
CATEGORIES = {
    "dtype": r"_int32$|^x_int$|float16|float64|bfloat16|other_float|float32_activations",
    "shape": r"_1d$|_2d$|_3d$|_shape$|transposed|wrong_number|tokens_differ|hidden_size_differs",
    "device": r"other_device",
    "expert id out of range": r"^expert_id_(out_of_range|below_minus_one)$",
    "K > E": r"^topk_larger_than_num_experts$",
    "router-weight shape": r"^(schedule_)?router_weights_shape$",
    "non-contiguous": r"non_contiguous",
    "misaligned": r"misaligned",
    "a workspace used with another shape": r"more_tokens_than_workspace|differs_from_workspace|"
    r"of_another_intermediate_size|for_another_number_of_experts",
}


@pytest.mark.parametrize("path", bad_input.PATHS)
def test_every_category_of_bad_input_has_kinds_on_every_path(path):
    """Each kind of bad input the issue names is in the table for every backend path (configs
    that differ across ranks need real ranks: ELSEWHERE names their tests)."""
    names = [k.name for k in bad_input.kinds(path)]
    missing = [c for c, rx in CATEGORIES.items() if not any(re.search(rx, n) for n in names)]
    assert not missing, f"{path}: no kind of the table shows {missing}"
    assert "config_differs_across_ranks" in bad_input.ELSEWHERE


def _empty_at_an_odd_offset(cols: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(1, dtype=dtype)[1:].view(0, cols)  # one element into its storage


def test_empty_tensors_at_any_offset_stay_valid():
    """0 tokens: the alignment rule is for tensors something reads; an empty one passes, views
    at an odd offset included (torch reports data_ptr() == 0 for them)."""
    good = _good("split")
    x = _empty_at_an_odd_offset(H, torch.float32)
    topk = _empty_at_an_odd_offset(K, torch.int64)
    rw = _empty_at_an_odd_offset(K, torch.float32)
    assert x.storage_offset() == topk.storage_offset() == 1
    weights = (*good.shared, *good.routed)
    sched = F.build_schedule(good.ws, good.config, topk, router_weights=rw)
    out, ctx = F.forward(good.config, good.ws, sched, x, rw, *weights)
    grads = F.backward(good.config, good.ws, sched, ctx, x.clone(), x, rw, *weights)
    assert out.shape == (0, H) and grads.d_x.shape == (0, H) and grads.d_router_weights.numel() == 0


def test_moe_takes_an_upstream_gradient_at_an_odd_address():
    """The alignment rule is the caller's for what it passes; the gradient autograd hands
    ``moe``'s backward (here a view 4 bytes into cat's gradient) is the layer's to align."""
    problem = random_moe_problem([T], H, I, E, K, dtype=torch.float32, seed=2)
    x, topk, rw, routed, _ = problem.local(0)
    weights = torch.arange(1.0, x.numel() + 1).view(x.shape)
    grads, seen = [], []
    for misaligned in (True, False):
        xg = x.clone().requires_grad_()
        out = F.moe(xg, topk, rw, *routed, config=F.MoKConfig())
        out.register_hook(lambda g: seen.append(g.data_ptr() % 16))
        if misaligned:  # d_out = the [1:] view of the flat cat's gradient
            flat = torch.cat([torch.zeros(1), out.flatten()])
            (flat[1:] * weights.flatten()).sum().backward()
        else:
            out.backward(weights)
        grads.append(xg.grad)
    assert seen[0] != 0 and seen[1] == 0
    assert torch.equal(grads[0], grads[1])


def test_forced_cuda_backend_without_the_extension_fails_clearly():
    with pytest.raises(RuntimeError, match="backend='cuda' was asked for but cannot run"):
        F.create_workspace(
            F.MoKConfig(),
            None,
            device="cpu",
            num_local_tokens=4,
            hidden_size=H,
            topk=K,
            num_experts=E,
            intermediate_size=I,
            backend="cuda",
        )


@pytest.mark.parametrize("loading", [None, "LAZY"])
def test_virtual_ranks_without_eager_module_loading_fail_clearly(monkeypatch, loading):
    """Virtual ranks under lazy kernel loading would time out in their first pass; the workspace
    refuses them up front, naming the rule and the fix."""
    if loading is None:
        monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    else:
        monkeypatch.setenv("CUDA_MODULE_LOADING", loading)
    with pytest.raises(RuntimeError, match="export CUDA_MODULE_LOADING=EAGER"):
        F.create_virtual_workspaces(F.MoKConfig(), 2, device="cuda:0", num_local_tokens=8,
                                    hidden_size=64, topk=2, num_experts=4,
                                    intermediate_size=32)  # fmt: skip
