#!/usr/bin/env python3
"""Where the megakernel's forward time goes, from its own timeline: the kernel records global-timer
stamps per CTA and per task when asked (``moe_mega_forward(..., trace=True)``, layout/mega.cuh),
and this script runs scripts/bench_moe.py's MoK layer (weights, routing, "auto" knobs) with the
trace on and splits every CTA's time, from the first CTA's start to the last one's end, into:

- ``pull``: its consumer warpgroups pull rows (comm CTAs only);
- ``wait``: the consumers wait for their next ticket (the producer is waiting for inputs, or
  for the ticket itself);
- ``stall``: a task's consumers hold its ticket but its inputs are not ready yet (its rows have
  not landed, or its m-tile's L1 tasks are not done);
- ``mainloop``: the wgmma mainloop once the inputs are ready (TMA latency included);
- ``epilogue``: the epilogue's stores (and an L1 task's flag release);
- ``barrier``: end-of-round barriers;
- ``start`` / ``end``: before the CTA started / after it finished its last task.

``--backward`` traces the backward megakernel instead (forward + backward passes, its timeline
from ``ws.buffers.last_backward_trace``): "l1" is then its first GEMM (the L2 dgrad, K = H) and
"l2" its second (the L1 dgrad, K = 2I).

It also reports each GEMM's mainloop time per k-tile (tasks whose inputs were ready before the
consumers took them), against one k-tile's time at the BF16 ceiling of the floor model
(timing.H200_CEILINGS, a measured dense-GEMM rate, below the data-sheet peak), and the same
split by the rows of each task's m-tile (``tile_classes``: full, 65-127 rows, at most 64; from
the plan's tiles, CudaBuffers.last_tiles). JSON record.

  python3 scripts/megakernel_trace.py --out docs/results/megakernel_trace_h200_<commit>.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_moe  # noqa: E402

#: The categories every CTA's time is split into, in timeline order.
CATEGORIES = ("start", "pull", "wait", "stall", "mainloop", "epilogue", "barrier", "end")
#: The megakernel's tile (layout/mega.cuh kBlockM, kBlockN; 64-deep k-tiles).
TILE_M, TILE_N, TILE_K = 128, 256, 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(bench_moe.SHAPES))
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--routing", default="uniform", choices=("uniform", "skewed"))
    p.add_argument("--passes", type=int, default=3, help="traced passes per case (median taken)")
    p.add_argument("--fwd-num-comm-sms", default=None, help="int; default: the config's (auto)")
    p.add_argument("--minibatch-size", default=None, help="int; default: the config's (auto)")
    p.add_argument("--megakernel-cluster", default=None, choices=("1", "2"),
                   help="MoKConfig.megakernel_cluster; default: the config's (1)")  # fmt: skip
    p.add_argument("--fwd-rows", default=None, choices=("auto", "in_place", "pull"),
                   help="MoKConfig.fwd_rows; default: the config's (auto)")  # fmt: skip
    p.add_argument("--order-block", default=None, choices=("auto", "8", "16"),
                   help="MoKConfig.megakernel_order_block (the forward's); default: the "
                        "config's (auto)")  # fmt: skip
    p.add_argument(
        "--fp8",
        action="store_true",
        help="FP8 experts (expert_precision='fp8_blockwise'): the FP8 megakernel's timeline; its "
        "k-tiles are 128 deep and hold both halves of a task's n-tile, and the per-k-tile times "
        "below stay per 64 of K of a 128 x 256 task, comparable with BF16's",
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="trace forwards that keep h and y for a backward (default: no_grad)",
    )
    p.add_argument(
        "--backward",
        action="store_true",
        help="trace the backward megakernel (forward + backward passes)",
    )
    p.add_argument(
        "--bwd-wgrad",
        default=None,
        choices=("off", "down", "down_interleaved"),
        help="MoKConfig.bwd_wgrad with --backward (the down weight's gradient as tasks of the "
        "backward launch: their records are 'wgrad', with their own gaps and epilogue times)",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.bwd_wgrad not in (None, "off") and not args.backward:
        p.error("--bwd-wgrad orders tasks of the backward megakernel: it needs --backward")
    return args


def decode(trace_ctas: torch.Tensor, trace_tasks: torch.Tensor) -> tuple[list, list]:
    """The records as dicts (ops.moe.MEGA_TRACE_*_FIELDS); tasks only where one ran."""
    from mok_megatron.ops.moe import MEGA_TRACE_CTA_FIELDS, MEGA_TRACE_TASK_FIELDS

    ctas = [dict(zip(MEGA_TRACE_CTA_FIELDS, row)) for row in trace_ctas.cpu().tolist()]
    tasks = []
    for rnd, records in enumerate(trace_tasks.cpu().tolist()):
        # NOTE: a record's index is its task's ticket, or in clusters of C CTAs C ticket + the
        # CTA's rank in its cluster (roles/megakernel_compute.cuh, trace_slot)
        for slot, row in enumerate(records):
            rec = {k: v for k, v in zip(MEGA_TRACE_TASK_FIELDS, row) if k is not None}
            if rec["cta"] == 0:
                continue
            task = rec.pop("task")
            # a down-weight gradient task (bit 41): l2 None, tile its expert
            wgrad = bool(task >> 41)
            rec.update(round=rnd, slot=slot, cta=rec["cta"] - 1, wgrad=wgrad,
                       l2=None if wgrad else bool((task >> 40) & 1),
                       tile=(task >> 20) & 0xFFFFF, n=task & 0xFFFFF)  # fmt: skip
            tasks.append(rec)
    return ctas, tasks


def mainloop_ns(task: dict) -> int:
    """A task's mainloop: from when its consumers held it with its inputs ready to its mma end."""
    return task["mma_end"] - max(task["got"], task["ready"])


