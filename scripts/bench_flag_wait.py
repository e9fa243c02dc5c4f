#!/usr/bin/env python3
"""Cost of the grouped GEMM's per-tile flag wait when every flag is already set: the plain op
against its ``*_wait`` twin (``grouped_gemm_nt`` / ``grouped_gemm_l1_swiglu``), one GPU.

Rounds alternate plain / wait so clock drift hits both alike; each round is the median of 10
CUDA-event samples of 5 calls; printed: medians over 9 rounds and the per-round wait/plain ratio
(median, 2nd-lowest, 2nd-highest). docs/GEMM.md ("Per-tile flag wait") has the numbers.
  python scripts/bench_flag_wait.py
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

from mok_megatron.ops import grouped_gemm as gg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_grouped_gemm import time_ms  # noqa: E402  (a sibling script, not a package)

SHAPES = {  # name: (hidden, intermediate, local experts, rows, rows_per_flag values)
    "qwen3-30b-a3b": (2048, 768, 64, 65536, (128, 1)),
    "deepseek-v3": (7168, 2048, 128, 16384, (128,)),
    "mixtral-8x7b": (4096, 14336, 4, 16384, (128,)),
}


def sample(fn, n=10, calls=5) -> float:
    """Median per-call ms of n CUDA-event samples of `calls` calls (no warm-up: compare does it)."""
    return time_ms(fn, samples=n, calls=calls, warmup=0)["median_ms"]


def compare(plain, wait, rounds=9):
    for _ in range(3):
        plain()
        wait()
    torch.cuda.synchronize()
    t_plain, t_wait = [], []
    for _ in range(rounds):
        t_plain.append(sample(plain))
        t_wait.append(sample(wait))
    ratios = sorted(w / p for p, w in zip(t_plain, t_wait))
    return (statistics.median(t_plain), statistics.median(t_wait), ratios[len(ratios) // 2],
            ratios[1], ratios[-2])  # fmt: skip


def report(name, rows, rpf, a, x, w_gu, w_down, offs) -> None:
    ready = torch.full((-(-rows // rpf),), 1, dtype=torch.int32, device="cuda")
    ops = [
        ("nt", lambda: gg.grouped_gemm_nt(a, w_down, offs),
         lambda: gg.grouped_gemm_nt_wait(a, w_down, offs, ready, rpf, 1)),
        ("l1_swiglu", lambda: gg.grouped_gemm_l1_swiglu(x, w_gu, offs),
         lambda: gg.grouped_gemm_l1_swiglu_wait(x, w_gu, offs, ready, rpf, 1)),
    ]  # fmt: skip
    for op, plain, wait in ops:
        t_plain, t_wait, ratio, low, high = compare(plain, wait)
        print(f"{name:14s} rows={rows} {op:10s} rows_per_flag={rpf:4d}  plain {t_plain:.3f} ms  "
              f"wait {t_wait:.3f} ms  ratio median {ratio:.3f} (2nd-lowest {low:.3f}, "
              f"2nd-highest {high:.3f})", flush=True)  # fmt: skip


def main() -> None:
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for name, (hidden, inter, groups, rows, rows_per_flags) in SHAPES.items():
        torch.manual_seed(0)
        counts = torch.bincount(torch.randint(0, groups, (rows,)), minlength=groups)
        offs = counts.cumsum(0).to(torch.int32).cuda()
        x, a = torch.randn(rows, hidden, **bf), torch.randn(rows, inter, **bf)
        w_gu = torch.randn(groups, 2 * inter, hidden, **bf) / hidden**0.5
        w_down = torch.randn(groups, hidden, inter, **bf) / inter**0.5
        gg.default_flag_wait_error()
        for rpf in rows_per_flags:
            report(name, rows, rpf, a, x, w_gu, w_down, offs)


if __name__ == "__main__":
    main()
