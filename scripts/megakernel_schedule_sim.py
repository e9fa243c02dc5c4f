#!/usr/bin/env python3
"""A model of one megakernel round's task schedule: how much longer than a perfect split of the
work the round takes when each CTA gets a static round-robin share of the task order, and when
CTAs take tasks one ticket at a time (what the kernel does, roles/megakernel_tasks.cuh).

The model: a task costs ``overhead + k_tiles`` time units (L1: ceil(H / 64) k-tiles, L2:
ceil(I / 64)); an L2 task starts only after every L1 task of its m-tile has finished; rows are
there from the start (EP 1, comm not modelled). It is a model, not a measurement: it says why a
static share loses time when L1 and L2 tasks differ in length, not how fast the GPU is.

    python3 scripts/megakernel_schedule_sim.py [--ctas 112,132] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64  # layout/mega.cuh, the mainloop tile


def task_order(
    num_mtiles: int, n1: int, n2: int, num_ctas: int, block: int = 1
) -> list[tuple[bool, int]]:
    """(is_l2, m-tile) of every task, in MegaTaskOrder's order: m-tiles in blocks of `block`
    (the last padded), each block's tasks n-tile-major; L1 blocks `lag` ahead of L2 blocks.
    Tasks of padding m-tiles (>= num_mtiles) are dropped here (the kernel skips them)."""
    nb = -(-num_mtiles // block)
    lag = min(nb, max(1, math.ceil(num_ctas / (block * n1))))

    def tasks(l2: bool, b: int) -> list[tuple[bool, int]]:
        n = n2 if l2 else n1
        ms = [b * block + i for i in range(block)]
        return [(l2, m) for _ in range(n) for m in ms if m < num_mtiles]

    order = [t for b in range(lag) for t in tasks(False, b)]
    for j in range(nb - lag):
        order += tasks(False, lag + j) + tasks(True, j)
    order += [t for b in range(nb - lag, nb) for t in tasks(True, b)]
    return order


def simulate(
    experts: int,
    rows_per_expert: int,
    hidden: int,
    inter: int,
    num_ctas: int,
    tickets: bool,
    block: int = 1,
    overhead: float = 4.0,
) -> float:
    """Round time over the perfect split (sum of task costs / CTAs)."""
    mtiles = experts * math.ceil(rows_per_expert / BLOCK_M)
    n1, n2 = math.ceil(2 * inter / BLOCK_N), math.ceil(hidden / BLOCK_N)
    k1, k2 = math.ceil(hidden / BLOCK_K), math.ceil(inter / BLOCK_K)
    order = task_order(mtiles, n1, n2, num_ctas, block)
    l1_end = [0.0] * mtiles
    cost = [overhead + k1, overhead + k2]
    free = [(0.0, c) for c in range(num_ctas)]
    for i, (l2, m) in enumerate(order):
        if tickets:
            ready, cta = heapq.heappop(free)  # the first CTA free takes the next ticket
        else:
            cta = i % num_ctas
            ready = free[cta][0]
        start = max(ready, l1_end[m] if l2 else 0.0)
        end = start + cost[l2]
        if not l2:
            l1_end[m] = max(l1_end[m], end)
        if tickets:
            heapq.heappush(free, (end, cta))
        else:
            free[cta] = (end, cta)
    ideal = sum(cost[l2] for l2, _ in order) / num_ctas
    return max(t for t, _ in free) / ideal


def main() -> None:
    from bench_moe import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctas", default="112,116,128,132")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--block", type=int, default=1, help="m-tiles per block of the order")
    args = ap.parse_args()
    print("shape, CTAs: round time / perfect split (static share | tickets)")
    for name, (hidden, inter, experts, topk) in SHAPES.items():
        rows = args.tokens * topk // experts  # uniform routing
        for ctas in (int(c) for c in args.ctas.split(",")):
            static = simulate(experts, rows, hidden, inter, ctas, False, args.block)
            ticket = simulate(experts, rows, hidden, inter, ctas, True, args.block)
            print(f"{name:>14} {ctas:4d}: {static:.3f} | {ticket:.3f}")


if __name__ == "__main__":
    main()
