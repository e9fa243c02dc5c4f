#!/usr/bin/env python
"""Accuracy of MoK's FP8 experts (issue 15, item 4) on one GPU, EP 1: relative errors of the
forward output and every routed gradient, on the three benchmark shapes scaled down (the sizes
of tests/gpu/test_fp8_experts_cuda.py, whose bounds these figures sit under) and at full width
with fewer tokens.

For each shape, against the dense float64 layer (unquantised, ``testing.run_oracle``): MoK with
BF16 experts, MoK with FP8 experts, and FP8 with its data gradients in FP8 too
(``fp8_backward="dgrad"``); and FP8 against BF16 and each FP8 run against the reference
backend's emulation of it (float32) on the same inputs.

    python scripts/fp8_accuracy.py --out $OUT/fp8_accuracy.json
    python scripts/fp8_accuracy.py --render docs/results/fp8_accuracy_<gpu>_<commit>.json \\
        --md docs/FP8.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mok_megatron.testing.records import commit, fill_markdown_table  # noqa: E402

NAMES = ("out", "d_x", "d_router_weights", "d_w_routed_gate", "d_w_routed_up", "d_w_routed_down")
#: (name, hidden, inter, experts, topk, shared_inter, tokens)
SHAPES = [
    ("qwen3-30b-a3b (scaled)", 256, 128, 16, 8, 0, 200),
    ("deepseek-v3 (scaled)", 512, 256, 16, 8, 128, 200),
    ("mixtral-8x7b (scaled)", 512, 512, 8, 2, 0, 200),
    ("qwen3-30b-a3b", 2048, 768, 128, 8, 0, 256),
    ("deepseek-v3", 7168, 2048, 32, 8, 2048, 128),  # 32 of its 256 experts: the oracle's time
    ("mixtral-8x7b", 4096, 14336, 8, 2, 0, 256),
]
TABLE_BEGIN, TABLE_END = "<!-- fp8_accuracy table begin -->", "<!-- fp8_accuracy table end -->"
COMPARISONS = ("bf16_vs_float64", "fp8_vs_float64", "fp8_vs_bf16", "fp8_vs_reference",
               "fp8_dgrad_vs_float64", "fp8_dgrad_vs_bf16", "fp8_dgrad_vs_reference")  # fmt: skip


def layer_run(problem, config, backend: str, d_out) -> dict:
    """out and the gradients of one forward + backward (fused gate/up form), split gate / up."""
    import torch

    from mok_megatron import functional as F
    from mok_megatron.ops import deinterleave_gate_up, interleave_gate_up

    x, topk, rw, (gate, up, down), shared = problem.local(0, dtype=torch.bfloat16, device="cuda")
    weights = (*(shared or (None, None, None)), interleave_gate_up(gate, up), None, down)
    ws = F.create_workspace(
        config, None, device="cuda", num_local_tokens=x.shape[0], hidden_size=x.shape[1],
        topk=topk.shape[1], num_experts=gate.shape[0], intermediate_size=gate.shape[1],
        shared_intermediate_size=shared[0].shape[0] if shared else 0, dtype=torch.bfloat16,
        backend=backend,
    )  # fmt: skip
    sched = F.build_schedule(ws, config, topk, ws.num_local_experts)
    out, ctx = F.forward(config, ws, sched, x, rw, *weights)
    grads = F.backward(config, ws, sched, ctx, d_out, x, rw, *weights)._asdict()
    d_gate, d_up = deinterleave_gate_up(grads["d_w_routed_gate"], dim=-2)
    result = {"out": out, **grads, "d_w_routed_gate": d_gate, "d_w_routed_up": d_up}
    return {n: result[n].double().cpu() for n in NAMES}


def measure(shapes, record: dict, out: str, oracle_device: str = "cpu") -> list[dict]:
    """The rows for ``shapes``; ``record`` is rewritten to ``out`` after each shape.
    ``oracle_device``: where the dense float64 oracle runs (the GPU's float64 for the full
    widths, whose CPU oracle takes minutes)."""
    import torch

    from mok_megatron import functional as F
    from mok_megatron.testing import random_moe_problem, relative_error
    from mok_megatron.testing.runs import global_d_out, run_oracle

    fp8 = F.MoKConfig(expert_precision="fp8_blockwise", wait_timeout_ms=60_000)
    bf16 = dataclasses.replace(fp8, expert_precision="bf16")
    fp8_dgrad = dataclasses.replace(fp8, fp8_backward="dgrad")
    rows = record["rows"]
    for name, hidden, inter, experts, topk, shared, tokens in shapes:
        problem = random_moe_problem([tokens], hidden, inter, experts, topk,
                                     shared_inter=shared, seed=11)  # fmt: skip
        d_out64 = global_d_out(problem, 1)
        d_out = d_out64.to("cuda", torch.bfloat16)
        oracle = run_oracle(problem.to(oracle_device), d_out.double().to(oracle_device))
        oracle = {n: None if v is None else v.cpu() for n, v in oracle.items()}
        runs = {
            "bf16": layer_run(problem, bf16, "cuda", d_out),
            "fp8": layer_run(problem, fp8, "cuda", d_out),
            "reference": layer_run(problem, fp8, "reference", d_out),
            "fp8_dgrad": layer_run(problem, fp8_dgrad, "cuda", d_out),
            "reference_dgrad": layer_run(problem, fp8_dgrad, "reference", d_out),
        }
        pairs = {"bf16_vs_float64": ("bf16", None), "fp8_vs_float64": ("fp8", None),
                 "fp8_vs_bf16": ("fp8", "bf16"), "fp8_vs_reference": ("fp8", "reference"),
                 "fp8_dgrad_vs_float64": ("fp8_dgrad", None),
                 "fp8_dgrad_vs_bf16": ("fp8_dgrad", "bf16"),
                 "fp8_dgrad_vs_reference": ("fp8_dgrad", "reference_dgrad")}  # fmt: skip
        assert tuple(pairs) == COMPARISONS
        for comparison, (a, b) in pairs.items():
            errors = {n: relative_error(runs[a][n], oracle[n] if b is None else runs[b][n])
                      for n in NAMES}  # fmt: skip
            rows.append({"shape": name, "tokens": tokens, "comparison": comparison, **errors})
            print(name, comparison, " ".join(f"{n}={e:.2e}" for n, e in errors.items()),
                  flush=True)  # fmt: skip
        torch.cuda.empty_cache()
        with open(out, "w") as f:  # each shape lands as soon as it is measured
            json.dump(record, f, indent=1)
    return rows


def render(record: dict) -> str:
    lines = [
        f"Record: {record['gpu']}, torch {record['torch']}, commit `{record['commit'][:7]}` "
        "(`scripts/fp8_accuracy.py`): relative Frobenius error, EP 1.",
        "",
        "| shape | tokens | comparison | " + " | ".join(NAMES) + " |",
        "|---|---|---|" + "---|" * len(NAMES),
    ]
    for r in record["rows"]:
        errors = " | ".join(f"{r[n]:.1e}" for n in NAMES)
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['comparison']} | {errors} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument(
        "--shapes",
        default="all",
        choices=("all", "scaled"),
        help="'scaled': the three scaled-down shapes only (the full widths' float64 "
        "oracle takes minutes)",
    )
    ap.add_argument("--oracle-device", default="cpu", choices=("cpu", "cuda"),
                    help="where the float64 oracle runs (cuda: the GPU's float64)")  # fmt: skip
    ap.add_argument("--render")
    ap.add_argument("--md")
    args = ap.parse_args()
    if args.render:
        with open(args.render) as f:
            table = render(json.load(f))
        if not args.md:
            print(table)
            return
        fill_markdown_table(args.md, table, TABLE_BEGIN, TABLE_END)
        return
    if not args.out:
        ap.error("give --out (measure) or --render (tabulate a record)")
    import torch

    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "commit": commit(), "rows": []}  # fmt: skip
    shapes = [s for s in SHAPES if args.shapes == "all" or "(scaled)" in s[0]]
    measure(shapes, record, args.out, args.oracle_device)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