def ktiles_ready(tasks: list, k_tiles: int) -> list:
    """Mainloop nanoseconds per k-tile of the tasks whose inputs were ready when their consumers
    took them (no stall inside the mainloop)."""
    return [(t["mma_end"] - t["got"]) / k_tiles for t in tasks if t["ready"] <= t["got"]]


def split_time(ctas: list, tasks: list) -> dict:
    """Nanoseconds of every category, summed over CTAs, and the kernel's span."""
    t0 = min(c["start"] for c in ctas)
    t1 = max(c["end"] for c in ctas)
    total = dict.fromkeys(CATEGORIES, 0)
    by_cta: dict[int, list] = {}
    for t in tasks:
        by_cta.setdefault(t["cta"], []).append(t)
    for cta, rec in enumerate(ctas):
        mine = sorted(by_cta.get(cta, []), key=lambda t: t["got"])
        total["start"] += rec["start"] - t0
        total["pull"] += rec["pull_ns"]
        total["barrier"] += rec["barrier_ns"]
        # NOTE: the consumers' own timeline: pulls (before the first task of a round), then
        # tasks back to back; what is not a task, a pull or a barrier is waiting for a ticket.
        busy = rec["pull_ns"] + rec["barrier_ns"]
        for t in mine:
            ready = max(t["got"], t["ready"])
            total["stall"] += ready - t["got"]
            total["mainloop"] += mainloop_ns(t)
            total["epilogue"] += t["epi_end"] - t["mma_end"]
            busy += t["epi_end"] - t["got"]
        total["wait"] += (rec["end"] - rec["start"]) - busy
        total["end"] += t1 - rec["end"]
    return {"span_ns": t1 - t0, "cta_ns": total}


def ktile_times(tasks: list, k_tiles: dict) -> dict:
    """Median mainloop nanoseconds per k-tile of each GEMM, over tasks whose inputs were ready
    when their consumers took them (no stall inside the mainloop)."""
    out = {}
    for gemm, l2 in (("l1", False), ("l2", True)):
        per = ktiles_ready([t for t in tasks if t["l2"] == l2], k_tiles[gemm])
        out[gemm] = {
            "tasks": len(per),
            "median_ns_per_ktile": statistics.median(per) if per else None,
        }
    return out


