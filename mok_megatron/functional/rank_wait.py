"""Bounded waits for the other ranks of a gloo group (the reference backend's collectives, and
the config check every workspace makes): a rank that never arrives fails every other rank
within MoKConfig.wait_timeout_ms, naming the phase and the missing ranks, instead of leaving
them in the process group's 30-minute default wait.

The wait is a barrier over the process group's key-value store (the one torch.distributed was
initialised with), not ``dist.monitored_barrier``: that one bounds only rank 0's wait (the other
ranks wait for rank 0 with the group's own timeout), so a stalled rank 0 would hold the rest.
Here each rank writes a key for the barrier and waits for everyone's with the timeout; whoever
times out reads which keys are missing.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

__all__ = ["wait_for_ranks"]

#: Barriers passed so far, by group name: every rank of a group calls wait_for_ranks the same
#: number of times (at the same phases), so the n-th call meets the n-th call of the others.
_SEQUENCE: dict[str, int] = {}
_PREFIX = "mok/rank_wait"


def wait_for_ranks(group, timeout_ms: int, phase: str) -> None:
    """A barrier over ``group`` on gloo, bounded by ``timeout_ms`` on every rank (a no-op on
    other backends: NCCL keeps its own timeout, and the CUDA backend's device-side waits are
    bounded by themselves)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_backend(group) != "gloo":
        return
    if dist.get_world_size(group) == 1:
        return
    group = group or dist.group.WORLD
    name = group.group_name
    seq = _SEQUENCE[name] = _SEQUENCE.get(name, 0) + 1
    ranks = dist.get_process_group_ranks(group)
    store = dist.distributed_c10d._get_default_store()
    keys = [f"{_PREFIX}/{name}/{seq}/{r}" for r in ranks]
    me = dist.get_rank()
    store.set(f"{_PREFIX}/{name}/{seq}/{me}", phase)
    try:
        store.wait(keys, timedelta(milliseconds=timeout_ms))
    except RuntimeError as exc:  # DistStoreError: the timeout (or the store's host is gone)
        missing = [r for r, key in zip(ranks, keys) if not _arrived(store, key)]
        raise RuntimeError(
            f"mok: rank {dist.get_rank(group)} of {dist.get_world_size(group)} waited at "
            f"'{phase}' and not every rank arrived within wait_timeout_ms={timeout_ms}: missing "
            f"rank(s) {missing} (global ranks; {type(exc).__name__}: {exc}) (did a rank stop, "
            "fail, or skip this pass? raise MoKConfig.wait_timeout_ms if it is only slow)"
        ) from exc
    if seq > 1:  # every rank is past barrier seq - 1: its key is read by all
        store.delete_key(f"{_PREFIX}/{name}/{seq - 1}/{me}")


def _arrived(store, key: str) -> bool:
    try:
        return store.check([key])
    except RuntimeError:  # the store itself is unreachable: say nobody is known to have arrived
        return False
