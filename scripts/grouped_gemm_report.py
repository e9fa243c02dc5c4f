#!/usr/bin/env python3
"""Markdown tables from a bench_grouped_gemm.py JSON (used to write docs/GEMM.md).

python scripts/grouped_gemm_report.py docs/results/bench_grouped_gemm_h200.json
python scripts/grouped_gemm_report.py --store RECORD.json [...] [--md docs/GEMM.md]
    the fp32 accumulate's two stores (the tile read back, or TMA reduce-add) and 'auto' by rows
    a group (the records' mok_load / mok_reduce / mok rows), filling the page's store table
python scripts/grouped_gemm_report.py --cluster2 RECORD.json [...] [--md docs/GEMM.md]
    the weight gradients in the cooperative schedule against cooperative_cluster2 and torch by
    rows a group (the records' mok / mok_cluster2 / torch rows), filling the page's cluster table
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mok_megatron.testing.records import fill_markdown_table  # noqa: E402

# (op, ours, torch baseline it must beat)
PAIRS = [
    ("l1_swiglu", "mok", "torch_gemm"),
    ("l1_swiglu", "mok", "torch_gemm+swiglu"),
    ("l1_swiglu", "mok_save_h", "torch_gemm+swiglu"),
    ("l1_swiglu", "mok_save_h", "torch_gemm+mok_swiglu"),
    ("l2", "mok", "torch_gemm"),
    ("l2_dgrad_dswiglu", "mok", "torch_gemm+dswiglu"),
    ("l2_dgrad_dswiglu", "mok_with_act", "torch_gemm+dswiglu"),
    ("l2_dgrad_dswiglu", "mok", "torch_gemm+mok_dswiglu"),
    ("l1_dgrad", "mok", "torch_gemm"),
    ("wgrad_l1", "mok", "torch_gemm"),
    ("wgrad_l1", "mok_pingpong", "torch_gemm"),
    ("wgrad_l2", "mok", "torch_gemm"),
    ("wgrad_l2", "mok_pingpong", "torch_gemm"),
    ("wgrad_l1_acc", "mok", "torch_gemm+add"),
    ("wgrad_l1_acc", "mok_pingpong", "torch_gemm+add"),
    ("wgrad_l2_acc", "mok", "torch_gemm+add"),
    ("wgrad_l2_acc", "mok_pingpong", "torch_gemm+add"),
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
            if a is None or b is None:  # not in this record (a failed run is a row with "error")
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
    targets_table(by, rows_of)
    sweep_table(doc)
    swiglu = [r for r in doc["results"] if r["impl"] == "torch_swiglu_only" and "median_ms" in r]
    if swiglu:
        print("\ntorch's separate SwiGLU pass alone (ms): " + ", ".join(
            f"{r['model']}/{r['rows']}: {r['median_ms']:.3f}" for r in swiglu))  # fmt: skip


# issue 7's targets: (label, op, ours, theirs, what ratio or TFLOP/s must reach)
TARGETS = [
    ("L1 + SwiGLU >= 650 TFLOP/s", "l1_swiglu", "mok", None, 650.0),
    ("L1 + SwiGLU >= 1.15x torch L1 + SwiGLU", "l1_swiglu", "mok", "torch_gemm+swiglu", 1.15),
    ("L2 >= torch", "l2", "mok", "torch_gemm", 1.0),
    ("L2 dgrad + dSwiGLU >= torch + dSwiGLU", "l2_dgrad_dswiglu", "mok", "torch_gemm+dswiglu", 1.0),
    ("L1 dgrad >= torch", "l1_dgrad", "mok", "torch_gemm", 1.0),
    ("wgrad L1 >= torch", "wgrad_l1", "mok", "torch_gemm", 1.0),
    ("wgrad L2 >= torch", "wgrad_l2", "mok", "torch_gemm", 1.0),
]


def targets_table(by: dict, rows_of: list) -> None:
    """Each target at the EP-2 row count (each model's largest rows in the record)."""
    full = {}
    for model, rows in rows_of:
        full.setdefault(model, rows)
    models = list(full)
    print("\nTargets (issue 7) at the EP-2 rows (8192 tokens per rank):\n")
    print("| target | " + " | ".join(f"{m} ({full[m]})" for m in models) + " |")
    print("|---|" + "---|" * len(models))
    for label, op, ours, theirs, goal in TARGETS:
        cells = []
        for m in models:
            impls = by.get((m, full[m], op), {})
            a, b = impls.get(ours), impls.get(theirs) if theirs else None
            if (
                a is None
                or "median_ms" not in a
                or (theirs and (b is None or "median_ms" not in b))
            ):
                cells.append("n/a")
                continue
            value = a["tflops"] if theirs is None else b["median_ms"] / a["median_ms"]
            shown = f"{value:.0f}" if theirs is None else f"{value:.2f}x"
            verdict = "met" if value >= goal else f"missed by {100 * (1 - value / goal):.1f}%"
            cells.append(f"{shown}: {verdict}")
        print(f"| {label} | " + " | ".join(cells) + " |")


#: The sweep rows' tuning keys in records written while the settings were environment variables
#: (docs/results/bench_grouped_gemm_h200.json): read too, so those records still render.
LEGACY_TUNING_KEYS = {"schedule": "MOK_GG_SCHEDULE", "raster": "MOK_GG_RASTER",
                      "swizzle": "MOK_GG_SWIZZLE"}  # fmt: skip


def tuning_label(tuning: dict) -> str:
    """'coop/m/1' for a sweep row's tuning (GemmTuning's fields, or the legacy keys)."""
    get = lambda key: tuning.get(key, tuning.get(LEGACY_TUNING_KEYS[key]))  # noqa: E731
    return f"{get('schedule')[:4]}/{get('raster')}/{get('swizzle')}"


def sweep_table(doc: dict) -> None:
    """TFLOP/s of ours under each tile-order setting (GemmTuning: schedule/raster/swizzle), EP-2
    full rows."""
    rows = [r for r in doc.get("sweep", []) if "tflops" in r]
    if not rows:
        return
    settings = list(dict.fromkeys(tuning_label(r["tuning"]) for r in rows))
    cells = defaultdict(dict)
    for r in rows:
        cells[(r["model"], r["op"], r["impl"])][tuning_label(r["tuning"])] = r["tflops"]
    print("\nSweep (TFLOP/s of ours; schedule/raster/swizzle):\n")
    print("| model | op | impl | " + " | ".join(settings) + " |")
    print("|---|---|---|" + "---|" * len(settings))
    for (model, op, impl), by in cells.items():
        best = max(by.values())
        vals = [("**%.0f**" if by.get(x) == best else "%.0f") % by[x] if x in by else "-"
                for x in settings]  # fmt: skip
        print(f"| {model} | {op} | {impl} | " + " | ".join(vals) + " |")


STORE_BEGIN, STORE_END = (
    "<!-- accumulate store table begin -->",
    "<!-- accumulate store table end -->",
)


def accumulate_bytes(row: dict) -> int:
    """The HBM bytes an fp32 accumulate moves at the least: the [G, M, N] buffer read and written
    once (8 bytes an element) and its two bf16 row operands read once (wgrad_l1_acc: d_h [R, 2I]
    and x [R, H] into [G, 2I, H]; wgrad_l2_acc: d_y [R, H] and act [R, I] into [G, H, I])."""
    hidden, inter, rows, groups = row["hidden"], row["intermediate"], row["rows"], row["groups"]
    m, n = (2 * inter, hidden) if row["op"] == "wgrad_l1_acc" else (hidden, inter)
    return 8 * groups * m * n + 2 * rows * (m + n)


def _record_lines(paths: list[str]) -> list[str]:
    lines = []
    for path in paths:
        doc = json.load(open(path))
        lines.append(f"- `{os.path.basename(path)}`: {doc['gpu']}, torch {doc['torch']}, commit "
                     f"`{doc['commit'][:7]}`, EP {doc['ep']}, {doc['timing']}")  # fmt: skip
    return lines


def _timed_cells(paths: list[str], keep):
    """Each record's ((model, rows, groups, op), {impl: row}) over its timed rows whose op
    ``keep`` accepts, record by record."""
    for path in paths:
        by = defaultdict(dict)
        for r in json.load(open(path))["results"]:
            if keep(r["op"]) and "median_ms" in r:
                by[(r["model"], r["rows"], r["groups"], r["op"])][r["impl"]] = r
        yield from by.items()


def _span(r: dict) -> str:
    return f"{r['median_ms']:.3f} ({r['p10_ms']:.3f}-{r['p90_ms']:.3f})"


def store_table(paths: list[str]) -> str:
    """The fp32 accumulate by rows a group (the mainloop's K): the tile read back by the epilogue
    (mok_load), reduce-added by TMA (mok_reduce), 'auto' (mok) and torch's GEMM + add, each row's
    times from one process; TB/s: accumulate_bytes over the median, the HBM rate each way
    reached."""
    lines = _record_lines(paths)
    lines += ["", "| model | rows | rows a group | op | load ms (p10-p90) | reduce ms (p10-p90) "
              "| load / reduce | load, reduce TB/s | auto ms | torch GEMM + add ms "
              "| auto over torch |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for (model, rows, groups, op), impls in _timed_cells(paths, lambda op: op.endswith("_acc")):
        load, red, auto, ref = (impls.get(k) for k in
                                ("mok_load", "mok_reduce", "mok", "torch_gemm+add"))  # fmt: skip
        if load is None or red is None:
            continue
        ms = lambda r: "-" if r is None else f"{r['median_ms']:.3f}"  # noqa: E731
        over = (
            "-" if auto is None or ref is None else f"{ref['median_ms'] / auto['median_ms']:.2f}x"
        )
        rate = lambda r: accumulate_bytes(r) / (r["median_ms"] * 1e-3) / 1e12  # noqa: E731
        lines.append(f"| {model} | {rows} | {rows // groups} | {op} | {_span(load)} | {_span(red)} "
                     f"| {load['median_ms'] / red['median_ms']:.2f}x "
                     f"| {rate(load):.2f}, {rate(red):.2f} | {ms(auto)} | {ms(ref)} "
                     f"| {over} |")  # fmt: skip
    return "\n".join(lines)


CLUSTER2_BEGIN, CLUSTER2_END = (
    "<!-- wgrad cluster2 table begin -->",
    "<!-- wgrad cluster2 table end -->",
)


def cluster2_table(paths: list[str]) -> str:
    """The weight gradients (plain, and into fp32 with store 'auto') by rows a group (the
    mainloop's K): the engine's cooperative schedule (mok), cooperative_cluster2 (mok_cluster2:
    two CTAs along M share each B tile) and torch (its GEMM, plus the add for the fp32 ops), each
    row's times from one process; cooperative over cluster2 > 1 where the pairs win."""
    lines = _record_lines(paths)
    lines += ["", "| model | rows | rows a group | op | cooperative ms (p10-p90) "
              "| cluster2 ms (p10-p90) | cooperative / cluster2 | torch ms | torch / cluster2 |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for (model, rows, groups, op), impls in _timed_cells(paths, lambda op: op.startswith("wgrad")):
        coop, pair = impls.get("mok"), impls.get("mok_cluster2")
        ref = impls.get("torch_gemm+add" if op.endswith("_acc") else "torch_gemm")
        if coop is None or pair is None:
            continue
        torch_ms = "-" if ref is None else f"{ref['median_ms']:.3f}"
        over = "-" if ref is None else f"{ref['median_ms'] / pair['median_ms']:.2f}x"
        lines.append(f"| {model} | {rows} | {rows // groups} | {op} | {_span(coop)} "
                     f"| {_span(pair)} | {coop['median_ms'] / pair['median_ms']:.2f}x "
                     f"| {torch_ms} | {over} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    tables = {"--store": (store_table, STORE_BEGIN, STORE_END),
              "--cluster2": (cluster2_table, CLUSTER2_BEGIN, CLUSTER2_END)}  # fmt: skip
    if len(sys.argv) > 1 and sys.argv[1] in tables:
        make, begin, end = tables[sys.argv[1]]
        args = sys.argv[2:]
        md = None
        if "--md" in args:
            i = args.index("--md")
            md, args = args[i + 1], args[:i] + args[i + 2 :]
        table = make(args)
        print(table)
        if md:
            fill_markdown_table(md, table, begin, end)
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "docs/results/bench_grouped_gemm.json")
