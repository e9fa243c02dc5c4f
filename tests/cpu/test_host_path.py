"""The forward's host path, made cheaper, means the same: what it keeps between calls is never
stale (each cache misses when what it stands for changes) and its checks' one-test good cases
let by exactly what the rules do, so bad input raises as it did."""

from __future__ import annotations

import dataclasses
import re
import types

import pytest
import torch

from mok_megatron import functional
from mok_megatron.functional import MoKConfig, api
from mok_megatron.functional.cuda import experts as cuda_experts
from mok_megatron.functional.schedule import MoKSchedule
from mok_megatron.megatron.moe_layer import FusedRuntime

SM90_WHY = None
SM80_WHY = "mok_megatron._C is built for sm_90a and this GPU is sm_80"


@pytest.fixture
def capabilities(monkeypatch):
    """A fake torch.cuda.get_device_capability (cuda:0 is sm_90, cuda:1 sm_80, the current
    device sm_90); returns the list of devices it was asked about."""
    asked = []
    by_index = {0: (9, 0), 1: (8, 0), None: (9, 0)}

    def capability(device=None):
        index = device.index if isinstance(device, torch.device) else device
        asked.append(index)
        return by_index[index]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    cuda_experts._capability_of_index.cache_clear()
    yield asked
    cuda_experts._capability_of_index.cache_clear()


def test_device_capability_is_asked_once_per_device_index(capabilities):
    for _ in range(3):
        assert cuda_experts.not_hopper(torch.device("cuda", 0)) is SM90_WHY
        assert cuda_experts.not_hopper(torch.device("cuda", 1)) == SM80_WHY
    assert capabilities == [0, 1]


def test_the_current_device_is_asked_every_time(capabilities):
    """An index-less device is whichever is current, which may change: never cached."""
    for _ in range(2):
        assert cuda_experts.not_hopper(torch.device("cuda")) is SM90_WHY
    assert capabilities == [None, None]


def test_a_device_that_is_not_cuda_asks_nothing(capabilities):
    assert cuda_experts.not_hopper(torch.device("cpu")) == "the device is cpu, not a CUDA GPU"
    assert cuda_experts.not_hopper(None) == "the device is None, not a CUDA GPU"
    assert capabilities == []


def test_a_gpu_that_cannot_run_the_engine_still_raises_every_time(capabilities, monkeypatch):
    """For the GPU's reason (the grouped-GEMM ops stubbed as built: without them that reason
    would come first)."""
    monkeypatch.setattr(cuda_experts.gg, "grouped_gemm_available", lambda: True)
    why = r"expert_gemm='engine' but the expert GEMM engine can't run: " + re.escape(SM80_WHY)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=why):
            cuda_experts.engine_steps("engine", torch.device("cuda", 1))


@pytest.mark.parametrize("accumulate", [False, True, None, 1])
def test_engine_steps_name_the_same_steps(capabilities, monkeypatch, accumulate):
    monkeypatch.setattr(cuda_experts.gg, "grouped_gemm_available", lambda: True)
    sm90 = torch.device("cuda", 0)
    auto = cuda_experts.AUTO_ENGINE_STEPS + (("wgrad",) if accumulate else ())
    assert cuda_experts.engine_steps("auto", sm90, accumulate) == auto
    assert cuda_experts.engine_steps("engine", sm90, accumulate) == cuda_experts.ENGINE_STEPS
    assert cuda_experts.engine_steps("torch", sm90, accumulate) == ()
    assert cuda_experts.engine_steps("l1+l2", sm90, accumulate) == ("l1", "l2")
    with pytest.raises(ValueError, match="choose auto, torch, engine or a comma list"):
        cuda_experts.engine_steps("l1,fp8", sm90, accumulate)


# ------------------------------------------------------------------------- tensor checks
WS = types.SimpleNamespace(device=torch.device("cpu"))


class _Subclass(torch.Tensor):
    """A tensor subclass: not a plain tensor, so it meets the rules one by one."""