#: An m-tile's rows by class (tile_classes): all 128, more than one consumer warpgroup's 64 (the
#: tile runs in full), or at most 64 (its second warpgroup idles: roles/megakernel_gemm.cuh,
#: consumer_rows_idle).
TILE_CLASSES = {"full": (TILE_M, TILE_M), "over_half": (TILE_M // 2 + 1, TILE_M - 1),
                "half": (1, TILE_M // 2)}  # fmt: skip


def annotate_rows(tasks: list, tiles: torch.Tensor | None) -> None:
    """Each GEMM task's m-tile rows (``rows``) from its plan's tiles ([R, max_tiles, 4] int32:
    expert, row_begin, row_end, reserved; CudaBuffers.last_tiles): the expert's rows padded to
    GROUP_ALIGN (functional/cuda/plan.py), as the tile computes them; nothing where there are
    none."""
    if tiles is None:
        return
    table = tiles.reshape(tiles.shape[0], -1, 4).cpu().tolist()
    for t in tasks:
        if not t.get("wgrad"):
            _, begin, end, _ = table[t["round"]][t["tile"]]
            t["rows"] = end - begin


def tile_classes(tasks: list, k_tiles: dict) -> dict | None:
    """Each GEMM's tasks by their m-tile's rows (TILE_CLASSES): how many, their rows, their
    mainloop nanoseconds summed (from when the inputs were ready) and that sum's share of the
    GEMM's, and the median per k-tile of those whose inputs were ready when taken (as
    ktile_times). What an expert's last partial m-tile costs against a full one: the ceiling of
    a cheaper tail tile. None where the tasks have no rows (annotate_rows)."""
    if not any("rows" in t for t in tasks):
        return None
    out = {}
    for gemm in ("l1", "l2"):
        mine = [t for t in tasks if kind(t) == gemm]
        total = sum(mainloop_ns(t) for t in mine)
        out[gemm] = {}
        for name, (lo, hi) in TILE_CLASSES.items():
            group = [t for t in mine if lo <= t["rows"] <= hi]
            ns = sum(mainloop_ns(t) for t in group)
            per = ktiles_ready(group, k_tiles[gemm])
            out[gemm][name] = {
                "tasks": len(group),
                "rows": sum(t["rows"] for t in group),
                "mainloop_ns": ns,
                "mainloop_share": ns / total if total else None,
                "median_ns_per_ktile": statistics.median(per) if per else None,
            }
    return out


def gap_stats(tasks: list) -> dict:
    """The consumers' time between one task's epilogue end and the next task's start on the same
    CTA (most of ``wait``), by the next task's GEMM: how many gaps, their sum over all CTAs (ns),
    median and 90th percentile, and how many began before the producer had taken the next
    ticket (``take`` after the previous epilogue's end: the producer, not the consumers, was
    late)."""
    by_cta: dict[int, list] = {}
    for t in tasks:
        by_cta.setdefault(t["cta"], []).append(t)
    gaps: dict[str, list] = {"l1": [], "l2": [], "wgrad": []}
    late: dict[str, int] = {"l1": 0, "l2": 0, "wgrad": 0}
    for mine in by_cta.values():
        mine.sort(key=lambda t: t["got"])
        for prev, nxt in zip(mine, mine[1:]):
            gemm = kind(nxt)
            gaps[gemm].append(nxt["got"] - prev["epi_end"])
            late[gemm] += nxt["take"] > prev["epi_end"]
    out = {}
    for gemm, g in gaps.items():
        if not g:
            continue
        g.sort()
        out[gemm] = {"gaps": len(g), "sum_ns": sum(g), "median_ns": statistics.median(g),
                     "p90_ns": g[int(0.9 * (len(g) - 1))], "taken_late": late[gemm]}  # fmt: skip
    return out


def ceiling_ns_per_ktile() -> float:
    """One 128 x 256 x 64 k-tile on one SM at the floor model's BF16 ceiling
    (timing.H200_CEILINGS)."""
    from mok_megatron.testing.timing import H200_CEILINGS

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_sm = H200_CEILINGS.bf16_tflops * 1e12 / sms
    return 2 * TILE_M * TILE_N * TILE_K / per_sm * 1e9


def kind(task: dict) -> str:
    """A task record's GEMM: "l1" or "l2" (the pass's first or second), or "wgrad" (the
    backward's down-weight gradient; records without the key are not)."""
    return "wgrad" if task.get("wgrad") else "l2" if task["l2"] else "l1"


def summarise(ctas, tasks, k1, k2) -> dict:
    """``k1`` / ``k2``: the K of the pass's first and second GEMM."""
    k_tiles = {"l1": -(-k1 // TILE_K), "l2": -(-k2 // TILE_K)}
    split = split_time(ctas, tasks)
    cta_total = sum(split["cta_ns"].values())
    first_l1 = min((t["ready"] for t in tasks if t["l2"] is False), default=0)
    t0 = min(c["start"] for c in ctas)
    return {
        "span_us": split["span_ns"] / 1e3,
        "fractions": {k: v / cta_total for k, v in split["cta_ns"].items()},
        "tasks": {
            "l1": sum(t["l2"] is False for t in tasks),
            "l2": sum(t["l2"] is True for t in tasks),
            "wgrad": sum(bool(t.get("wgrad")) for t in tasks),
        },
        "first_l1_ready_us": (first_l1 - t0) / 1e3,
        "mainloop": ktile_times(tasks, k_tiles),
        "tile_classes": tile_classes(tasks, k_tiles),
        "gaps": gap_stats(tasks),
        "epilogue_median_ns": {
            g: statistics.median([t["epi_end"] - t["mma_end"] for t in tasks if kind(t) == g])
            for g in ("l1", "l2", "wgrad")
            if any(kind(t) == g for t in tasks)
        },  # fmt: skip
        "l1_epilogue_split_ns": l1_epilogue_split(tasks),
        "sm_ghz": sm_clock_ghz(ctas),
    }


def sm_clock_ghz(ctas: list) -> float | None:
    """The SMs' clock while the CTAs ran: the median over CTAs of their cycles (the SM's counter)
    over their nanoseconds, start to end; None where no record has the cycle stamps."""
    rates = [(c["end_cycles"] - c["start_cycles"]) / (c["end"] - c["start"]) for c in ctas
             if c.get("start_cycles", 0) > 0 and c.get("end_cycles", 0) > c.get("start_cycles", 0)
             and c["end"] > c["start"]]  # fmt: skip
    return statistics.median(rates) if rates else None


def l1_epilogue_split(tasks: list) -> dict | None:
    """The L1 epilogue in two (records with the ``stored`` stamp): the median from the mainloop's
    end until every consumer's stores were issued and fenced (their barrier passed), and from
    there until the task's flag was released; None where no L1 record has the stamp."""
    l1 = [t for t in tasks if kind(t) == "l1" and t.get("stored", 0) > 0]
    if not l1:
        return None
    return {"stores": statistics.median([t["stored"] - t["mma_end"] for t in l1]),
            "release": statistics.median([t["epi_end"] - t["stored"] for t in l1])}  # fmt: skip


def order_block(config, shape, args, ws, num_ctas):
    """The m-tiles per block of the forward's task order this case ran with: the knob, or what
    'auto' picked (ops.moe.moe_mega_order_block, as the op does at one rank); None for a
    backward (always 16)."""
    if args.backward:
        return None
    if config.megakernel_order_block != "auto":
        return config.megakernel_order_block
    from mok_megatron.ops import moe as mops

    hidden, inter, experts, topk = shape
    return mops.moe_mega_order_block(args.tokens * topk, experts, ws.buffers.mega.l1_ntiles,
                                     num_ctas)  # fmt: skip


def trace_case(name, args, rank) -> dict:
    shape = bench_moe.SHAPES[name]
    config = bench_moe.transformer_config(shape, "cuda")
    _, layer = bench_moe.build_layers(config, "cuda", args.tokens, "megakernel")
    runtime = layer.experts._layer_runtime
    knobs = {k: int(v) for k, v in (("fwd_num_comm_sms", args.fwd_num_comm_sms),
                                    ("minibatch_size", args.minibatch_size),
                                    ("megakernel_cluster", args.megakernel_cluster))
             if v is not None}  # fmt: skip
    if args.fp8:
        knobs["expert_precision"] = "fp8_blockwise"
    if args.fwd_rows is not None:
        knobs["fwd_rows"] = args.fwd_rows
    if args.order_block is not None:
        knobs["megakernel_order_block"] = (
            args.order_block if args.order_block == "auto" else int(args.order_block)
        )
    if args.bwd_wgrad is not None:
        knobs["bwd_wgrad"] = args.bwd_wgrad
    if knobs:
        runtime.mok_config = dataclasses.replace(runtime.mok_config, **knobs)
    sets = bench_moe.make_inputs(1, args.tokens, shape, args.routing, "cuda",
                                 config.params_dtype, 1234, rank)  # fmt: skip
    hidden, inter = shape[0], shape[1]
    ks = (hidden, 2 * inter) if args.backward else (hidden, inter)
    grad = contextlib.nullcontext() if args.keep or args.backward else torch.no_grad()
    with grad:
        bench_moe.run_layer(layer, sets[0], backward=args.backward)  # the workspace, warm
        ws = runtime.last_workspace
        ws.buffers.trace = True
        passes = []
        for _ in range(args.passes):
            bench_moe.run_layer(layer, sets[0], backward=args.backward)
            torch.cuda.synchronize()
            trace = ws.buffers.last_backward_trace if args.backward else ws.buffers.last_trace
            if trace[0].dim() == 3:  # a backward in rounds: one launch per round
                raise SystemExit(
                    "megakernel_trace: the backward ran in macrobatch rounds, one "
                    "launch each; trace a one-round pass (raise macrobatch_size)"
                )
            ctas, tasks = decode(*trace)
            annotate_rows(tasks, ws.buffers.last_tiles)
            passes.append(summarise(ctas, tasks, *ks))
            layer.zero_grad(set_to_none=True)
        ws.buffers.trace = False
    resolved = ws.config
    middle = sorted(passes, key=lambda s: s["span_us"])[len(passes) // 2]
    case = {"shape": name, "tokens_per_rank": args.tokens, "routing": args.routing,
            "keep": args.keep, "pass": "backward" if args.backward else "forward",
            "bwd_num_comm_sms": resolved.bwd_num_comm_sms,
            "fwd_num_comm_sms": resolved.fwd_num_comm_sms,
            "minibatch_size": resolved.minibatch_size, "num_ctas": len(ctas),
            "megakernel_cluster": resolved.megakernel_cluster,
            "bwd_wgrad": resolved.bwd_wgrad,
            "fwd_rows": resolved.fwd_rows,
            "megakernel_order_block": resolved.megakernel_order_block,
            "order_block": order_block(resolved, shape, args, ws, len(ctas)),
            "expert_precision": resolved.expert_precision,
            "span_us_passes": [s["span_us"] for s in passes], **middle}  # fmt: skip
    del layer, sets
    bench_moe._release_memory()
    return case


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, _ = bench_moe.init_distributed("cuda")
    record = {"benchmark": "megakernel_trace",
              "environment": bench_moe.environment(bench_moe.parse_args([])),
              "args": vars(args), "ceiling_ns_per_ktile": ceiling_ns_per_ktile(), "cases": []}  # fmt: skip
    for name in args.shapes.split(","):
        case = trace_case(name, args, rank)
        record["cases"].append(case)
        frac = ", ".join(f"{k} {v:.2f}" for k, v in case["fractions"].items())
        ml = case["mainloop"]
        print(f"{name} {args.tokens} (comm {case['fwd_num_comm_sms']}, minibatch "
              f"{case['minibatch_size']}): span {case['span_us']:.0f} us; {frac}; ns/k-tile "
              f"L1 {ml['l1']['median_ns_per_ktile']} L2 {ml['l2']['median_ns_per_ktile']} "
              f"(ceiling {record['ceiling_ns_per_ktile']:.0f}); epilogue "
              f"{case['epilogue_median_ns']} (L1 split {case['l1_epilogue_split_ns']}); SM GHz "
              f"{case['sm_ghz']}; first L1 ready {case['first_l1_ready_us']:.1f} us; "
              f"gaps before {case['gaps']}", flush=True)  # fmt: skip
        for gemm, classes in (case["tile_classes"] or {}).items():
            print(f"  {gemm} by m-tile rows: " + "; ".join(
                f"{c} {v['tasks']} tasks {v['rows']} rows, mainloop share "
                f"{v['mainloop_share'] or 0:.3f}, ns/k-tile {v['median_ns_per_ktile']}"
                for c, v in classes.items()), flush=True)  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
