"""Bad input gets a clear error that names the rule (reference backend, one rank)."""

from __future__ import annotations

import pytest
import torch

from mok_megatron import functional as F
from mok_megatron.testing import random_moe_problem
from mok_megatron.testing.runs import problem_workspace

H, I, E, K, T = 16, 24, 4, 2, 20


def _setup(dtype=torch.float32):
    problem = random_moe_problem([T], H, I, E, K, shared_inter=8, dtype=dtype)
    config = F.MoKConfig()
    ws = problem_workspace(problem, dtype=dtype, config=config)
    x, topk, rw, routed, shared = problem.local(0)
    return config, ws, x, topk, rw, list(routed), list(shared)


def _forward(config, ws, x, topk, rw, routed, shared):
    sched = F.build_schedule(ws, config, topk, ws.num_local_experts)
    return F.forward(config, ws, sched, x, rw, *shared, *routed)


def test_expert_id_out_of_range():
    config, ws, x, topk, rw, routed, shared = _setup()
    topk[3, 1] = E
    with pytest.raises(ValueError, match=r"expert id outside \[-1, 4\)"):
        F.build_schedule(ws, config, topk, ws.num_local_experts)


def test_topk_larger_than_num_experts():
    with pytest.raises(ValueError, match="topk=5 must be in"):
        F.create_workspace(
            F.MoKConfig(),
            None,
            device="cpu",
            num_local_tokens=4,
            hidden_size=H,
            topk=5,
            num_experts=4,
            intermediate_size=I,
            backend="reference",
        )


def test_wrong_dtypes():
    config, ws, x, topk, rw, routed, shared = _setup()
    with pytest.raises(TypeError, match="topk_experts has dtype torch.int32"):
        F.build_schedule(ws, config, topk.int(), ws.num_local_experts)
    with pytest.raises(TypeError, match="router_weights has dtype torch.float16"):
        _forward(config, ws, x, topk, rw.half(), routed, shared)
    routed[1] = routed[1].double()
    with pytest.raises(TypeError, match="w_routed_up has dtype torch.float64"):
        _forward(config, ws, x, topk, rw, routed, shared)


def test_wrong_shapes():
    config, ws, x, topk, rw, routed, shared = _setup()
    with pytest.raises(ValueError, match=r"router_weights has shape \(20, 1\); it must match"):
        _forward(config, ws, x, topk, rw[:, :1].contiguous(), routed, shared)
    with pytest.raises(ValueError, match="w_routed_down has shape"):
        _forward(config, ws, x, topk, rw, routed[:2] + [routed[2].transpose(1, 2).contiguous()],
                 shared)  # fmt: skip
    with pytest.raises(ValueError, match="3 slots per token"):
        F.build_schedule(ws, config, torch.cat([topk, topk[:, :1]], 1), ws.num_local_experts)
    with pytest.raises(ValueError, match="at most num_local_tokens=20"):
        F.build_schedule(ws, config, torch.cat([topk, topk]), ws.num_local_experts)


def test_wrong_device():
    config, ws, x, topk, rw, routed, shared = _setup()
    sched = F.build_schedule(ws, config, topk, ws.num_local_experts)
    with pytest.raises(ValueError, match="x is on meta but the workspace is on cpu"):
        F.forward(config, ws, sched, x.to("meta"), rw, *shared, *routed)


def test_non_contiguous_weights():
    config, ws, x, topk, rw, routed, shared = _setup()
    routed[0] = routed[0].transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match=r"w_routed_gate must be contiguous"):
        _forward(config, ws, x, topk, rw, routed, shared)


def test_partial_shared_expert_and_config_mismatch():
    config, ws, x, topk, rw, routed, shared = _setup()
    with pytest.raises(ValueError, match="all three shared-expert weights or none"):
        _forward(config, ws, x, topk, rw, routed, [shared[0], None, None])
    with pytest.raises(ValueError, match="differs from the one the workspace was made with"):
        _forward(F.MoKConfig(fwd_num_comm_sms=3), ws, x, topk, rw, routed, shared)


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
