#!/usr/bin/env python3
"""FP8 weight gradients, studied on the CPU before building them (issue 15, item 2: "weight
gradients in FP8 where the accuracy tests allow, else BF16 (say which and why)").

The DeepSeek-V3 recipe runs the weight gradients in FP8 too: ``dW[e] = A_e^T B_e`` reduces over
an expert's rows, so both operands are quantised in (128, 1) blocks, 128 rows of one column,
each block within one expert's rows (a block never spans two experts). Two questions, answered
without a GPU:

1. **Accuracy**: the reference backend's FP8 emulation (``expert_precision="fp8_blockwise"``,
   ``fp8_backward="dgrad"``) with its weight gradients' operands also through FP8 that way
   (rounded to bf16, as the CUDA backward holds them, then quantised and dequantised exactly),
   against the dense float64 layer (``testing.run_oracle``) and against the same run with BF16
   weight gradients; and the FP8 weight gradients alone on BF16 experts. The scaled-down
   benchmark shapes, with as many rows per expert as each full shape has at 8192 tokens per
   rank (qwen3-30b-a3b 512, deepseek-v3 256, mixtral-8x7b 2048).
2. **Time, in the floor model** (``testing.timing``'s ceilings): each weight-gradient GEMM at
   the longer of its FLOPs at the tensor cores' rate (FP8: twice BF16's 782 TFLOP/s, the
   Hopper ratio, not a measurement) and its HBM bytes at 4.28 TB/s: its row operands, and its
   output, bf16 ``.grad`` (the bench's default) or fp32 ``main_grad`` read and written
   (``--main-grad``); for FP8 also the (128, 1) quantisation passes over the four operands
   (x rows, d_h, the weighted d_out rows, act: bf16 read, e4m3 and scales written), which an
   implementation could fuse into the kernels that make them (the bound without them). The full
   benchmark shapes at EP 1. A model, not a measurement.

    python3 scripts/fp8_wgrad_study.py --out docs/results/fp8_wgrad_study_cpu_<commit>.json
    python3 scripts/fp8_wgrad_study.py --render docs/results/fp8_wgrad_study_cpu_<commit>.json \\
        --md docs/FP8.md
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe  # noqa: E402

from mok_megatron.testing.records import fill_markdown_table  # noqa: E402
from mok_megatron.testing.timing import H200_CEILINGS, moe_pass_cost  # noqa: E402

GRADS = ("d_w_routed_gate", "d_w_routed_up", "d_w_routed_down")
#: (name, hidden, inter, experts, topk, shared_inter, tokens): tests/gpu/test_fp8_experts_cuda.py's
#: scaled shapes, with the rows per expert of the full shape at 8192 tokens per rank
ACCURACY_SHAPES = [
    ("qwen3-30b-a3b (scaled)", 256, 128, 16, 8, 0, 1024),  # 512 rows per expert
    ("deepseek-v3 (scaled)", 512, 256, 16, 8, 128, 512),  # 256
    ("mixtral-8x7b (scaled)", 512, 512, 8, 2, 0, 8192),  # 2048
]
#: what each run is: (expert_precision, fp8_backward, FP8 weight gradients)
RUNS = {
    "bf16": ("bf16", "bf16", False),
    "bf16_fp8_wgrad": ("bf16", "bf16", True),
    "fp8_dgrad": ("fp8_blockwise", "dgrad", False),
    "fp8_dgrad_wgrad": ("fp8_blockwise", "dgrad", True),
}
#: (run, against): None is the float64 oracle
COMPARISONS = {
    "bf16_vs_float64": ("bf16", None),
    "bf16_fp8_wgrad_vs_float64": ("bf16_fp8_wgrad", None),
    "bf16_fp8_wgrad_vs_bf16": ("bf16_fp8_wgrad", "bf16"),
    "fp8_dgrad_vs_float64": ("fp8_dgrad", None),
    "fp8_dgrad_wgrad_vs_float64": ("fp8_dgrad_wgrad", None),
    "fp8_dgrad_wgrad_vs_fp8_dgrad": ("fp8_dgrad_wgrad", "fp8_dgrad"),
    "fp8_dgrad_wgrad_vs_bf16": ("fp8_dgrad_wgrad", "bf16"),
}
FP8_RATE = 2  # e4m3 wgmma's rate over bf16's on Hopper
E4M3_BYTES, BF16_BYTES, FP32_BYTES = 1, 2, 4
K_BLOCK = 128  # rows per (128, 1) block
TABLE_BEGIN, TABLE_END = "<!-- fp8_wgrad table begin -->", "<!-- fp8_wgrad table end -->"


# ------------------------------------------------------------------------------ accuracy
def fp8_k_blocks(rows):
    """An expert's rows [M, C] as a weight gradient's FP8 operand: rounded to bf16, quantised in
    (128, 1) blocks from the expert's first row (the last block short: zero rows added to fill
    it change no block maximum), dequantised exactly; in ``rows``' dtype."""
    import torch

    from mok_megatron.ops.fp8_blockwise import (
        fp8_blockwise_dequantize_exact,
        fp8_blockwise_quantize_reference,
    )

    m = rows.shape[0]
    padded = torch.nn.functional.pad(rows.to(torch.bfloat16).float(), (0, 0, 0, (-m) % K_BLOCK))
    q = fp8_blockwise_quantize_reference(padded, (K_BLOCK, 1))
    return fp8_blockwise_dequantize_exact(q)[:m].to(rows.dtype)


