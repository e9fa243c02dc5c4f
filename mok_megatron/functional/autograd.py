"""``functional.moe``: the differentiable MoK layer, for use inside any autograd graph."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import api
from .config import MoKConfig
from .fp8_weights import share_fp8_weight
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


class _Backward:
    """One ``moe`` call's backward, split over its two autograd nodes (``api.backward_steps``).

    ``_DownGrad`` (the output's node, so autograd runs it first) begins it and hands autograd the
    routed down weight's gradient, which autograd adds into ``.grad`` and lets go; then
    ``_MoKFunction``'s node finishes the rest. The down and gate/up gradients, each the size of
    its weight, never both exist (deepseek-v3 at EP 1: 7.5 and 15 GB).
    """

    def __init__(self, accumulation: _WgradAccumulation | None):
        self.accumulation = accumulation
        self._call = None  # what the forward kept: the backward's arguments but d_out, x, rw
        self._steps = None  # the backward between its two steps

    def keep(self, config, ws, sched, backend_ctx, weights) -> None:
        self._call = (config, ws, sched, backend_ctx, weights)

    def begin(self, d_out, x, router_weights, w_down):
        """Step 1; returns what autograd gets for ``w_down`` (the routed down weight itself: the
        forward had a detached alias)."""
        if self._call is None:
            raise RuntimeError(
                "mok backward: this forward's backward already ran (a second backward through "
                "one graph, retain_graph=True?) or it kept nothing (it ran without gradients); "
                "its saved activations serve one backward: run the forward again"
            )
        config, ws, sched, backend_ctx, weights = self._call
        self._call = None
        acc = self.accumulation
        self._steps = api.backward_steps(
            config, ws, sched, backend_ctx, api._aligned_contiguous(d_out), x, router_weights,
            *weights, wgrad_accumulators=acc.buffers if acc is not None else None,
        )  # fmt: skip
        d_w_down = next(self._steps)
        if acc is not None:  # the gradient is in its buffer already
            return acc.grad_for(w_down, acc.buffers[2])
        return d_w_down if isinstance(w_down, torch.Tensor) else None

    def finish(self):
        """Step 2: the other gradients (``MoKGradients``)."""
        if self._steps is None:
            raise RuntimeError("mok backward: the layer's node ran before its output's (_DownGrad)")
        steps, self._steps = self._steps, None
        return next(steps)


class _MoKFunction(torch.autograd.Function):
    """The layer's forward (the routed down weight comes detached: ``_DownGrad`` has its edge)."""

    @staticmethod
    def forward(fctx, config, ws, link, save, x, topk_experts, router_weights, *weights):
        sched = api.build_schedule(ws, config, topk_experts, router_weights=router_weights)
        out, backend_ctx = api.forward(
            config, ws, sched, x, router_weights, *weights, save_for_backward=save
        )
        if save:
            link.keep(config, ws, sched, backend_ctx, weights)
        fctx.link, fctx.weights = link, weights
        return out

    @staticmethod
    def backward(fctx, d_out):
        del d_out  # _DownGrad's step 1 took it
        grads = fctx.link.finish()
        accumulation = fctx.link.accumulation
        shared, routed = grads[5:8], grads[2:4]
        if accumulation is not None:  # those gradients are in the buffers already
            routed = [accumulation.grad_for(w, buf)
                      for w, buf in zip(fctx.weights[3:5], accumulation.buffers[:2])]  # fmt: skip
        weight_grads = [
            g if isinstance(w, torch.Tensor) else None
            for g, w in zip((*shared, *routed), fctx.weights[:5])
        ]
        return (None, None, None, None, grads.d_x, None, grads.d_router_weights,
                *weight_grads, None)  # fmt: skip


class _DownGrad(torch.autograd.Function):
    """The identity on the layer's output; its backward is the layer's step 1 (``_Backward``) and
    gives the routed down weight's gradient."""

    @staticmethod
    def forward(fctx, link, out, w_down, x, router_weights):
        fctx.link, fctx.w_down = link, w_down
        fctx.save_for_backward(x, router_weights)
        return out.detach()  # not `out`: an input returned as is could not be modified in place

    @staticmethod
    def backward(fctx, d_out):
        x, router_weights = fctx.saved_tensors
        d_w_down = fctx.link.begin(d_out, x, router_weights, fctx.w_down)
        return None, d_out, d_w_down, None, None


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
    inputs = (x, router_weights, *shared, *routed)
    save = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in inputs
    )  # under torch.no_grad() (or with nothing to differentiate) nothing is kept for a backward
    link = _Backward(accumulation)
    down = routed[2]
    # the alias shares down's FP8 copy (kept on down): a fresh alias would requantise it per pass
    detached = share_fp8_weight(down.detach(), down) if isinstance(down, torch.Tensor) else down
    out = _MoKFunction.apply(
        config, workspace, link, save, x, topk_experts, router_weights, *shared, *routed[:2],
        detached,
    )  # fmt: skip
    # x and router_weights only kept for the backward (detached: no edges of _DownGrad's)
    return _DownGrad.apply(link, out, down, x.detach(), router_weights.detach())


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
