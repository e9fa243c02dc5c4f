"""``functional.moe``: the differentiable MoK layer, for use inside any autograd graph."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import api
from .config import MoKConfig
from .workspace import MoKWorkspace, get_workspace

__all__ = ["moe"]

#: ``accumulated_grad(weight, accumulator)``: the gradient autograd gets for a routed weight whose
#: gradient went into its accumulator (None: no gradient at all).
AccumulatedGrad = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]


@dataclass(frozen=True)
class _WgradAccumulation:
    """``moe``'s wgrad_accumulators (routed weights' slots) and accumulated_grad, kept from the
    forward to the backward (as Megatron keeps ``main_grad``: it may be re-pointed between)."""

    buffers: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
    accumulated_grad: AccumulatedGrad | None

    def grad_for(self, weight, buffer):
        """What autograd gets for ``weight`` (a routed weight; None where it has no buffer)."""
        if buffer is None or self.accumulated_grad is None or not isinstance(weight, torch.Tensor):
            return None
        return self.accumulated_grad(weight, buffer)


class _MoKFunction(torch.autograd.Function):
    @staticmethod
    def forward(fctx, config, ws, accumulation, x, topk_experts, router_weights, *weights):
        sched = api.build_schedule(ws, config, topk_experts, router_weights=router_weights)
        save = any(fctx.needs_input_grad)  # under torch.no_grad() nothing is kept for a backward
        out, backend_ctx = api.forward(
            config, ws, sched, x, router_weights, *weights, save_for_backward=save
        )
        fctx.config, fctx.ws, fctx.sched, fctx.backend_ctx = config, ws, sched, backend_ctx
        fctx.weights, fctx.accumulation = weights, accumulation
        fctx.save_for_backward(x, router_weights)
        return out

    @staticmethod
    def backward(fctx, d_out):
        x, router_weights = fctx.saved_tensors
        accumulation = fctx.accumulation
        grads = api.backward(
            fctx.config, fctx.ws, fctx.sched, fctx.backend_ctx, api._aligned_contiguous(d_out), x,
            router_weights, *fctx.weights,
            wgrad_accumulators=accumulation.buffers if accumulation is not None else None,
        )  # fmt: skip
        fctx.backend_ctx = None
        shared = grads[5:8]
        routed = grads[2:5]
        if accumulation is not None:  # those gradients are in the buffers already
            routed = [accumulation.grad_for(w, buf)
                      for w, buf in zip(fctx.weights[3:], accumulation.buffers)]  # fmt: skip
        weight_grads = [
            g if isinstance(w, torch.Tensor) else None
            for g, w in zip((*shared, *routed), fctx.weights)
        ]
        return (None, None, None, grads.d_x, None, grads.d_router_weights, *weight_grads)


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
    wgrad_accumulators: tuple[torch.Tensor | None, ...] | None = None,
    accumulated_grad: AccumulatedGrad | None = None,
) -> torch.Tensor:
    """The MoE layer as one differentiable call (a collective over the expert-parallel group).

    x: [T, H]; topk_experts: [T, K] int64 (-1 = empty slot); router_weights: [T, K] float32;
    w_routed_gate / w_routed_up: [E_l, I, H]; w_routed_down: [E_l, H, I] (or the fused form:
    w_routed_gate = gate_up [E_l, 2I, H] interleaved, w_routed_up = None; see
    ``FusedExpertWeights``); shared: the shared
    expert's (gate [I_s, H], up [I_s, H], down [H, I_s]) or None. Returns out: [T, H].
    Without ``workspace``, a cached one is made for ``group`` (the default group if None) with
    num_local_tokens = T.

    wgrad_accumulators: as ``functional.backward``'s (one fp32 buffer per routed weight, in the
    weights' form): the backward adds the routed-weight gradients into them (gradient-accumulation
    fusion); they are taken now, at the forward. accumulated_grad(weight, buffer): what autograd
    then gets as such a weight's gradient (default: None, so its ``.grad`` is left alone); e.g.
    Megatron's placeholder (``mok_megatron.megatron``'s MoKExperts passes it).
    """
    config = config or (workspace.config if workspace is not None else MoKConfig())
    if workspace is None:
        workspace = _default_workspace(
            config, group, x, topk_experts, w_routed_gate, w_routed_up, shared
        )
    routed = (w_routed_gate, w_routed_up, w_routed_down)
    accumulation = _accumulation(wgrad_accumulators, accumulated_grad, workspace, x, routed)
    shared = shared if shared is not None else (None, None, None)
    return _MoKFunction.apply(
        config, workspace, accumulation, x, topk_experts, router_weights, *shared, *routed
    )


def _accumulation(buffers, accumulated_grad, ws, x, routed) -> _WgradAccumulation | None:
    """The checked accumulators (at the forward: bad buffers fail before any work), or None."""
    if buffers is None:
        if accumulated_grad is not None:
            raise ValueError("accumulated_grad is for wgrad_accumulators; pass those too")
        return None
    api.check_wgrad_accumulators(buffers, ws, x.dtype, routed)
    return _WgradAccumulation(tuple(buffers), accumulated_grad)


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
