#!/usr/bin/env python3
"""Nsight Compute's view of one megakernel launch: runs scripts/bench_moe.py's MoK layer (weights,
routing, "auto" knobs) for one shape under ``ncu`` and profiles one forward (or, with
``--backward``, one backward) megakernel launch after the warm-up ones, then writes a JSON record
of what ncu read:

- ``metrics``: the details page (speed of light, memory and compute workload, scheduler and warp
  state statistics: every row as section / name / unit / value);
- ``stall_reasons``: each stall reason's share of the warp-stall samples (the source page's
  per-instruction reasons, summed), largest first;
- ``hot_instructions``: the SASS instructions with the most warp-stall samples (the source
  page), with their share of all samples.

The raw details and source pages are written beside the record (``<out>_details.csv.gz``,
``<out>_source.csv.gz``); ``--resummarise RECORD`` rebuilds a record's stall reasons and hot
instructions from the source page beside it (no GPU), e.g. after a change to their parsing.

The hardware counters need a machine that lends them (docs: the device's KINDS.md; Firecracker
machines do). The clocks are left alone (``--clock-control none``). ncu replays the kernel once
per counter pass, restoring device memory in between, so every pass sees the same counters and
epoch as the first.

  python3 scripts/ncu_megakernel.py --shape qwen3-30b-a3b --out docs/results/ncu_<...>.json
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gzip
import io
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: ncu sections read (each costs replay passes; the source counters carry the stall sampling).
SECTIONS = (
    "SpeedOfLight",
    "ComputeWorkloadAnalysis",
    "MemoryWorkloadAnalysis",
    "SchedulerStats",
    "WarpStateStats",
    "SourceCounters",
    "LaunchStats",
    "Occupancy",
)
#: Launches of the profiled kernel before the one profiled (the workspace's first pass, warm-up).
WARMUP_LAUNCHES = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--routing", default="uniform", choices=("uniform", "skewed"))
    p.add_argument("--backward", action="store_true", help="profile the backward megakernel")
    p.add_argument(
        "--fp8",
        action="store_true",
        help="profile the FP8 forward megakernel (expert_precision='fp8_blockwise')",
    )
    p.add_argument(
        "--fwd-rows",
        choices=("in_place", "pull"),
        help="MoKConfig.fwd_rows of the profiled forward (default: the config's 'auto', which "
        "follows the GPU's tuned table)",
    )
    p.add_argument("--top", type=int, default=60, help="hot instructions kept")
    p.add_argument("--out", help="the record (JSON) to write")
    p.add_argument("--resummarise", metavar="RECORD", help="rebuild RECORD's summary (no run)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args) -> None:
    """The profiled program: the layer's passes, one more than the launches ncu skips."""
    import bench_moe
    import torch

    rank, _ = bench_moe.init_distributed("cuda")
    shape = bench_moe.SHAPES[args.shape]
    config = bench_moe.transformer_config(shape, "cuda")
    _, layer = bench_moe.build_layers(config, "cuda", args.tokens, "megakernel")
    sets = bench_moe.make_inputs(1, args.tokens, shape, args.routing, "cuda",
                                 config.params_dtype, 1234, rank)  # fmt: skip
    grad = contextlib.nullcontext() if args.backward else torch.no_grad()
    knobs = dict(bench_moe.MOK_FP8_MEGA_KNOBS) if args.fp8 else {}
    knobs["fwd_rows"] = args.fwd_rows  # None: unchanged
    with grad, bench_moe._mok_knobs(layer, **knobs):
        for _ in range(WARMUP_LAUNCHES + 1):
            bench_moe.run_layer(layer, sets[0], backward=args.backward)
            layer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    print(f"[ncu_megakernel] child ran {WARMUP_LAUNCHES + 1} passes", flush=True)


def ncu_binary() -> str:
    found = shutil.which("ncu")
    if found:
        return found
    for root in ("/usr/local/cuda/bin", "/opt/nvidia/nsight-compute"):
        for dirpath, _, files in os.walk(root):
            if "ncu" in files:
                return os.path.join(dirpath, "ncu")
    raise SystemExit("ncu not found (Nsight Compute is not installed on this machine)")


