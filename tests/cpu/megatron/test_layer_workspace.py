"""``FusedRuntime``'s kept workspace (the fused layer's host path): never stale, each change of
what it stands for asks ``get_workspace`` again, and what it keeps is what ``get_workspace``
gives. The functional side's host path: tests/cpu/test_host_path.py."""

from __future__ import annotations

import types

import pytest
import torch

from mok_megatron import functional
from mok_megatron.functional import MoKConfig
from mok_megatron.megatron.moe_layer import FusedRuntime


def _layer_inputs(hidden=32, inter=16, experts=4, topk=2, tokens=8, dtype=torch.float32,
                  device="cpu", fused=True):  # fmt: skip
    """(x, topk_experts, routed) as MoKExperts passes them (fused: (gate_up, None, down))."""
    like = {"dtype": dtype, "device": device}
    x = torch.zeros(tokens, hidden, **like)
    topk_experts = torch.zeros(tokens, topk, dtype=torch.int64, device=device)
    down = torch.zeros(experts, hidden, inter, **like)
    if fused:
        return x, topk_experts, (torch.zeros(experts, 2 * inter, hidden, **like), None, down)
    gate, up = (torch.zeros(experts, inter, hidden, **like) for _ in range(2))
    return x, topk_experts, (gate, up, down)


WANT = dict(device=torch.device("cpu"), num_local_tokens=8, hidden_size=32, topk=2,
            num_experts=4, intermediate_size=16, shared_intermediate_size=0,
            dtype=torch.float32, backend="reference")  # fmt: skip


@pytest.fixture
def asked(monkeypatch):
    """functional.get_workspace replaced by a recorder of its calls that gives a new object each
    time: the calls FusedRuntime makes (its kept workspace saves the others)."""
    calls = []

    def get_workspace(config, group=None, **kwargs):
        calls.append((config, group, kwargs))
        return types.SimpleNamespace(given_config=config)

    monkeypatch.setattr(functional, "get_workspace", get_workspace)
    return calls


def _shared_expert(inter_shared, hidden=32):
    shared = torch.nn.Module()
    shared.linear_fc1 = torch.nn.Linear(hidden, 2 * inter_shared, bias=False)
    shared.linear_fc2 = torch.nn.Linear(inter_shared, hidden, bias=False)
    return shared


def test_the_layer_asks_for_its_workspace_once_while_nothing_changes(asked):
    config = MoKConfig()
    runtime = FusedRuntime(config, "reference", None, None, None)
    ws = runtime.workspace(*_layer_inputs())
    for _ in range(3):
        assert runtime.workspace(*_layer_inputs()) is ws
    runtime.mok_config = MoKConfig()  # equal: get_workspace would give the same workspace
    assert runtime.workspace(*_layer_inputs()) is ws
    assert runtime.workspace(*_layer_inputs(fused=False)) is ws  # the same I, the other form
    assert asked == [(config, None, WANT)]


