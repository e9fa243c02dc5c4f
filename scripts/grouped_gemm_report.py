#!/usr/bin/env python3
"""Markdown tables from a bench_grouped_gemm.py JSON (used to write docs/GEMM.md).

python scripts/grouped_gemm_report.py docs/results/bench_grouped_gemm_h200.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

# (op, ours, torch baseline it must beat)
PAIRS = [
    ("l1_swiglu", "mok", "torch_gemm"),
    ("l1_swiglu", "mok", "torch_gemm+swiglu"),
    ("l1_swiglu", "mok_save_h", "torch_gemm+swiglu"),
    ("l2", "mok", "torch_gemm"),
    ("l2_dgrad_dswiglu", "mok", "torch_gemm+dswiglu"),
    ("l2_dgrad_dswiglu", "mok_with_act", "torch_gemm+dswiglu"),
    ("l1_dgrad", "mok", "torch_gemm"),
    ("wgrad_l1", "mok", "torch_gemm"),
    ("wgrad_l2", "mok", "torch_gemm"),
]


def fmt(row, key, spec):
    return "n/a" if row is None or key not in row else format(row[key], spec)


def main(path: str) -> None:
    doc = json.load(open(path))
    by = defaultdict(dict)
    for r in doc["results"]:
        by[(r["model"], r["rows"], r["op"])][r["impl"]] = r
    print(f"GPU {doc['gpu']} (driver {doc['driver']}), torch {doc['torch']}, commit "
          f"{doc['commit']}, {doc['timing']}. TFLOP/s from the median; `x` = torch ms / ours ms; "
          f"FLOPs count the GEMM only (SwiGLU is free).\n")  # fmt: skip
    print(
        "| model | rows | op | ours | ours ms (p10-p90) | ours TFLOP/s | vs torch | torch ms "
        "| torch TFLOP/s | x |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    models = list(dict.fromkeys(r["model"] for r in doc["results"]))
    rows_of = sorted({(r["model"], r["rows"]) for r in doc["results"]},
                     key=lambda mr: (models.index(mr[0]), -mr[1]))  # fmt: skip
    for model, rows in rows_of:
        for op, ours, theirs in PAIRS:
            impls = by.get((model, rows, op), {})
            a, b = impls.get(ours), impls.get(theirs)
            if a is None and b is None:
                continue
            ratio = (b["median_ms"] / a["median_ms"]) if a and b and "median_ms" in a and \
                "median_ms" in b else None  # fmt: skip
            err = (a or {}).get("error") or (b or {}).get("error")
            print(f"| {model} | {rows} | {op} | {ours} | {fmt(a, 'median_ms', '.3f')} "
                  f"({fmt(a, 'p10_ms', '.3f')}-{fmt(a, 'p90_ms', '.3f')}) | "
                  f"{fmt(a, 'tflops', '.0f')} | {theirs} | {fmt(b, 'median_ms', '.3f')} | "
                  f"{fmt(b, 'tflops', '.0f')} | "
                  f"{'n/a' if ratio is None else format(ratio, '.2f')}"
                  f"{' (' + err[:60] + ')' if err else ''} |")  # fmt: skip
    sweep_table(doc)
    swiglu = [r for r in doc["results"] if r["impl"] == "torch_swiglu_only" and "median_ms" in r]
    if swiglu:
        print("\ntorch's separate SwiGLU pass alone (ms): " + ", ".join(
            f"{r['model']}/{r['rows']}: {r['median_ms']:.3f}" for r in swiglu))  # fmt: skip


def sweep_table(doc: dict) -> None:
    """TFLOP/s of ours under each MOK_GG_* setting (schedule/raster/swizzle), EP-2 full rows."""
    rows = [r for r in doc.get("sweep", []) if "tflops" in r]
    if not rows:
        return
    label = lambda t: f"{t['MOK_GG_SCHEDULE'][:4]}/{t['MOK_GG_RASTER']}/{t['MOK_GG_SWIZZLE']}"  # noqa: E731
    settings = list(dict.fromkeys(label(r["tuning"]) for r in rows))
    cells = defaultdict(dict)
    for r in rows:
        cells[(r["model"], r["op"], r["impl"])][label(r["tuning"])] = r["tflops"]
    print("\nSweep (TFLOP/s of ours; schedule/raster/swizzle):\n")
    print("| model | op | impl | " + " | ".join(settings) + " |")
    print("|---|---|---|" + "---|" * len(settings))
    for (model, op, impl), by in cells.items():
        best = max(by.values())
        vals = [("**%.0f**" if by.get(x) == best else "%.0f") % by[x] if x in by else "-"
                for x in settings]  # fmt: skip
        print(f"| {model} | {op} | {impl} | " + " | ".join(vals) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/results/bench_grouped_gemm.json")