def read_csv(text: str, header: str | None = None) -> list[dict]:
    """The CSV rows of an ncu page; ``header``: the first column's name, where the page has
    lines before its header (the source page starts with a "Kernel Name" line)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if header is not None:
        first = next((i for i, ln in enumerate(lines) if ln.startswith(f'"{header}"')), None)
        lines = lines[first:] if first is not None else []
    return list(csv.DictReader(io.StringIO("\n".join(lines))))


def number(value: str) -> float | None:
    try:
        return float(value.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def details(rows: list[dict]) -> list:
    return [{"section": r.get("Section Name"), "name": r.get("Metric Name"),
             "unit": r.get("Metric Unit"), "value": r.get("Metric Value")} for r in rows]  # fmt: skip


def stall_reasons(rows: list[dict]) -> list:
    """Each stall reason's share of all warp-stall samples, summed over the source page's
    instructions (its ``stall_*`` columns), largest first."""
    reasons = [k for k in (rows[0] if rows else {}) if k and k.startswith("stall_")
               and "Not Issued" not in k]  # fmt: skip
    sums = {k: sum(number(r.get(k)) or 0.0 for r in rows) for k in reasons}
    total = sum(sums.values())
    out = [{"reason": k, "samples": v, "share": v / total if total else 0.0}
           for k, v in sums.items()]  # fmt: skip
    return sorted(out, key=lambda m: -m["samples"])


def hot_instructions(rows: list[dict], top: int) -> tuple[list, float]:
    if not rows:
        return [], 0.0
    keys = [k for k in rows[0] if k]  # a row longer than the header gives a None key
    sample_key = next((k for k in keys if "Warp Stall Sampling (All" in k), None)
    if sample_key is None:
        return [{"columns": keys}], 0.0
    total = sum(number(r[sample_key]) or 0.0 for r in rows)
    ranked = sorted(rows, key=lambda r: -(number(r[sample_key]) or 0.0))[:top]
    keep = [k for k in keys if any(s in k for s in ("Address", "Source", "Warp Stall",
                                                    "Instructions Executed"))]  # fmt: skip
    out = []
    for r in ranked:
        rec = {k: r.get(k) for k in keep}
        rec["share"] = (number(r[sample_key]) or 0.0) / total if total else 0.0
        out.append(rec)
    return out, total


def resummarise(path: str, top: int) -> None:
    """``path``'s stall reasons and hot instructions again, from ``<path>_source.csv.gz``."""
    with open(path) as f:
        record = json.load(f)
    with gzip.open(os.path.splitext(path)[0] + "_source.csv.gz", "rt") as f:
        rows = read_csv(f.read(), header="Address")
    record["stall_reasons"] = stall_reasons(rows)
    record["hot_instructions"], record["stall_samples"] = hot_instructions(rows, top)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"rewrote {path}: {len(rows)} instructions, {record['stall_samples']:.0f} samples")


def print_summary(stalls: list, hot: list) -> None:
    """The stall reasons' shares and the hot instructions, one per line."""
    for m in stalls:
        print(f"  {m['reason']}: {m['share']:.3f}")
    for h in hot:
        print(f"  {h.get('share', 0):.3f} {h.get('Address', '')} {h.get('Source', '')}")


