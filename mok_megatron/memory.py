"""Memory readings taken on the host without a device sync: what the training loop records after
every step and what the long-run checks (``testing.long_runs``) compare."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["MemorySample", "memory_sample", "process_rss_bytes"]


@dataclass(frozen=True)
class MemorySample:
    """One memory reading. kind: "cuda_reserved" (the caching allocator's reserved bytes,
    ``bytes``, and allocated bytes, ``allocated_bytes``) or "rss" (the process's resident set,
    ``bytes``; ``allocated_bytes`` None)."""

    kind: str
    bytes: int
    allocated_bytes: int | None


def process_rss_bytes() -> int:
    """This process's resident set size in bytes (/proc/self/statm's second field)."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def memory_sample(device: torch.device | str) -> MemorySample:
    """The allocator's reserved and allocated bytes on a CUDA ``device`` (no sync), else RSS."""
    device = torch.device(device)
    if device.type == "cuda":
        return MemorySample("cuda_reserved", torch.cuda.memory_reserved(device),
                            torch.cuda.memory_allocated(device))  # fmt: skip
    return MemorySample("rss", process_rss_bytes(), None)
