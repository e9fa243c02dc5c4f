#!/usr/bin/env python3
"""Where the megakernel's forward time goes, by difference (no counters needed): the same layer
(scripts/bench_moe.py's layers, weights and routing) timed with and without keeping the
activations for a backward (with: the L1 epilogue also stores h and the L2 epilogue y), at
several fwd_num_comm_sms, beside stage 1 and the baseline, in one process. JSON record.

  python3 scripts/megakernel_breakdown.py --out docs/results/megakernel_breakdown_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_moe  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(bench_moe.SHAPES))
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--comm-sms", default="4,8,20")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def timed(layer, sets, args, grad: bool) -> float:
    from mok_megatron.testing.timing import time_fn

    ctx = contextlib.nullcontext() if grad else torch.no_grad()
    with ctx:
        t = time_fn(lambda i: bench_moe.run_layer(layer, sets[i % 2], backward=False),
                    warmup=args.warmup, iters=args.iters, device="cuda")  # fmt: skip
    return t.median_ms


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, _ = bench_moe.init_distributed("cuda")
    record = {"benchmark": "megakernel_breakdown",
              "environment": bench_moe.environment(bench_moe.parse_args([])),
              "args": vars(args), "cases": []}  # fmt: skip
    for name in args.shapes.split(","):
        shape = bench_moe.SHAPES[name]
        config = bench_moe.transformer_config(shape, "cuda")
        base, layer = bench_moe.build_layers(config, "cuda", args.tokens, "megakernel")
        sets = bench_moe.make_inputs(2, args.tokens, shape, "uniform", "cuda",
                                     config.params_dtype, 1234, rank)  # fmt: skip
        runtime = layer.experts._layer_runtime
        default = runtime.mok_config
        case = {"shape": name, "tokens_per_rank": args.tokens,
                "baseline_fwd_ms": timed(base, sets, args, grad=True), "megakernel": {}}  # fmt: skip
        for comm in map(int, args.comm_sms.split(",")):
            runtime.mok_config = dataclasses.replace(default, fwd_num_comm_sms=comm)
            case["megakernel"][comm] = {"keep_ms": timed(layer, sets, args, grad=True),
                                        "no_grad_ms": timed(layer, sets, args, grad=False)}  # fmt: skip
            bench_moe._release_memory()
        runtime.mok_config = dataclasses.replace(default, cuda_forward="stage1")
        case["stage1"] = {"keep_ms": timed(layer, sets, args, grad=True),
                          "no_grad_ms": timed(layer, sets, args, grad=False)}  # fmt: skip
        runtime.mok_config = default
        record["cases"].append(case)
        del base, layer, sets
        bench_moe._release_memory()
        mk = case["megakernel"]
        print(f"{name}: baseline {case['baseline_fwd_ms']:.3f} ms; stage 1 keep "
              f"{case['stage1']['keep_ms']:.3f} / no_grad {case['stage1']['no_grad_ms']:.3f}; "
              + "; ".join(f"megakernel comm={c}: keep {v['keep_ms']:.3f} / no_grad "
                          f"{v['no_grad_ms']:.3f}" for c, v in mk.items()), flush=True)  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
