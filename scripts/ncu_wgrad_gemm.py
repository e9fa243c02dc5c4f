#!/usr/bin/env python3
"""Nsight Compute's view of one weight-gradient GEMM launch (issue 14): runs
scripts/bench_grouped_gemm.py's problem for one model at EP 1 (its rows, groups and operands)
under ``ncu``, the op and impl named, and profiles one launch of the CUTLASS kernel after the
warm-up ones; writes a JSON record of what ncu read, as scripts/ncu_megakernel.py does for the
megakernel (details page, stall reasons, hot SASS instructions; the raw pages beside it).

The op that matters is ``wgrad_l1_acc`` (the gate/up weight gradient added into fp32
``main_grad`` by the epilogue, Megatron's gradient-accumulation fusion); ``wgrad_l1`` (the
plain bf16 output) beside it separates the epilogue's C traffic from the mainloop.

  python3 scripts/ncu_wgrad_gemm.py --model qwen3-30b-a3b --op wgrad_l1_acc \\
      --out docs/results/ncu_wgrad_gemm_<gpu>_<commit>_qwen3_l1_acc.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ncu_megakernel as nm  # noqa: E402

#: The CUTLASS kernel (the grouped problem builder has its own name).
KERNEL_REGEX = "regex:device_kernel"
#: bench_grouped_gemm's time_ms: 3 warm-up calls, then one sample of one call.
WARMUP_LAUNCHES = 3
OPS = ("wgrad_l1", "wgrad_l2", "wgrad_l1_acc", "wgrad_l2_acc")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--op", default="wgrad_l1_acc", choices=OPS)
    p.add_argument("--impl", default="mok", choices=("mok", "mok_pingpong"))
    p.add_argument("--top", type=int, default=60, help="hot instructions kept")
    p.add_argument("--out", required=True, help="the record (JSON) to write")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    ncu = nm.ncu_binary()
    rep = os.path.splitext(os.path.abspath(args.out))[0]
    os.makedirs(os.path.dirname(rep), exist_ok=True)
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_grouped_gemm.py")
    cmd = [ncu, "--clock-control", "none", "-k", KERNEL_REGEX,
           "--launch-skip", str(WARMUP_LAUNCHES), "--launch-count", "1",
           *[a for s in nm.SECTIONS for a in ("--section", s)], "-f", "-o", rep,
           sys.executable, bench, "--ep", "1", "--models", args.model, "--scales", "1.0",
           "--ops", args.op, "--impls", args.impl, "--samples", "1", "--calls", "1",
           "--out", rep + "_timing.json"]  # fmt: skip
    nm.write_gemm_record("ncu_wgrad_gemm", ncu, cmd, rep, args,
                         ("GPU Speed Of Light Throughput", "Memory Workload Analysis",
                          "Occupancy", "Launch Statistics"))  # fmt: skip


if __name__ == "__main__":
    main()
