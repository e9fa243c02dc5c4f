#!/usr/bin/env python3
"""Nsight Compute's view of one blockwise-FP8 grouped GEMM launch (issue 15): runs
scripts/bench_fp8_gemm.py's problem for one model (its rows, routing and weights) under ``ncu``,
profiles one launch of the L1 (SwiGLU epilogue) or the L2 (nt) GEMM kernel after the warm-up
ones, and writes a JSON record of what ncu read, as scripts/ncu_megakernel.py does for the
megakernel (details page, stall reasons, hot SASS instructions; the raw pages beside it).

  python3 scripts/ncu_fp8_gemm.py --model deepseek-v3 --op l1 --out docs/results/ncu_<...>.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ncu_megakernel as nm  # noqa: E402

#: The CUTLASS kernel (the problem builder and the act quantiser have their own names).
KERNEL_REGEX = "regex:device_kernel"
WARMUP_LAUNCHES = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="deepseek-v3")
    p.add_argument("--op", default="l1", choices=("l1", "l2"))
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--top", type=int, default=60, help="hot instructions kept")
    p.add_argument("--out", help="the record (JSON) to write")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args) -> None:
    import bench_fp8_gemm as bf
    import torch

    p = bf.problem(args.model, 1, args.tokens)
    _, impls = bf.ops_of(p)[args.op]
    for _ in range(WARMUP_LAUNCHES + 1):
        impls["fp8_mok"]()
    torch.cuda.synchronize()
    print(f"[ncu_fp8_gemm] child ran {WARMUP_LAUNCHES + 1} {args.op} calls", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    if not args.out:
        raise SystemExit("--out is required")
    ncu = nm.ncu_binary()
    rep = os.path.splitext(os.path.abspath(args.out))[0]
    os.makedirs(os.path.dirname(rep), exist_ok=True)
    cmd = [ncu, "--clock-control", "none", "-k", KERNEL_REGEX,
           "--launch-skip", str(WARMUP_LAUNCHES), "--launch-count", "1",
           *[a for s in nm.SECTIONS for a in ("--section", s)], "-f", "-o", rep,
           sys.executable, os.path.abspath(__file__), "--child", "--model", args.model,
           "--op", args.op, "--tokens", str(args.tokens)]  # fmt: skip
    nm.write_gemm_record("ncu_fp8_gemm", ncu, cmd, rep, args,
                         ("GPU Speed Of Light Throughput", "Memory Workload Analysis",
                          "Compute Workload Analysis"))  # fmt: skip


if __name__ == "__main__":
    main()