CHANGES = {
    "hidden size": ({"hidden": 64}, {"hidden_size": 64}),
    "topk": ({"topk": 4}, {"topk": 4}),
    "local experts": ({"experts": 8}, {"num_experts": 8}),
    "intermediate size": ({"inter": 32}, {"intermediate_size": 32}),
    "dtype": ({"dtype": torch.bfloat16}, {"dtype": torch.bfloat16}),
    "device": ({"device": "meta"}, {"device": torch.device("meta")}),
    "separate gate and up": ({"fused": False, "inter": 24}, {"intermediate_size": 24}),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_another_shape_asks_again(asked, change):
    inputs, want = CHANGES[change]
    runtime = FusedRuntime(MoKConfig(), "reference", None, None, None)
    first = runtime.workspace(*_layer_inputs())
    second = runtime.workspace(*_layer_inputs(**inputs))
    assert second is not first and runtime.workspace(*_layer_inputs(**inputs)) is second
    assert [kwargs for _, _, kwargs in asked] == [WANT, WANT | want]


RUNTIME_CHANGES = {
    "config": ("mok_config", MoKConfig(minibatch_size=512)),
    "group": ("ep_group", object()),
    "backend": ("backend", "cuda"),
    "max_local_tokens": ("max_local_tokens", 16),
}


@pytest.mark.parametrize("change", list(RUNTIME_CHANGES))
def test_another_config_group_backend_or_token_bound_asks_again(asked, change):
    name, value = RUNTIME_CHANGES[change]
    runtime = FusedRuntime(MoKConfig(), "reference", None, None, None)
    first = runtime.workspace(*_layer_inputs())
    setattr(runtime, name, value)
    second = runtime.workspace(*_layer_inputs())
    assert second is not first and runtime.workspace(*_layer_inputs()) is second
    config, group, kwargs = asked[-1]
    got = {"mok_config": config, "ep_group": group, "backend": kwargs["backend"],
           "max_local_tokens": kwargs["num_local_tokens"]}  # fmt: skip
    assert len(asked) == 2 and got[name] is value


def test_a_cleared_workspace_cache_asks_again(asked):
    runtime = FusedRuntime(MoKConfig(), "reference", None, None, None)
    first = runtime.workspace(*_layer_inputs())
    functional.clear_workspace_cache()
    second = runtime.workspace(*_layer_inputs())
    assert second is not first and runtime.workspace(*_layer_inputs()) is second
    assert len(asked) == 2


def test_the_shared_experts_size_comes_from_its_weights(asked):
    runtime = FusedRuntime(MoKConfig(), "reference", None, None, _shared_expert(12))
    runtime.workspace(*_layer_inputs())
    assert asked[-1][2]["shared_intermediate_size"] == runtime.shared_weights()[0].shape[0] == 12


def test_more_tokens_than_the_workspace_holds_raise_every_time(asked):
    runtime = FusedRuntime(MoKConfig(), "reference", None, None, None)
    runtime.workspace(*_layer_inputs())
    for _ in range(2):
        with pytest.raises(ValueError, match=r"got 9 tokens .* max_local_tokens=8"):
            runtime.workspace(*_layer_inputs(tokens=9))
    assert len(asked) == 1


def test_the_kept_workspace_is_the_one_get_workspace_gives():
    """With the real cache (reference backend): the same workspace, and after a clear the new
    one."""
    runtime = FusedRuntime(MoKConfig(), "reference", None, None, _shared_expert(8))
    want = WANT | {"shared_intermediate_size": 8}
    functional.clear_workspace_cache()
    try:
        ws = runtime.workspace(*_layer_inputs())
        assert ws is functional.get_workspace(MoKConfig(), None, **want)
        assert runtime.workspace(*_layer_inputs()) is ws
        functional.clear_workspace_cache()
        again = runtime.workspace(*_layer_inputs())
        assert again is not ws and again is functional.get_workspace(MoKConfig(), None, **want)
    finally:
        functional.clear_workspace_cache()


def test_layers_with_equal_configs_pass_the_workspaces_own_config(monkeypatch):
    """Layers with equal (not the same) configs share a workspace; each passes the workspace's
    config object, so the API's checks compare no fields, and computes what it did."""
    runtimes = [FusedRuntime(MoKConfig(), "reference", None, None, None) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    x, topk_experts, routed = _layer_inputs()
    x.normal_(generator=gen)
    topk_experts.random_(0, 4, generator=gen)
    routed = tuple(w if w is None else w.normal_(generator=gen) for w in routed)
    router_weights = torch.rand(topk_experts.shape, generator=gen)
    functional.clear_workspace_cache()
    try:
        want = runtimes[0].run(x, topk_experts, router_weights, routed)
        compares = []
        real_eq = MoKConfig.__eq__
        monkeypatch.setattr(MoKConfig, "__eq__", lambda a, b: compares.append(1) or real_eq(a, b))
        runtimes[1].workspace(x, topk_experts, routed)  # compares once, for the new workspace
        compares.clear()
        got = runtimes[1].run(x, topk_experts, router_weights, routed)
        assert compares == [] and runtimes[1].last_workspace is runtimes[0].last_workspace
        assert runtimes[1]._kept.config is runtimes[0].mok_config
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        functional.clear_workspace_cache()
