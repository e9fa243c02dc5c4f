"""Named containers passed between the API and the backends."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["ExpertWeights", "FusedExpertWeights", "MoKGradients"]


class ExpertWeights(NamedTuple):
    """One SwiGLU MLP's weights: gate and up ``[..., I, H]``, down ``[..., H, I]``.

    Routed experts carry a leading ``E_l`` dimension; the shared expert has none.
    """

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class FusedExpertWeights(NamedTuple):
    """The routed experts' weights in the fused form: ``gate_up`` ``[E_l, 2I, H]`` holds each
    expert's gate and up rows interleaved in blocks of 8 (``ops.interleave_gate_up``: rows
    ``16b..16b+7`` are gate rows ``8b..8b+7``, the next 8 the matching up rows), so one GEMM
    tile holds matching gate and up columns; ``down`` ``[E_l, H, I]``.

    Passed to ``functional.forward`` / ``backward`` / ``moe`` as ``(gate_up, None, down)``; the
    gradient of ``gate_up`` comes back in the same layout in the ``d_w_routed_gate`` slot.
    """

    gate_up: torch.Tensor
    down: torch.Tensor


class MoKGradients(NamedTuple):
    """Every gradient of ``functional.backward``, in the documented order (unpacks as a tuple).

    d_x: [T, H], x's dtype; d_router_weights: [T, K], router_weights' dtype (0 for empty slots);
    routed-weight gradients cover every token any rank routed to the local experts (with the fused
    gate/up form, ``d_w_routed_gate`` is the fused weight's gradient and ``d_w_routed_up`` None);
    shared-weight gradients (None without a shared expert) cover the local tokens only. With
    ``wgrad_accumulators`` (``functional.backward``), the routed-weight gradients went into those
    buffers and their slots are None.
    """

    d_x: torch.Tensor
    d_router_weights: torch.Tensor
    d_w_routed_gate: torch.Tensor | None
    d_w_routed_up: torch.Tensor | None
    d_w_routed_down: torch.Tensor | None
    d_w_shared_gate: torch.Tensor | None
    d_w_shared_up: torch.Tensor | None
    d_w_shared_down: torch.Tensor | None
