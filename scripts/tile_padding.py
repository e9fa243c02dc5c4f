#!/usr/bin/env python3
"""How many more rows the megakernel's GEMM tiles compute than the routing sends, on the
benchmark's own routing (scripts/bench_moe.py's inputs: same shapes, seed and input sets).

The floor model (testing.timing.moe_pass_cost) counts the routed rows' FLOPs. The megakernel
computes each expert's rows in m-tiles of 128 (layout/mega.cuh, kBlockM), and an m-tile of at
most 64 rows at half cost (its second consumer warpgroup idles: roles/megakernel_gemm.cuh,
consumer_rows_idle). So an expert with n rows costs ``64 * units(n)`` rows of tensor-core work,
``units(n) = 2 * (n // 128) + (0, 1 or 2 for the rest: none, at most 64, more)``; the n-tiles and
k-tiles of the three benchmark shapes divide their GEMMs exactly. ``tile_efficiency`` is the
routed rows over the computed rows: the fraction of the floor the megakernel's mainloop would
reach if every k-tile ran at the floor's rate and nothing else took time. A model computed on
the CPU from the routing, not a measurement.

``tail_efficiency``: the same with each expert's last partial m-tile costing its rows rounded up
to a multiple of g (TAIL_GRANULARITIES) instead of 64 or 128: what a tail tile with the operands
swapped would cost (the weight tile as wgmma's A, M = 64 per warpgroup, and the expert's last rows
as B, whose N steps by 8), at the floor's rate per FLOP. Not built: a design's ceiling.

    python3 scripts/tile_padding.py --out docs/results/tile_padding_<commit>.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe  # noqa: E402

BLOCK_M = 128  # rows of an m-tile (layout/mega.cuh, kBlockM)
HALF_M = BLOCK_M // 2  # rows of one consumer warpgroup's half of it
TAIL_GRANULARITIES = (32, 16, 8)  # a swapped tail tile's row steps modelled (wgmma N: steps of 8)


def units(rows: torch.Tensor) -> torch.Tensor:
    """Half-tiles of tensor-core work per expert (rows: [E] int64)."""
    rest = rows % BLOCK_M
    return 2 * (rows // BLOCK_M) + (rest > 0).long() + (rest > HALF_M).long()


def tail_rows(rows: torch.Tensor, granularity: int) -> torch.Tensor:
    """Rows of tensor-core work per expert with the last partial m-tile's rows rounded up to
    ``granularity`` (rows: [E] int64)."""
    rest = rows % BLOCK_M
    return BLOCK_M * (rows // BLOCK_M) + (rest + granularity - 1) // granularity * granularity


def case(shape_name: str, tokens: int, routing: str, args) -> dict:
    shape = bench_moe.SHAPES[shape_name]
    hidden, inter, experts, topk = shape
    sets = bench_moe.make_inputs(args.rotate, tokens, shape, routing, "cpu", torch.bfloat16,
                                 args.seed, 0)  # fmt: skip
    per_set = []
    for inputs in sets:
        rows = torch.bincount(inputs["idx"].reshape(-1), minlength=experts)
        rest = rows % BLOCK_M
        per_set.append({"routed_rows": int(rows.sum()),
                        "computed_rows": int(units(rows).sum()) * HALF_M,
                        "m_tiles": int(((rows + BLOCK_M - 1) // BLOCK_M).sum()),
                        "half_cost_m_tiles": int(((rest > 0) & (rest <= HALF_M)).sum()),
                        "rows_per_expert_min": int(rows.min()),
                        "rows_per_expert_max": int(rows.max()),
                        "tail_computed_rows": {str(g): int(tail_rows(rows, g).sum())
                                               for g in TAIL_GRANULARITIES}})  # fmt: skip
    routed = sum(s["routed_rows"] for s in per_set)
    computed = sum(s["computed_rows"] for s in per_set)
    tail = {str(g): routed / sum(s["tail_computed_rows"][str(g)] for s in per_set)
            for g in TAIL_GRANULARITIES}  # fmt: skip
    return {"shape": shape_name, "hidden": hidden, "intermediate": inter, "experts": experts,
            "topk": topk, "tokens_per_rank": tokens, "routing": routing, "ep": 1,
            "sets": per_set, "tile_efficiency": routed / computed,
            "tail_efficiency": tail}  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(bench_moe.SHAPES))
    p.add_argument("--tokens", default="8192,16384")
    p.add_argument("--routing", default="uniform,skewed")
    p.add_argument("--rotate", type=int, default=3, help="input sets (bench_moe.py's default)")
    p.add_argument("--seed", type=int, default=1234, help="bench_moe.py's default")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    cases = [case(s, int(t), r, args) for s in args.shapes.split(",")
             for t in args.tokens.split(",") for r in args.routing.split(",")]  # fmt: skip
    for c in cases:
        print(f"{c['shape']} T={c['tokens_per_rank']} {c['routing']}: the m-tiles compute "
              f"{1 / c['tile_efficiency']:.3f}x the routed rows (tile efficiency "
              f"{c['tile_efficiency']:.3f}; with a swapped tail tile in steps of "
              + ", ".join(f"{g}: {e:.3f}" for g, e in c["tail_efficiency"].items()) + ")")  # fmt: skip
    bench_moe.write_model_record("tile_padding", args, cases, block_m=BLOCK_M)


if __name__ == "__main__":
    main()
