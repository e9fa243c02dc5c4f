#!/usr/bin/env python3
"""Benchmark of the blockwise-FP8 grouped GEMMs (issue 15) against the BF16 engine and torch's
BF16 grouped GEMM, same process, same GPU, same routing, one GPU.

Shapes: the three benchmark models at EP ``--ep`` (default 1) and ``--tokens`` per rank (default
8192): rows = tokens * top-k over E / EP local experts, uniform random routing. Ops and impls:

  l1   bf16_mok: the BF16 L1 with SwiGLU fused (act); bf16_torch: torch._grouped_mm (h only);
       fp8_mok: the FP8 L1 with SwiGLU and act's FP8 quantisation fused (act_q);
       fp8_mok_save_h: the same, also writing h (bf16) for the backward
  l2   bf16_mok, bf16_torch, fp8_mok (cooperative 128x256 tile), fp8_mok_pingpong (128x128)
  quantize_x   ops.fp8_blockwise_quantize of the layer input, (1, 128) blocks (not a GEMM)
  with --dense-ceiling, l1 and l2 also: dense_bf16_torch (torch.mm) and dense_fp8_torch
       (torch._scaled_mm, one float32 scale per tensor) of the same rows x K x N, no groups:
       what a dense GEMM of the same FLOPs reaches here, now, at the clock the power cap
       leaves (an upper bound for the grouped, blockwise-scaled GEMM of the same precision)

Each row also has the SM clock and power sampled while it was timed (``gpu_during``,
testing.gpu_clocks).

Each row: median and spread of per-call milliseconds (CUDA events), TFLOP/s at the median.
  python scripts/bench_fp8_gemm.py --out $OUT/bench_fp8_gemm.json
  python scripts/bench_fp8_gemm.py --render docs/results/bench_fp8_gemm_<gpu>_<commit>.json \
      --md docs/FP8.md          (the table in docs/FP8.md, from a record)
  python scripts/bench_fp8_gemm.py --render docs/results/bench_fp8_gemm_ceiling_h200_4cad4e2.json \
      --md docs/FP8.md --table "bench_fp8_gemm ceiling table"   (the dense-ceiling table)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mok_megatron.ops import fp8_blockwise as fb  # noqa: E402
from mok_megatron.ops import grouped_gemm as gg  # noqa: E402
from mok_megatron.ops import grouped_gemm_fp8 as gf  # noqa: E402
from mok_megatron.testing.gpu_clocks import ClockSampler, cuda_reader  # noqa: E402
from mok_megatron.testing.records import commit, fill_markdown_table  # noqa: E402
from mok_megatron.testing.timing import time_fn  # noqa: E402

MODELS = {  # name: (hidden, intermediate, experts, topk), as scripts/bench_moe.py
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}


def problem(model: str, ep: int, tokens: int) -> dict:
    hidden, inter, experts, topk = MODELS[model]
    groups, rows = experts // ep, tokens * topk
    gen = torch.Generator().manual_seed(rows + groups)
    counts = torch.bincount(torch.randint(0, groups, (rows,), generator=gen), minlength=groups)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    w_gu = torch.randn(groups, 2 * inter, hidden, **bf) / hidden**0.5
    w_down = torch.randn(groups, hidden, inter, **bf) / inter**0.5
    return dict(
        hidden=hidden, inter=inter, groups=groups, rows=rows,
        offs=counts.cumsum(0).to(torch.int32).cuda(),
        x=torch.randn(rows, hidden, **bf), act=torch.randn(rows, inter, **bf) * 0.1,
        w_gu=w_gu, w_down=w_down, w_gu_q=gf.fp8_gemm_weight(w_gu),
        w_down_q=gf.fp8_gemm_weight(w_down),
    )  # fmt: skip


#: The tile orders ``--sweep-tuning`` adds (raster, swizzle); (m, 1) is the default, fp8_mok.
SWEEP = [(r, s) for r in ("m", "n") for s in (1, 2, 4, 8) if (r, s) != ("m", 1)]


def m_tile_fill(offs: torch.Tensor, tile_m: int = 128) -> float:
    """The routed rows over the rows of the 128-row M tiles the grouped GEMM runs (each group's
    last tile is partly empty and costs a full tile's mainloop)."""
    counts = torch.diff(offs.cpu().long(), prepend=torch.zeros(1, dtype=torch.long))
    tiles = (counts + tile_m - 1) // tile_m
    return float(counts.sum()) / float(tiles.sum() * tile_m)


def dense_ceilings(a: torch.Tensor, w: torch.Tensor) -> dict:
    """``--dense-ceiling``'s impls for A [rows, K] (bf16) times one dense weight w [N, K]
    (bf16): torch.mm, and torch._scaled_mm of their e4m3 casts with one scale each (the values
    are N(0, 1)-sized, inside e4m3's range: the rate, not the numbers, is what is measured)."""
    a8 = a.to(torch.float8_e4m3fn)
    w8 = w.to(torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32, device=a.device)
    return {
        "dense_bf16_torch": lambda: torch.mm(a, w.t()),
        "dense_fp8_torch": lambda: torch._scaled_mm(a8, w8.t(), one, one,
                                                    out_dtype=torch.bfloat16),
    }  # fmt: skip


def ops_of(p: dict, sweep: bool = False, dense: bool = False) -> dict:
    """op: (flops, {impl: fn}); ``sweep``: also the FP8 ops at every tile order of SWEEP;
    ``dense``: also the dense GEMMs of the same FLOPs (dense_ceilings)."""
    x, act, offs = p["x"], p["act"], p["offs"]
    x_q = fb.fp8_blockwise_quantize(x, (1, 128))
    act_q = fb.fp8_blockwise_quantize(act, (1, 128))
    w_gu, w_down, w_gu_q, w_down_q = p["w_gu"], p["w_down"], p["w_gu_q"], p["w_down_q"]
    l1_flops = 2.0 * p["rows"] * p["hidden"] * 2 * p["inter"]
    l2_flops = 2.0 * p["rows"] * p["hidden"] * p["inter"]
    pingpong = gg.GemmTuning("pingpong")
    orders = {f"_r{r}_s{z}": gg.GemmTuning("cooperative", r, z) for r, z in SWEEP} if sweep else {}
    l1_sweep = {f"fp8_mok{k}": (lambda t=t: gf.grouped_gemm_fp8_l1_swiglu(x_q, w_gu_q, offs,
                                                                          tuning=t))
                for k, t in orders.items()}  # fmt: skip
    l2_sweep = {f"fp8_mok{k}": (lambda t=t: gf.grouped_gemm_fp8_nt(act_q, w_down_q, offs, t))
                for k, t in orders.items()}  # fmt: skip
    return {
        "l1": (l1_flops, {
            "bf16_mok": lambda: gg.grouped_gemm_l1_swiglu(x, w_gu, offs),
            "bf16_torch": lambda: torch._grouped_mm(x, w_gu.transpose(1, 2), offs=offs),
            "fp8_mok": lambda: gf.grouped_gemm_fp8_l1_swiglu(x_q, w_gu_q, offs),
            "fp8_mok_save_h": lambda: gf.grouped_gemm_fp8_l1_swiglu(x_q, w_gu_q, offs,
                                                                    save_h=True),
            **l1_sweep,
            **(dense_ceilings(x, w_gu[0]) if dense else {}),
        }),
        "l2": (l2_flops, {
            "bf16_mok": lambda: gg.grouped_gemm_nt(act, w_down, offs),
            "bf16_torch": lambda: torch._grouped_mm(act, w_down.transpose(1, 2), offs=offs),
            "fp8_mok": lambda: gf.grouped_gemm_fp8_nt(act_q, w_down_q, offs),
            "fp8_mok_pingpong": lambda: gf.grouped_gemm_fp8_nt(act_q, w_down_q, offs, pingpong),
            **l2_sweep,
            **(dense_ceilings(act, w_down[0]) if dense else {}),
        }),
        "quantize_x": (0.0, {"fp8_mok": lambda: fb.fp8_blockwise_quantize(x, (1, 128))}),
    }  # fmt: skip


#: FP8 L1 target of issue 15 (deepseek-v3's EP-1 rows at 8192 tokens per rank), TFLOP/s.
L1_TARGET_TFLOPS = 1100.0


def table_markers(name: str) -> tuple[str, str]:
    """The comments a generated table sits between in its markdown page."""
    return f"<!-- {name} begin -->", f"<!-- {name} end -->"


TABLE_NAME = "bench_fp8_gemm table"  # --table's default: the GEMM table of docs/FP8.md
TABLE_BEGIN, TABLE_END = table_markers(TABLE_NAME)
LAYER_NAME = "fp8_layer table"
LAYER_BEGIN, LAYER_END = table_markers(LAYER_NAME)
#: Layer targets of issue 15 (deepseek-v3, EP 1, 8192 tokens per rank): FP8 over MoK's BF16.
LAYER_TARGETS = {"fwd": 1.5, "fwd_bwd": 1.3}


def render(record: dict) -> str:
    """The markdown table of a record: per (model, op) each impl's ms and TFLOP/s, and the FP8
    speedup over our BF16 op."""
    cfg = record["config"]
    lines = [
        f"Record: {record['gpu']}, torch {record['torch']}, commit `{record['commit'][:7]}`, "
        f"EP {cfg['ep']}, {cfg['tokens']} tokens per rank, {cfg['routing']} routing, median of "
        f"{cfg['iters']} calls [p10, p90].",
        "",
        "| model | op | impl | rows / groups | ms | TFLOP/s | vs bf16_mok | SM MHz |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = {
        (r["model"], r["op"]): r["median_ms"] for r in record["rows"] if r["impl"] == "bf16_mok"
    }
    for r in record["rows"]:
        rate = f"{r['tflops']:.0f}" if r["tflops"] else "-"
        ref = base.get((r["model"], r["op"]))
        speedup = f"{ref / r['median_ms']:.2f}x" if ref else "-"
        during = r.get("gpu_during")  # older records: none
        clock = f"{during['sm_mhz_median']:.0f}" if during else "-"
        groups = "dense" if r["impl"].startswith("dense_") else r["groups"]  # --dense-ceiling
        lines.append(
            f"| {r['model']} | {r['op']} | {r['impl']} | {r['rows']} / {groups} | "
            f"{r['median_ms']:.3f} [{r['p10_ms']:.3f}, {r['p90_ms']:.3f}] | {rate} | {speedup} "
            f"| {clock} |"
        )
    return "\n".join(lines)


def render_layer(record: dict) -> str:
    """The layer table of a ``bench_moe.py --mok-fp8`` record: per case and pass, the baseline,
    MoK (BF16 experts, its forward path: stage 1 or the BF16 megakernel, as the record's
    ``--mok-cuda-forward`` made it) and MoK with FP8 experts, and the FP8 speedup over MoK; in
    forward + backward also FP8 with FP8 data gradients (``mok_fp8_dgrad``), and the FP8
    megakernel's forward (``mok_fp8_mega``, ``bench_moe.py --mok-fp8-mega``), where the record has
    them. The record line names the bench's flags that chose the contenders (from its args)."""
    env = record["environment"]
    args = record.get("args", {})
    has_mega = any(
        "mok_fp8_mega" in c.get(p, {}) for c in record["cases"] for p in ("fwd", "fwd_bwd")
    )
    flags = " --mok-fp8" if args.get("mok_fp8") else ""
    if args.get("mok_cuda_forward"):
        flags += f" --mok-cuda-forward {args['mok_cuda_forward']}"
    flags += " --mok-stage1" if args.get("mok_stage1") else ""
    flags += " --mok-fp8-mega" if has_mega else ""
    flags += " --mok-graph" if args.get("mok_graph") else ""
    lines = [
        f"Record: {env['gpu']}, torch {env['torch']}, commit `{env['commit'][:7]}`, EP "
        f"{env['world_size']} (`scripts/bench_moe.py{flags}`): median ms "
        "of the Megatron MoE layer, the alltoall + grouped-GEMM baseline and MoK in the same "
        "process.",
        "",
        "| model | tokens | pass | baseline | MoK BF16 | its forward | MoK FP8 | FP8 over BF16 | "
        "target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case in record["cases"]:
        routing = case.get("routing", "uniform")
        tokens = case["tokens_per_rank"] if routing == "uniform" else (
            f"{case['tokens_per_rank']} ({routing})"
        )  # fmt: skip
        for label in ("fwd", "fwd_bwd"):
            if label not in case:
                continue
            r = case[label]
            ms = {who: r[who]["median_ms_all_ranks_max"] for who in ("baseline", "mok")}
            target = LAYER_TARGETS[label] if case["shape"] == "deepseek-v3" else None
            target = f"{target:.1f}x" if target else "-"
            # The BF16 layer's forward path: the record's cuda_forward for MoK ("auto": stage 1)
            bf16_path = case.get("mok_backend", "?").removeprefix("cuda/")
            # (row label, FP8 contender, its speedup key): stage 1's FP8 first, then the others
            # the record has
            for suffix, who, speedup in (("", "mok_fp8", "fp8_speedup"),
                                         (" (FP8 megakernel)", "mok_fp8_mega", "fp8_mega_speedup"),
                                         (" (FP8 dgrads)", "mok_fp8_dgrad", "fp8_dgrad_speedup"),
                                         (" (FP8 megakernel, FP8 dgrads)", "mok_fp8_mega_dgrad",
                                          "fp8_mega_dgrad_speedup")):  # fmt: skip
                if who not in r:
                    continue
                lines.append(
                    f"| {case['shape']} | {tokens} | {label}{suffix} | {ms['baseline']:.2f} | "
                    f"{ms['mok']:.2f} | {bf16_path} | {r[who]['median_ms_all_ranks_max']:.2f} | "
                    f"{r[speedup]:.2f}x | {target} |"
                )
            if "mok_fp8_mega_graph" in r:  # both replayed from CUDA graphs: no host time
                lines.append(
                    f"| {case['shape']} | {tokens} | {label} replayed (FP8 megakernel) | - | "
                    f"{r['mok_graph']['median_ms_all_ranks_max']:.2f} | {bf16_path}, replayed | "
                    f"{r['mok_fp8_mega_graph']['median_ms_all_ranks_max']:.2f} | "
                    f"{r['fp8_mega_graph_speedup']:.2f}x | {target} |"
                )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--render", help="a record to render into --md instead of benchmarking")
    ap.add_argument("--render-layer", help="a bench_moe.py --mok-fp8 record to render into --md")
    ap.add_argument("--md", help="with --render: the markdown file whose table to replace")
    ap.add_argument(
        "--table",
        default=None,
        help="with --render / --render-layer and --md: the table's markers' name ('<!-- NAME "
        f"begin -->'; default '{TABLE_NAME}' / '{LAYER_NAME}'), for a page with more than one",
    )
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--sweep-tuning",
        action="store_true",
        help="also time the FP8 ops at every raster / swizzle (GemmTuning)",
    )
    ap.add_argument(
        "--dense-ceiling",
        action="store_true",
        help="also time dense bf16 and FP8 GEMMs of each op's rows x K x N (torch.mm, "
        "torch._scaled_mm): the rate a dense GEMM of the same FLOPs reaches at this clock",
    )
    args = ap.parse_args()
    if args.render or args.render_layer:
        with open(args.render or args.render_layer) as f:
            record = json.load(f)
        table = render(record) if args.render else render_layer(record)
        markers = table_markers(args.table or (TABLE_NAME if args.render else LAYER_NAME))
        if args.md:
            fill_markdown_table(args.md, table, *markers)
        else:
            print(table)
        return
    if not args.out:
        ap.error("--out is required to benchmark")
    rows = []
    for model in args.models.split(","):
        p = problem(model, args.ep, args.tokens)
        fill = m_tile_fill(p["offs"])
        print(f"{model}: the 128-row M tiles hold {fill:.3f} routed rows per tile row", flush=True)
        for op, (flops, impls) in ops_of(p, args.sweep_tuning, args.dense_ceiling).items():
            for impl, fn in impls.items():
                with ClockSampler(cuda_reader()) as clocks:
                    t = time_fn(lambda i, fn=fn: fn(), warmup=3, iters=args.iters, device="cuda")
                tflops = flops / (t.median_ms * 1e-3) / 1e12 if flops else None
                rows.append(dict(model=model, op=op, impl=impl, rows=p["rows"],
                                 groups=p["groups"], m_tile_fill=fill, tflops=tflops,
                                 gpu_during=clocks.summary(), **t.as_dict()))  # fmt: skip
                rate = f"{tflops:7.1f} TFLOP/s" if tflops else ""
                print(f"{model:14s} {op:10s} {impl:18s} {t.median_ms:8.3f} ms "
                      f"[{t.p10_ms:.3f}, {t.p90_ms:.3f}] {rate}", flush=True)  # fmt: skip
        del p
        torch.cuda.empty_cache()
    record = dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
        commit=commit(), config=dict(ep=args.ep, tokens=args.tokens, iters=args.iters,
                                     routing="uniform random"),
        rows=rows,
    )  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
