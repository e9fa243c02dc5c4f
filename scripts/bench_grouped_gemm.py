#!/usr/bin/env python3
"""Micro-benchmark of the grouped-GEMM engine (torch.ops.mok.grouped_gemm_*) against
torch._grouped_mm on the same inputs, one GPU.

Shapes: the three benchmark models at the row count of 8192 tokens per rank at EP 2 (rows = 8192 *
top-k, over E/2 local experts, balanced random routing; --ep 1: over all E experts, the layer
bench's EP-1 problem) and a quarter of it. Ops:

  l1      ours: x @ w_gu^T with SwiGLU fused (act only; and +h saved for the backward)
          torch: _grouped_mm(x, [W_gate; W_up]^T) and then a separate SwiGLU (timed apart, too)
  l2      act @ W_down^T
  l2_dgrad  ours: d_y @ W_down with the SwiGLU backward fused; torch: _grouped_mm + the
          SwiGLU backward in bf16 torch ops
  l1_dgrad  d_h @ [W_gate; W_up]
  wgrad_l1 / wgrad_l2  d_h^T @ x / d_y^T @ act per expert (torch: _grouped_mm with K offsets);
          ours cooperative, pingpong and cooperative_cluster2 (mok_cluster2: two CTAs share B)
  wgrad_l1_acc / wgrad_l2_acc  the same into an fp32 buffer (Megatron's main_grad): ours adds in
          the epilogue (grouped_gemm_tn_accumulate, cooperative, pingpong and
          cooperative_cluster2; store 'auto', and
          mok_load / mok_reduce: the tile read back, or reduce-added by TMA); torch:
          _grouped_mm, then the add (the backend's fallback). Every call adds into the buffer.

Writes JSON (GPU, driver, torch, commit, per (shape, op, impl): ms median + spread, TFLOP/s).
  python scripts/bench_grouped_gemm.py --out $OUT/bench_grouped_gemm.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mok_megatron.ops import grouped_gemm as gg  # noqa: E402
from mok_megatron.ops import moe  # noqa: E402
from mok_megatron.testing.records import commit  # noqa: E402

MODELS = {  # name: (hidden, intermediate, experts, topk)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}
TOKENS_PER_RANK = 8192
PINGPONG_LESS = ("l1_swiglu", "l2_dgrad_dswiglu")  # the SwiGLU epilogues are cooperative-only
SWEEP = [  # tile-order / schedule settings (gg.GemmTuning) tried by --sweep (full rows only)
    gg.GemmTuning(sch, r, sw)
    for sch in ("cooperative", "pingpong") for r in ("m", "n") for sw in (1, 4)
]  # fmt: skip


def driver() -> str:
    try:
        out = subprocess.check_output(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], text=True
        )
        return out.splitlines()[0].strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def time_ms(fn, *, samples: int, calls: int, warmup: int = 3) -> dict:
    """Per-call ms: `samples` CUDA-event samples of `calls` back-to-back calls each."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / calls)
    out.sort()
    return {
        "median_ms": statistics.median(out), "min_ms": out[0], "max_ms": out[-1],
        "p10_ms": out[len(out) // 10], "p90_ms": out[(9 * len(out)) // 10], "samples": len(out),
    }  # fmt: skip


def swiglu_backward(d_act, gate, up):
    s = torch.sigmoid(gate)
    return torch.cat([d_act * up * s * (1 + gate * (1 - s)), d_act * gate * s], dim=1)


def torch_wgrad(a, b, offs):
    return torch._grouped_mm(a.t(), b, offs=offs)


def bench_shape(model: str, scale: float, args, *, mok_only=False, tuning=None) -> list[dict]:
    """Rows of every op x impl on one shape; ``tuning`` (gg.GemmTuning, None: the default) is
    the tile order ours run in, recorded in each row as its fields."""
    hidden, inter, experts, topk = MODELS[model]
    groups = experts // args.ep
    rows = int(TOKENS_PER_RANK * topk * scale)
    gen = torch.Generator().manual_seed(rows + groups)
    counts = torch.bincount(torch.randint(0, groups, (rows,), generator=gen), minlength=groups)
    offs = counts.cumsum(0).to(torch.int32).cuda()
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, hidden, **bf)
    w_gate = torch.randn(groups, inter, hidden, **bf) / hidden**0.5
    w_up = torch.randn(groups, inter, hidden, **bf) / hidden**0.5
    w_down = torch.randn(groups, hidden, inter, **bf) / inter**0.5
    w_gu = gg.interleave_gate_up(w_gate, w_up)
    w_cat = torch.cat([w_gate, w_up], 1)  # torch's layout: [gate; up]
    del w_gate, w_up
    act = torch.randn(rows, inter, **bf)
    h_cat = torch.randn(rows, 2 * inter, **bf)
    d_y = torch.randn(rows, hidden, **bf)
    _, h = gg.grouped_gemm_l1_swiglu(x, w_gu, offs, save_h=True)
    t = tuning
    gate_t, up_t = h_cat[:, :inter], h_cat[:, inter:]
    # The fp32 buffers of the _acc ops, only where one runs (deepseek-v3 at EP 1: 30 and 15 GB).
    acc_l1 = acc_l2 = None
    if not args.ops or "wgrad_l1_acc" in args.ops:
        acc_l1 = torch.randn(groups, 2 * inter, hidden, device="cuda")
    if not args.ops or "wgrad_l2_acc" in args.ops:
        acc_l2 = torch.randn(groups, hidden, inter, device="cuda")
    pingpong = gg.GemmTuning("pingpong")
    cluster2 = gg.GemmTuning("cooperative_cluster2")

    def wgrad_impls(a, b):  # out[g] = a_g^T @ b_g
        return {
            "mok": lambda: gg.grouped_gemm_tn(a, b, offs, tuning=t),
            "mok_pingpong": lambda: gg.grouped_gemm_tn(a, b, offs, tuning=pingpong),
            "mok_cluster2": lambda: gg.grouped_gemm_tn(a, b, offs, tuning=cluster2),
            "torch_gemm": lambda: torch_wgrad(a, b, offs),
        }

    def wgrad_acc_impls(a, b, acc):  # acc[g] += a_g^T @ b_g, fp32
        def ours(tuning, store="auto"):
            return lambda: gg.grouped_gemm_tn_accumulate(a, b, offs, acc, tuning=tuning,
                                                         store=store)  # fmt: skip

        return {
            "mok": ours(t),
            "mok_pingpong": ours(pingpong),
            "mok_cluster2": ours(cluster2),
            "mok_load": ours(t, "load"),
            "mok_reduce": ours(t, "reduce"),
            "torch_gemm+add": lambda: acc.add_(torch_wgrad(a, b, offs)),
        }

    l1_flops = 2.0 * rows * hidden * 2 * inter
    l2_flops = 2.0 * rows * hidden * inter
    ops = {  # op: (flops, {impl: fn})
        "l1_swiglu": (l1_flops, {
            "mok": lambda: gg.grouped_gemm_l1_swiglu(x, w_gu, offs, tuning=t),
            "mok_save_h": lambda: gg.grouped_gemm_l1_swiglu(x, w_gu, offs, save_h=True, tuning=t),
            "torch_gemm": lambda: torch._grouped_mm(x, w_cat.transpose(1, 2), offs=offs),
            "torch_swiglu_only": lambda: F.silu(gate_t) * up_t,
            "torch_gemm+swiglu": lambda: (lambda hh: F.silu(hh[:, :inter]) * hh[:, inter:])(
                torch._grouped_mm(x, w_cat.transpose(1, 2), offs=offs)),
            # the CUDA backend's torch path: one GEMM on the interleaved weight (h kept) and
            # MoK's interleaved SwiGLU kernel
            "torch_gemm+mok_swiglu": lambda: moe.moe_swiglu_interleaved(
                torch._grouped_mm(x, w_gu.transpose(1, 2), offs=offs)),
        }),
        "l2": (l2_flops, {
            "mok": lambda: gg.grouped_gemm_nt(act, w_down, offs, tuning=t),
            "torch_gemm": lambda: torch._grouped_mm(act, w_down.transpose(1, 2), offs=offs),
        }),
        "l2_dgrad_dswiglu": (l2_flops, {
            "mok": lambda: gg.grouped_gemm_dswiglu(d_y, w_down, h, offs, tuning=t),
            "mok_with_act": lambda: gg.grouped_gemm_dswiglu(d_y, w_down, h, offs, want_act=True,
                                                            tuning=t),
            "torch_gemm": lambda: torch._grouped_mm(d_y, w_down, offs=offs),
            "torch_gemm+dswiglu": lambda: swiglu_backward(
                torch._grouped_mm(d_y, w_down, offs=offs), gate_t, up_t),
            "torch_gemm+mok_dswiglu": lambda: moe.moe_swiglu_interleaved_backward(
                torch._grouped_mm(d_y, w_down, offs=offs), h),
        }),
        "l1_dgrad": (l1_flops, {
            "mok": lambda: gg.grouped_gemm_nn(h_cat, w_gu, offs, tuning=t),
            "torch_gemm": lambda: torch._grouped_mm(h_cat, w_cat, offs=offs),
        }),
        "wgrad_l1": (l1_flops, wgrad_impls(h_cat, x)),
        "wgrad_l2": (l2_flops, wgrad_impls(d_y, act)),
        "wgrad_l1_acc": (l1_flops, wgrad_acc_impls(h_cat, x, acc_l1)),
        "wgrad_l2_acc": (l2_flops, wgrad_acc_impls(d_y, act, acc_l2)),
    }  # fmt: skip
    results = []
    for op, (flops, impls) in ops.items():
        if args.ops and op not in args.ops:
            continue
        for impl, fn in impls.items():
            if mok_only and not impl.startswith("mok"):
                continue
            if args.impls and impl not in args.impls:
                continue
            if tuning and tuning.schedule == "pingpong" and op in PINGPONG_LESS:
                continue  # the op would refuse it
            if tuning and impl in ("mok_pingpong", "mok_cluster2"):
                continue  # its schedule is its own: the sweep's "mok" rows cover it
            row = {"tuning": dataclasses.asdict(tuning)} if tuning else {}
            row |= {"model": model, "scale": scale, "rows": rows, "groups": groups,
                   "hidden": hidden, "intermediate": inter, "op": op, "impl": impl}  # fmt: skip
            try:
                # NOTE: not `t`, the tuning the impls' lambdas read when they are called
                timing = time_ms(fn, samples=args.samples, calls=args.calls)
                row.update(timing)
                if impl != "torch_swiglu_only":
                    row["tflops"] = flops / (timing["median_ms"] * 1e-3) / 1e12
            except Exception as exc:  # noqa: BLE001 - record and go on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="docs/results/bench_grouped_gemm.json")
    p.add_argument("--models", nargs="*", default=list(MODELS))
    p.add_argument("--scales", nargs="*", type=float, default=[1.0, 0.25])
    p.add_argument("--ops", nargs="*", default=None)
    p.add_argument("--impls", nargs="*", default=None, help="only these impls (default: all)")
    p.add_argument(
        "--ep",
        type=int,
        default=2,
        help="E / EP experts get one rank's rows (1: the layer bench's EP-1 problem)",
    )
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--sweep", action="store_true", help="also time ours under each SWEEP setting")
    args = p.parse_args()
    props = torch.cuda.get_device_properties(0)
    results = []
    t0 = time.time()
    for model in args.models:
        for scale in args.scales:
            results += bench_shape(model, scale, args)
            torch.cuda.empty_cache()
    sweep = []
    if args.sweep:
        for tuning in SWEEP:
            for model in args.models:
                sweep += bench_shape(model, 1.0, args, mok_only=True, tuning=tuning)
                torch.cuda.empty_cache()
    doc = {
        "bench": "grouped_gemm", "gpu": props.name, "sm_count": props.multi_processor_count,
        "driver": driver(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "commit": commit(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tokens_per_rank": TOKENS_PER_RANK, "ep": args.ep, "routing": "balanced random",
        "timing": f"median of {args.samples} CUDA-event samples of {args.calls} calls each",
        "tuning_default": dataclasses.asdict(gg.GemmTuning()),  # what "results" ran under
        "wall_s": round(time.time() - t0, 1), "results": results, "sweep": sweep,
    }  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