def fp8_grouped_wgrad(d_rows, in_rows, row_expert, num_experts: int):
    """reference._grouped_wgrad with both operands through ``fp8_k_blocks``, expert by expert
    (an expert's rows in schedule order); an expert without rows gives zeros."""
    import torch

    grads = []
    for e in range(num_experts):
        idx = (row_expert == e).nonzero().squeeze(1)
        grads.append(fp8_k_blocks(d_rows[idx]).T @ fp8_k_blocks(in_rows[idx]))
    return torch.stack(grads)


@contextlib.contextmanager
def fp8_weight_gradients(enabled: bool):
    """The reference backend's weight gradients through FP8 (``fp8_grouped_wgrad``) inside."""
    from mok_megatron.functional import reference

    original = reference._grouped_wgrad
    if enabled:
        reference._grouped_wgrad = fp8_grouped_wgrad
    try:
        yield
    finally:
        reference._grouped_wgrad = original


def layer_grads(problem, config, fp8_wgrad: bool) -> dict:
    """The routed weight gradients of one reference forward + backward on the CPU
    (``testing.runs.run_local``, d_out of seed 1), float64."""
    import torch

    from mok_megatron.testing.runs import run_local

    with fp8_weight_gradients(fp8_wgrad):
        result = run_local(problem, rank=0, dtype=torch.bfloat16, seed=1, config=config)
    return {n: result[n].double() for n in GRADS}


