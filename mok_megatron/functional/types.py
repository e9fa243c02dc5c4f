"""Named containers passed between the API and the backends."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["ExpertWeights", "MoKGradients"]


class ExpertWeights(NamedTuple):
    """One SwiGLU MLP's weights: gate and up ``[..., I, H]``, down ``[..., H, I]``.

    Routed experts carry a leading ``E_l`` dimension; the shared expert has none.
    """

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class MoKGradients(NamedTuple):
    """Every gradient of ``functional.backward``, in the documented order (unpacks as a tuple).

    d_x: [T, H], x's dtype; d_router_weights: [T, K], router_weights' dtype (0 for empty slots);
    routed-weight gradients cover every token any rank routed to the local experts; shared-weight
    gradients (None without a shared expert) cover the local tokens only.
    """

    d_x: torch.Tensor
    d_router_weights: torch.Tensor
    d_w_routed_gate: torch.Tensor
    d_w_routed_up: torch.Tensor
    d_w_routed_down: torch.Tensor
    d_w_shared_gate: torch.Tensor | None
    d_w_shared_up: torch.Tensor | None
    d_w_shared_down: torch.Tensor | None