def profile_pages(ncu: str, cmd: list, rep: str):
    """Run the ncu command ``cmd`` (writing ``rep``.ncu-rep), then read its details and source
    pages: (details CSV text, the source page's CompletedProcess), each raw page written beside
    as ``<rep>_details.csv.gz`` / ``<rep>_source.csv.gz``."""
    run = subprocess.run(cmd, capture_output=True, text=True)
    print(run.stdout[-4000:], run.stderr[-4000:], sep="\n", flush=True)
    if run.returncode != 0 or not os.path.exists(rep + ".ncu-rep"):
        raise SystemExit(f"ncu exited {run.returncode}")
    page = subprocess.run([ncu, "--import", rep + ".ncu-rep", "--page", "details", "--csv"],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    source = subprocess.run([ncu, "--import", rep + ".ncu-rep", "--page", "source", "--csv",
                             "--print-source", "sass"], capture_output=True, text=True)  # fmt: skip
    for name, text in (("details", page), ("source", source.stdout)):  # the raw pages, beside
        with gzip.open(f"{rep}_{name}.csv.gz", "wt") as f:
            f.write(text)
    return page, source


def write_gemm_record(benchmark: str, ncu: str, cmd: list, rep: str, args, sections) -> None:
    """One GEMM launch profiled by ``cmd`` (scripts/ncu_fp8_gemm.py, scripts/ncu_wgrad_gemm.py):
    its pages read (``profile_pages``), the JSON record written to ``args.out`` (GPU, torch,
    commit, the details page, stall reasons, hot instructions), and the metrics of ``sections``
    and the top stall reasons and instructions printed."""
    page, source = profile_pages(ncu, cmd, rep)
    rows = read_csv(source.stdout, header="Address")
    hot, samples = hot_instructions(rows, args.top)
    import torch

    from mok_megatron.testing.records import commit

    record = {"benchmark": benchmark, "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "commit": commit(), "args": vars(args),
              "sections": list(SECTIONS),
              "ncu": subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout,
              "stall_reasons": stall_reasons(rows), "stall_samples": samples,
              "hot_instructions": hot, "metrics": details(read_csv(page)),
              "source_page_error": source.stderr[-2000:]}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    for m in record["metrics"]:
        if m["section"] in sections:
            print(f"  {m['section'][:24]:24s} {m['name']}: {m['value']} {m['unit']}")
    print_summary(record["stall_reasons"][:10], hot[:20])
    print(f"wrote {args.out}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    if args.resummarise:
        resummarise(args.resummarise, args.top)
        return
    if not args.out:
        raise SystemExit("--out is required")
    import bench_moe

    ncu = ncu_binary()
    out_dir = os.path.dirname(os.path.abspath(args.out))
    rep = os.path.splitext(os.path.abspath(args.out))[0]
    if args.fp8 and args.backward:
        raise SystemExit("--fp8: the FP8 megakernel is forward only (its backward is stage 1's)")
    kernel = ("moe_backward_megakernel" if args.backward
              else "moe_forward_megakernel_fp8" if args.fp8 else "moe_forward_megakernel")  # fmt: skip
    cmd = [ncu, "--clock-control", "none", "--target-processes", "all",
           "-k", f"regex:{kernel}", "--launch-skip", str(WARMUP_LAUNCHES), "--launch-count", "1",
           *[a for s in SECTIONS for a in ("--section", s)], "-f", "-o", rep,
           sys.executable, os.path.abspath(__file__), "--child", "--shape", args.shape,
           "--tokens", str(args.tokens), "--routing", args.routing,
           *(["--backward"] if args.backward else []),
           *(["--fp8"] if args.fp8 else []),
           *(["--fwd-rows", args.fwd_rows] if args.fwd_rows else [])]  # fmt: skip
    os.makedirs(out_dir, exist_ok=True)
    page, source = profile_pages(ncu, cmd, rep)
    metrics = details(read_csv(page))
    rows = read_csv(source.stdout, header="Address")
    stalls = stall_reasons(rows)
    hot, samples = hot_instructions(rows, args.top)
    # NOTE: after the child exited: it inherits this process's environment, and the rendezvous
    # variables init_distributed sets would point it at this process's store.
    bench_moe.init_distributed("cuda")  # the record's environment names the world size
    record = {"benchmark": "ncu_megakernel",
              "environment": bench_moe.environment(bench_moe.parse_args([])),
              "args": vars(args), "kernel": kernel, "sections": list(SECTIONS),
              "ncu": subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout,
              "stall_reasons": stalls, "stall_samples": samples, "hot_instructions": hot,
              "metrics": metrics, "source_page_error": source.stderr[-2000:]}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print_summary(stalls[:12], hot[:25])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
