"""The check of "poisoned input stays local" (issue 17, item 2), shared by the reference
backend's test and the CUDA backend's."""

from __future__ import annotations

import torch

__all__ = ["ROUTED_GRADS", "assert_poison_local"]

ROUTED_GRADS = ("d_w_routed_gate", "d_w_routed_up", "d_w_routed_down")


def assert_poison_local(clean: dict, poisoned: dict, slots: torch.Tensor, experts: torch.Tensor,
                        names: tuple[str, ...]) -> None:  # fmt: skip
    """Non-finite exactly where the poison reaches, bitwise equal elsewhere.

    ``clean`` / ``poisoned``: out, d_x, d_router_weights ([T, ...] per token) and the routed
    gradients ([E, ...] per expert; a missing one, such as the fused form's up, is skipped).
    ``slots`` [T, K]: the poisoned (token, slot) pairs, whose router-weight gradients and whose
    tokens' out and d_x rows must be wholly non-finite. ``experts``: the experts whose gradients
    in ``names`` the poison reaches (some element non-finite)."""
    rows = {"out": slots.any(-1), "d_x": slots.any(-1), "d_router_weights": slots}
    for name, hit in rows.items():
        assert not torch.isfinite(poisoned[name][hit]).any(), f"{name}: a dependent value is finite"
        assert torch.equal(poisoned[name][~hit], clean[name][~hit]), f"{name}: the poison spread"
    for name in ROUTED_GRADS:
        if clean.get(name) is None:
            continue
        hit = torch.zeros(clean[name].shape[0], dtype=torch.bool)
        if name in names:
            hit[experts] = True
            assert not torch.isfinite(poisoned[name][hit]).all(), f"{name}: expert unaffected"
        assert torch.equal(poisoned[name][~hit], clean[name][~hit]), f"{name}: the poison spread"