def _misaligned(dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(9, dtype=dtype)[1:]  # 4 bytes past a 16-byte boundary (fp32)


GOOD = {
    "tensor": lambda: torch.zeros(4, 8),
    "parameter": lambda: torch.nn.Parameter(torch.zeros(4, 8)),
    "subclass": lambda: torch.zeros(4, 8).as_subclass(_Subclass),
    "empty at an odd offset": lambda: _misaligned()[:0].view(0, 1).expand(0, 8),
}
BAD = {
    "not a tensor": (lambda: [[0.0] * 8] * 4, TypeError, r"^t must be a torch\.Tensor, got list$"),
    "dtype": (lambda: torch.zeros(4, 8, dtype=torch.float64), TypeError,
              r"^t has dtype torch\.float64; expected one of \[torch\.float32\]$"),
    "dims": (lambda: torch.zeros(32), ValueError, r"^t has 1 dims \(shape \(32,\)\); expected 2$"),
    "device": (lambda: torch.zeros(4, 8, device="meta"), ValueError,
               r"^t is on meta but the workspace is on cpu$"),
    "not contiguous": (lambda: torch.zeros(8, 4).T, ValueError,
                       r"^t must be contiguous \(call \.contiguous\(\) on it\)$"),
    "misaligned": (lambda: _misaligned().view(1, 8), ValueError,
                   r"^t starts at an address that is not 16-byte aligned \(why\); pass t\.clone\(\) "
                   r"\(a fresh tensor\), or a view that starts at a multiple of 4 float32 elements$"),
    "misaligned parameter": (lambda: torch.nn.Parameter(_misaligned().view(1, 8)), ValueError,
                             r"^t starts at an address that is not 16-byte aligned"),
    "misaligned subclass": (lambda: _misaligned().view(1, 8).as_subclass(_Subclass), ValueError,
                            r"^t starts at an address that is not 16-byte aligned"),
}  # fmt: skip


#: The good tensors of a plain type (tensor or parameter), which the one-test good case lets by.
PLAIN_GOOD = ("tensor", "parameter", "empty at an odd offset")


@pytest.mark.parametrize("kind", list(GOOD))
def test_a_good_tensor_passes(kind, monkeypatch):
    """A plain one in the one-test good case (the rules one by one raise here if they run), a
    subclass through the rules."""
    ran, real_rules = [], api._check_tensor_rules

    def rules(*args):
        if kind in PLAIN_GOOD:
            raise AssertionError(f"a good {kind} met the rules one by one: no fast path taken")
        ran.append(args)
        real_rules(*args)

    monkeypatch.setattr(api, "_check_tensor_rules", rules)
    api._check_tensor("t", GOOD[kind](), WS, dtypes=(torch.float32,), ndim=2, why="why")
    assert len(ran) == (kind not in PLAIN_GOOD)


@pytest.mark.parametrize("kind", list(BAD))
def test_each_broken_rule_raises_its_own_error(kind):
    make, error, pattern = BAD[kind]
    with pytest.raises(error, match=pattern):
        api._check_tensor("t", make(), WS, dtypes=(torch.float32,), ndim=2, why="why")


def test_the_first_broken_rule_is_the_one_named():
    """A tensor that breaks several rules gets the error of the first, as rule by rule."""
    t = torch.zeros(8, 4, dtype=torch.float64, device="meta").T
    with pytest.raises(TypeError, match="dtype"):
        api._check_tensor("t", t, WS, dtypes=(torch.float32,), ndim=2)
    with pytest.raises(ValueError, match="on meta"):
        api._check_tensor("t", t, WS, dtypes=(torch.float64,), ndim=2)


def test_a_config_is_checked_by_value_unless_it_is_the_workspaces_own():
    given = MoKConfig()
    ws = types.SimpleNamespace(config=dataclasses.replace(given, minibatch_size=128),
                               given_config=given)  # fmt: skip
    for config in (ws.config, given, MoKConfig(), dataclasses.replace(given, minibatch_size=128)):
        api._check_config(ws, config)
    with pytest.raises(ValueError, match="differs from the one the workspace was made with"):
        api._check_config(ws, MoKConfig(minibatch_size=512))


# ------------------------------------------------------------------------ pending schedule
SIZES = dict(rank=1, num_ranks=2, num_tokens=6, max_tokens=8, topk=2, num_local_experts=3,
             row_capacity=128, token_capacity=16)  # fmt: skip


def test_a_pending_schedule_holds_what_init_would_set_but_its_tensors():
    sched = MoKSchedule.pending(build=lambda s: None, **SIZES)
    made = MoKSchedule(**SIZES, **dict.fromkeys(MoKSchedule.INTEGER_FIELDS))
    want = {k: v for k, v in vars(made).items() if k not in MoKSchedule.INTEGER_FIELDS}
    assert {k: v for k, v in vars(sched).items() if k != "_build"} == want
    assert sched.is_pending() and sched.global_weights is None and sched.weights_source is None


def test_a_pending_schedule_builds_on_the_first_read_of_a_tensor():
    built = []

    def build(s):
        built.append(s)
        s.fill({name: torch.zeros(1) for name in MoKSchedule.INTEGER_FIELDS})

    sched = MoKSchedule.pending(build=build, **SIZES)
    assert sched.row_expert.shape == (1,) and built == [sched] and not sched.is_pending()


@pytest.mark.parametrize("change", ["missing", "unknown"])
def test_a_pending_schedule_with_other_sizes_raises_as_init_does(change):
    sizes = dict(SIZES)
    if change == "missing":
        del sizes["topk"]
    else:
        sizes["num_experts"] = 3
    with pytest.raises(TypeError, match="topk" if change == "missing" else "num_experts"):
        MoKSchedule.pending(build=lambda s: None, **sizes)


# ------------------------------------------------------------------- the layer's workspace
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
