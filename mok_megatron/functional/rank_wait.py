"""Bounded waits for the other ranks of a gloo group (the reference backend's collectives, and
the config check every workspace makes): a rank that never arrives fails the others within
MoKConfig.wait_timeout_ms, naming the phase and (on the group's first rank) the missing ranks,
instead of leaving them in the process group's 30-minute default wait."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

__all__ = ["wait_for_ranks"]


def wait_for_ranks(group, timeout_ms: int, phase: str) -> None:
    """A monitored barrier over ``group`` on gloo (a no-op on other backends: NCCL keeps its own
    timeout, and the CUDA backend's device-side waits are bounded by themselves)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_backend(group) != "gloo":
        return
    if dist.get_world_size(group) == 1:
        return
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(milliseconds=timeout_ms),
                               wait_all_ranks=True)  # fmt: skip
    except RuntimeError as exc:
        raise RuntimeError(
            f"mok: rank {dist.get_rank(group)} of {dist.get_world_size(group)} waited at "
            f"'{phase}' and not every rank arrived within wait_timeout_ms={timeout_ms}: {exc} "
            "(did a rank stop, fail, or skip this pass? raise MoKConfig.wait_timeout_ms if it is "
            "only slow)"
        ) from exc
