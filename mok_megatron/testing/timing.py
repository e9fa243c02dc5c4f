"""Timing and roofline helpers for the benchmarks (DESIGN.md, "Performance")."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

__all__ = ["Ceilings", "H200_CEILINGS", "Timing", "time_fn", "time_back_to_back", "moe_pass_cost"]


@dataclass(frozen=True)
class Ceilings:
    """Hardware ceilings measured on the device machine (DESIGN.md)."""

    bf16_tflops: float = 782.0
    nvlink_gbps: float = 389.0  # per direction
    hbm_tbps: float = 4.28  # read + write


H200_CEILINGS = Ceilings()


@dataclass
class Timing:
    """Milliseconds per call: median and the spread (10th / 90th percentile, min, max)."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    max_ms: float
    samples: int

    def as_dict(self) -> dict:
        return asdict(self)


def time_fn(fn: Callable[[int], object], *, warmup: int, iters: int, device: str) -> Timing:
    """Time ``fn(i)`` (``i`` rotates inputs so caches do not flatter) with CUDA events on GPU
    and ``perf_counter`` on CPU; each sample is one call."""
    for i in range(warmup):
        fn(i)
    samples = []
    for i in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(warmup + i)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(warmup + i)
            samples.append((time.perf_counter() - t0) * 1e3)
    return _timing(samples)


def time_back_to_back(fn: Callable[[int], object], *, warmup: int, iters: int, calls: int,
                      device: str) -> Timing:  # fmt: skip
    """Milliseconds per call of ``fn(i)`` called ``calls`` times back to back: each sample is one
    window of ``calls`` calls between two CUDA events, the host never waiting for the GPU inside
    it, divided by ``calls``. So the host prepares a call while the GPU runs the one before, as in
    a training step whose layers are sync-free; a call that synchronises with the host (reads a
    device value) keeps its host time in every sample, as it does in training. ``time_fn`` times
    each call from an idle GPU instead. CPU: ``time_fn``'s timing (no queue to keep full)."""
    if calls < 1:
        raise ValueError(f"calls={calls} must be >= 1: the calls timed back to back per sample")
    if device != "cuda":
        return time_fn(fn, warmup=warmup, iters=iters, device=device)
    for i in range(warmup):
        fn(i)
    samples = []
    n = warmup
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn(n)
            n += 1
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return _timing(samples)


def _timing(samples: list[float]) -> Timing:
    ordered = sorted(samples)

    def pct(q):
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return Timing(statistics.median(samples), pct(0.1), pct(0.9), ordered[0], ordered[-1],
                  len(samples))  # fmt: skip


def moe_pass_cost(*, routed_rows: int, remote_pairs: int, hidden: int, inter: int,
                  local_experts: int, backward: bool, elem_bytes: int = 2,
                  ceilings: Ceilings = H200_CEILINGS) -> dict:  # fmt: skip
    """FLOPs, NVLink bytes, HBM bytes and the floor time of one pass on one rank.

    routed_rows: (token, slot) rows this rank's experts compute; remote_pairs: (token, rank) pairs
    that cross the link from this rank (dispatch out, and as many combine rows back in).
    FLOPs = rows × 2 × H × 3I forward, 3× that for forward + backward. Link bytes: one H-row per
    remote pair each way (×2 with backward: d_out out, d_x back). HBM bytes, a lower bound: each
    weight read once and each GEMM's row operands read/written once (×3 with backward).
    """
    passes = 3 if backward else 1
    flops = routed_rows * 2 * hidden * 3 * inter * passes
    link = remote_pairs * hidden * elem_bytes * (2 if backward else 1)
    weights = 3 * local_experts * hidden * inter * elem_bytes
    rows = routed_rows * (hidden + 2 * inter + inter + hidden) * elem_bytes
    hbm = (weights + rows) * passes
    floor_s = max(flops / (ceilings.bf16_tflops * 1e12), link / (ceilings.nvlink_gbps * 1e9),
                  hbm / (ceilings.hbm_tbps * 1e12))  # fmt: skip
    return {"flops": flops, "link_bytes": link, "hbm_bytes": hbm, "floor_ms": floor_s * 1e3}
