"""``functional.moe``: the differentiable MoK layer, for use inside any autograd graph."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import api
from .config import MoKConfig
from .workspace import MoKWorkspace, get_workspace

__all__ = ["moe"]


class _MoKFunction(torch.autograd.Function):
    @staticmethod
    def forward(fctx, config, ws, x, topk_experts, router_weights, *weights):
        sched = api.build_schedule(ws, config, topk_experts, router_weights=router_weights)
        save = any(fctx.needs_input_grad)  # under torch.no_grad() nothing is kept for a backward
        out, backend_ctx = api.forward(
            config, ws, sched, x, router_weights, *weights, save_for_backward=save
        )
        fctx.config, fctx.ws, fctx.sched, fctx.backend_ctx = config, ws, sched, backend_ctx
        fctx.weights = weights
        fctx.save_for_backward(x, router_weights)
        return out

    @staticmethod
    def backward(fctx, d_out):
        x, router_weights = fctx.saved_tensors
        grads = api.backward(
            fctx.config, fctx.ws, fctx.sched, fctx.backend_ctx, d_out.contiguous(), x,
            router_weights, *fctx.weights,
        )  # fmt: skip
        fctx.backend_ctx = None
        shared = grads[5:8]
        routed = grads[2:5]
        weight_grads = [
            g if isinstance(w, torch.Tensor) else None
            for g, w in zip((*shared, *routed), fctx.weights)
        ]
        return (None, None, grads.d_x, None, grads.d_router_weights, *weight_grads)


def moe(
    x: torch.Tensor,
    topk_experts: torch.Tensor,
    router_weights: torch.Tensor,
    w_routed_gate: Any,
    w_routed_up: Any,
    w_routed_down: Any,
    shared: tuple[Any, Any, Any] | None = None,
    *,
    config: MoKConfig | None = None,
    workspace: MoKWorkspace | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The MoE layer as one differentiable call (a collective over the expert-parallel group).

    x: [T, H]; topk_experts: [T, K] int64 (-1 = empty slot); router_weights: [T, K] float32;
    w_routed_gate / w_routed_up: [E_l, I, H]; w_routed_down: [E_l, H, I] (or the fused form:
    w_routed_gate = gate_up [E_l, 2I, H] interleaved, w_routed_up = None; see
    ``FusedExpertWeights``); shared: the shared
    expert's (gate [I_s, H], up [I_s, H], down [H, I_s]) or None. Returns out: [T, H].
    Without ``workspace``, a cached one is made for ``group`` (the default group if None) with
    num_local_tokens = T.
    """
    config = config or (workspace.config if workspace is not None else MoKConfig())
    if workspace is None:
        workspace = _default_workspace(
            config, group, x, topk_experts, w_routed_gate, w_routed_up, shared
        )
    shared = shared if shared is not None else (None, None, None)
    return _MoKFunction.apply(
        config, workspace, x, topk_experts, router_weights, *shared,
        w_routed_gate, w_routed_up, w_routed_down,
    )  # fmt: skip


def _default_workspace(config, group, x, topk_experts, w_gate, w_up, shared) -> MoKWorkspace:
    num_ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    gate_shape = api._dense_shape(w_gate)
    if w_up is None:  # the fused gate/up form: [E_l, 2I, H]
        gate_shape = (gate_shape[0], gate_shape[1] // 2)
    return get_workspace(
        config, group, device=x.device, num_local_tokens=x.shape[0], hidden_size=x.shape[1],
        topk=topk_experts.shape[1], num_experts=gate_shape[0] * num_ranks,
        intermediate_size=gate_shape[1],
        shared_intermediate_size=api._dense_shape(shared[0])[0] if shared else 0,
        dtype=x.dtype,
    )  # fmt: skip
