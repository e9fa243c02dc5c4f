"""Running virtual ranks (``functional.create_virtual_workspaces``): each rank's work on a stream
of its own, every rank's work enqueued before anything waits, so their device-side barriers meet.

Each rank's function must not synchronise the host (every MoK pass is sync-free); a rank whose
work waits for another that was never enqueued hits the device-wait timeout instead of hanging.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["rank_streams", "run_ranks"]


def rank_streams(num_ranks: int) -> list[torch.cuda.Stream]:
    """One side stream per virtual rank, each with its cuBLAS state made.

    NOTE: torch makes cuBLAS's handle and a per-stream workspace at a stream's first matmul, and
    cuBLAS loads kernel libraries as it first needs them: inside a rank's pass, a load waits for
    the device while another rank's kernel waits for this rank. This makes the handle and the
    workspaces before any pass; it cannot load every kernel a later shape may pick, which is
    why the CUDA backend's passes keep off cuBLAS (only a shared expert whose widths are not
    multiples of 8 still takes torch's matmul).
    """
    streams = [torch.cuda.Stream() for _ in range(num_ranks)]
    a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            a @ a  # the matmuls of a pass (bf16 GEMMs) on this stream
    torch.cuda.synchronize()
    return streams


def run_ranks(
    fn: Callable[[int], Any], streams: Sequence[torch.cuda.Stream], join: bool = True
) -> list[Any]:
    """``[fn(0), ..., fn(W-1)]``, rank r's work on ``streams[r]``, all enqueued before any wait.

    Each stream first waits for the current stream's earlier work; with ``join`` the current
    stream then waits for all of them, so results can be used on it.
    """
    current = torch.cuda.current_stream()
    results = []
    for r, stream in enumerate(streams):
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            results.append(fn(r))
    if join:
        for stream in streams:
            current.wait_stream(stream)
    return results