def accuracy(shapes) -> list[dict]:
    import torch

    from mok_megatron import functional as F
    from mok_megatron.testing import random_moe_problem, relative_error
    from mok_megatron.testing.runs import global_d_out, run_oracle

    rows = []
    base = F.MoKConfig(wait_timeout_ms=60_000)
    for name, hidden, inter, experts, topk, shared, tokens in shapes:
        problem = random_moe_problem([tokens], hidden, inter, experts, topk,
                                     shared_inter=shared, seed=11)  # fmt: skip
        oracle = run_oracle(problem, global_d_out(problem, 1).to(torch.bfloat16).double())
        runs = {
            run: layer_grads(problem, dataclasses.replace(
                base, expert_precision=precision, fp8_backward=backward), fp8_wgrad)
            for run, (precision, backward, fp8_wgrad) in RUNS.items()
        }  # fmt: skip
        for comparison, (run, against) in COMPARISONS.items():
            want = oracle if against is None else runs[against]
            errors = {n: relative_error(runs[run][n], want[n]) for n in GRADS}
            rows.append({"shape": name, "tokens": tokens, "rows_per_expert": tokens * topk
                         // experts, "comparison": comparison, **errors})  # fmt: skip
            print(name, comparison, " ".join(f"{n}={e:.2e}" for n, e in errors.items()),
                  flush=True)  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------- time
def gemm_ms(flops: float, hbm_bytes: float, tflops: float) -> float:
    """The floor model's time of one GEMM: the longer of its FLOPs and its HBM bytes."""
    return max(flops / (tflops * 1e12), hbm_bytes / (H200_CEILINGS.hbm_tbps * 1e12)) * 1e3


def wgrad_case(shape_name: str, tokens: int) -> dict:
    """The two weight-gradient GEMMs of one benchmark shape at EP 1 (all experts local), BF16
    and FP8, with either output (see the module's docstring)."""
    hidden, inter, experts, topk = bench_moe.SHAPES[shape_name]
    rows = tokens * topk
    # (FLOPs, row operand elements, output elements): L1's dW_gate_up = d_h^T x, L2's
    # dW_down = (w d_out)^T act
    gemms = {"l1": (2 * rows * 2 * inter * hidden, rows * (2 * inter + hidden),
                    experts * 2 * inter * hidden),
             "l2": (2 * rows * hidden * inter, rows * (hidden + inter), experts * hidden * inter)}  # fmt: skip
    fp8_operand = E4M3_BYTES + FP32_BYTES / K_BLOCK  # e4m3 and one float32 scale per 128
    quant_elems = rows * (hidden + 2 * inter + hidden + inter)  # x, d_h, w d_out, act
    quant_ms = quant_elems * (BF16_BYTES + fp8_operand) / (H200_CEILINGS.hbm_tbps * 1e12) * 1e3
    floor = moe_pass_cost(routed_rows=rows, remote_pairs=0, hidden=hidden, inter=inter,
                          local_experts=experts, backward=True)["floor_ms"]  # fmt: skip
    case = {"shape": shape_name, "tokens_per_rank": tokens, "ep": 1, "rows": rows,
            "rows_per_expert": rows / experts, "fwd_bwd_floor_ms": floor,
            "fp8_quantise_ms": quant_ms}  # fmt: skip
    for output, out_bytes in (("grad", BF16_BYTES), ("main_grad", 2 * FP32_BYTES)):
        bf16 = fp8 = 0.0
        for flops, operand_elems, out_elems in gemms.values():
            bf16 += gemm_ms(flops, operand_elems * BF16_BYTES + out_elems * out_bytes,
                            H200_CEILINGS.bf16_tflops)  # fmt: skip
            fp8 += gemm_ms(flops, operand_elems * fp8_operand + out_elems * out_bytes,
                           FP8_RATE * H200_CEILINGS.bf16_tflops)  # fmt: skip
        case[output] = {"bf16_ms": bf16, "fp8_ms": fp8, "saved_fused_ms": bf16 - fp8,
                        "saved_ms": bf16 - fp8 - quant_ms}  # fmt: skip
    return case


# -------------------------------------------------------------------------------- render
def render(record: dict) -> str:
    env = record["environment"]
    lines = [
        f"From `{Path(record['path']).name}` (commit `{env['commit'][:7]}`), written by "
        "`scripts/fp8_wgrad_study.py` on the CPU. Accuracy: relative Frobenius error of the "
        "routed weight gradients, the reference backend's FP8 emulation (fp8_dgrad: FP8 forward "
        "and data gradients, as built; +wgrad: the weight gradients' operands through FP8 in "
        "(128, 1) blocks too; bf16_fp8_wgrad: BF16 experts with FP8 weight gradients only).",
        "",
        "| shape | tokens | rows/expert | comparison | " + " | ".join(GRADS) + " |",
        "|---|---|---|---|" + "---|" * len(GRADS),
    ]
    for r in record["accuracy"]:
        errors = " | ".join(f"{r[n]:.1e}" for n in GRADS)
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['rows_per_expert']} | "
                     f"{r['comparison']} | {errors} |")  # fmt: skip
    lines += [
        "",
        "Time, in the floor model (full shapes, EP 1; a model, not a measurement): both "
        "weight-gradient GEMMs, BF16 and FP8, with the bf16 `.grad` output or fp32 `main_grad` "
        "read and written; 'saved' is BF16 minus FP8 with the (128, 1) quantisation passes, "
        "'saved, fused' without them; the forward + backward floor for scale.",
        "",
        "| shape | tokens/rank | rows/expert | fwd+bwd floor ms | output | BF16 wgrad ms | "
        "FP8 wgrad ms | quantise ms | saved ms | saved, fused ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in record["cases"]:
        for output in ("grad", "main_grad"):
            o = c[output]
            lines.append(
                f"| {c['shape']} | {c['tokens_per_rank']} | {c['rows_per_expert']:.0f} | "
                f"{c['fwd_bwd_floor_ms']:.2f} | {'.grad' if output == 'grad' else output} | "
                f"{o['bf16_ms']:.2f} | {o['fp8_ms']:.2f} | {c['fp8_quantise_ms']:.2f} | "
                f"{o['saved_ms']:.2f} | {o['saved_fused_ms']:.2f} |"
            )
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="measure and write the JSON record here")
    p.add_argument("--shapes", default=",".join(bench_moe.SHAPES), help="the time model's shapes")
    p.add_argument("--tokens", default="8192,16384", help="the time model's tokens per rank")
    p.add_argument("--no-accuracy", action="store_true", help="the time model only")
    p.add_argument("--render", help="a record to tabulate (stdout, or into --md)")
    p.add_argument("--md", help="the markdown file whose fp8_wgrad table is replaced")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.render:
        record = json.loads(Path(args.render).read_text())
        table = render({**record, "path": args.render})
        if args.md:
            fill_markdown_table(args.md, table, TABLE_BEGIN, TABLE_END)
        else:
            print(table)
        return
    if not args.out:
        raise SystemExit("give --out (measure) or --render (tabulate a record)")
    cases = [wgrad_case(s, int(t)) for s in args.shapes.split(",") for t in args.tokens.split(",")]
    for c in cases:
        print(f"{c['shape']} T={c['tokens_per_rank']}: " + "; ".join(
            f"{o}: BF16 {c[o]['bf16_ms']:.2f} ms, FP8 {c[o]['fp8_ms']:.2f} ms, saved "
            f"{c[o]['saved_ms']:.2f} ({c[o]['saved_fused_ms']:.2f} fused)"
            for o in ("grad", "main_grad")))  # fmt: skip
    rows = [] if args.no_accuracy else accuracy(ACCURACY_SHAPES)
    bench_moe.write_model_record("fp8_wgrad_study", args, cases, accuracy=rows,
                                 ceilings=vars(H200_CEILINGS), fp8_rate=FP8_RATE)  # fmt: skip


if __name__ == "__main__":
    main()
