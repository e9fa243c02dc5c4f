#!/usr/bin/env python3
"""Sweep the megakernels' knobs on the GPU it runs on and write the tuned table.

For each benchmark shape (the layers, weights and routing of scripts/bench_moe.py) it times the
MoK layer's forward with ``cuda_forward='megakernel'`` under every (fwd_num_comm_sms,
minibatch_size) pair, then, at the shape's best pair, its forward + backward (the backward
megakernel, ``cuda_backward='auto'``) under every ``bwd_num_comm_sms``; and writes
``mok_megatron/tuned/<gpu>_ep<N>.yaml`` (the table MoKConfig's "auto" knobs read on that GPU and
EP size): a ``mok:`` section with the forward pair and the backward's comm SMs that are best on
the geometric mean over the shapes (usable as ``--mok-config`` or ``MoKConfig.from_yaml``) and,
per shape (with its dimensions), its own best knobs and times: a layer of one of those shapes
resolves its "auto" knobs from its own entry, any other from ``mok:``. The full sweep goes to the
JSON record (``--out``).

With ``--fp8`` it sweeps the FP8 megakernel's forward instead (``expert_precision='fp8_blockwise'``,
``cuda_forward='megakernel'``; no backward sweep: FP8's backward is stage 1's) and adds to the
table's BF16 entries, which it keeps: an ``fp8_blockwise:`` section (the forward pair best on the
geometric mean) and an ``fp8_blockwise:`` entry in each swept shape's. A layer with FP8 experts
reads its forward knobs from those (MoKConfig.resolve), its other knobs as a BF16 layer does.

The pair sweep pulls the rows (``fwd_rows='pull'``: at one rank rows read in place leave no SM
to the pulls, so the comm SMs would change nothing). At one rank, ``--rows`` then times each
shape's forward at its tuned knobs with the rows pulled and read in place, and writes the faster
into its entry as ``fwd_rows`` (and the one faster on the geometric mean into ``mok:``; with
``--fp8`` into the FP8 entries): MoKConfig's ``fwd_rows='auto'`` pulls where the table says
'pull' (MoKConfig.resolve). A later pair sweep keeps these entries; run ``--rows`` again after it.

  python3 scripts/tune.py --out docs/results/tune_h200_ep1.json          # one GPU: EP 1
  torchrun --standalone --nproc-per-node 2 scripts/tune.py --out ...     # EP 2
  python3 scripts/tune.py --fp8 --out docs/results/tune_fp8_h200_ep1.json    # then FP8's
  python3 scripts/tune.py --rows --out docs/results/tune_rows_h200_ep1.json  # then the rows (EP 1)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_moe  # noqa: E402

from mok_megatron.functional.config import (  # noqa: E402
    FORWARD_TUNED_KNOBS,
    LayerDims,
    _tuned_knobs,
    tuned_table_path,
)

#: The forward rows --rows compares (MoKConfig.fwd_rows).
ROWS = ("pull", "in_place")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(bench_moe.SHAPES))
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--comm-sms", default="2,4,8,16,20")
    p.add_argument("--minibatch", default="256,1024,4096")
    p.add_argument("--bwd-comm-sms", default="8,16,20,32",
                   help="bwd_num_comm_sms values, timed by forward + backward")  # fmt: skip
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--out", required=True, help="JSON record of the sweep")
    p.add_argument(
        "--fp8",
        action="store_true",
        help="sweep the FP8 megakernel's forward and add its knobs to the table (see above)",
    )
    p.add_argument(
        "--rows",
        action="store_true",
        help="one rank: time each shape's forward (with --fp8 the FP8 megakernel's) at its tuned "
        "knobs with fwd_rows 'pull' and 'in_place', and write the faster into the table",
    )
    p.add_argument(
        "--table", default=None, help="YAML table (default mok_megatron/tuned/<gpu>_ep<N>.yaml)"
    )
    return p.parse_args(argv)


def _pair(key: str) -> tuple[int, int]:
    """A sweep point's key "comm,minibatch" as (fwd_num_comm_sms, minibatch_size)."""
    comm, mini = map(int, key.split(","))
    return comm, mini


def _shape_layer(name, args, rank):
    """The megakernel layer of a benchmark shape and two sets of its inputs."""
    shape = bench_moe.SHAPES[name]
    config = bench_moe.transformer_config(shape, "cuda")
    _, layer = bench_moe.build_layers(config, "cuda", args.tokens, "megakernel")
    sets = bench_moe.make_inputs(2, args.tokens, shape, "uniform", "cuda", config.params_dtype,
                                 1234, rank)  # fmt: skip
    return layer, sets


def _time_forward(layer, sets, args) -> float:
    from mok_megatron.testing.timing import time_fn

    with torch.no_grad():
        t = time_fn(lambda i: bench_moe.run_layer(layer, sets[i % 2], backward=False),
                    warmup=args.warmup, iters=args.iters, device="cuda")  # fmt: skip
    bench_moe._release_memory()
    return _slowest_rank(t.median_ms)


def sweep_shape(name, args, points, rank) -> dict:
    from mok_megatron.testing.timing import time_fn

    layer, sets = _shape_layer(name, args, rank)
    runtime = layer.experts._layer_runtime
    default = runtime.mok_config
    knobs = bench_moe.MOK_FP8_MEGA_KNOBS if args.fp8 else {"cuda_forward": "megakernel"}
    times = {}
    for comm, mini in points:
        runtime.mok_config = dataclasses.replace(default, **knobs, fwd_num_comm_sms=comm,
                                                 minibatch_size=mini, fwd_rows="pull")  # fmt: skip
        times[f"{comm},{mini}"] = _time_forward(layer, sets, args)
    best = min(times, key=times.get)
    comm, mini = _pair(best)
    if args.fp8:  # FP8's backward is stage 1's: no backward knob to sweep
        runtime.mok_config = default
        return {"shape": name, "tokens_per_rank": args.tokens, "precision": "fp8_blockwise",
                "forward_ms": times, "best": best}  # fmt: skip
    # The backward's comm SMs, each timed by forward + backward at the forward's best pair: the
    # forward is the same in every point, so the differences are the backward megakernel's.
    bwd_times = {}
    for bwd_comm in (int(v) for v in args.bwd_comm_sms.split(",")):
        runtime.mok_config = dataclasses.replace(default, cuda_forward="megakernel",
                                                 fwd_num_comm_sms=comm, minibatch_size=mini,
                                                 bwd_num_comm_sms=bwd_comm)  # fmt: skip
        t = time_fn(lambda i: bench_moe.run_layer(layer, sets[i % 2], backward=True),
                    warmup=args.warmup, iters=args.iters, device="cuda")  # fmt: skip
        bwd_times[str(bwd_comm)] = _slowest_rank(t.median_ms)
        bench_moe._release_memory()
    runtime.mok_config = default
    return {"shape": name, "tokens_per_rank": args.tokens, "forward_ms": times, "best": best,
            "fwd_bwd_ms": bwd_times, "bwd_best": min(bwd_times, key=bwd_times.get)}  # fmt: skip


def sweep_rows(name, args, rank, table) -> dict:
    """The forward of shape ``name`` at the table's knobs for it, its rows pulled and in place."""
    layer, sets = _shape_layer(name, args, rank)
    runtime = layer.experts._layer_runtime
    default = runtime.mok_config
    precision = "fp8_blockwise" if args.fp8 else "bf16"
    knobs = bench_moe.MOK_FP8_MEGA_KNOBS if args.fp8 else {"cuda_forward": "megakernel"}
    tuned = _tuned_knobs(table, LayerDims(*bench_moe.SHAPES[name][:4]), precision)
    times = {}
    for rows in ROWS:
        runtime.mok_config = dataclasses.replace(default, **knobs, **tuned, fwd_rows=rows)
        times[rows] = _time_forward(layer, sets, args)
    runtime.mok_config = default
    return {"shape": name, "tokens_per_rank": args.tokens, "precision": precision,
            "knobs": tuned, "fwd_rows_ms": times, "best": min(times, key=times.get)}  # fmt: skip


def write_rows(path, record) -> None:
    """Write the --rows sweep's choices into the table at ``path``: ``fwd_rows`` and the two
    times in each swept shape's entry (with FP8 in its ``fp8_blockwise:`` entry), and the rows
    faster on the geometric mean in ``mok:`` (FP8: ``fp8_blockwise:``). Every other entry is
    kept as it is."""
    head, table = _read_table(path, "fwd_rows", "the pair sweep")
    cases = record["cases"]
    fp8 = any(c["precision"] == "fp8_blockwise" for c in cases)
    shapes = table.get("shapes") or {}
    for c in cases:
        if c["shape"] not in shapes:
            raise SystemExit(f"{path}: no entry for {c['shape']}; run the pair sweep of that "
                             "shape first")  # fmt: skip
        entry = shapes[c["shape"]]
        if fp8:
            entry = entry.setdefault("fp8_blockwise", {})
        entry["fwd_rows"] = c["best"]
        entry["fwd_rows_ms"] = {r: round(ms, 4) for r, ms in c["fwd_rows_ms"].items()}
    section = table.setdefault("fp8_blockwise", {}) if fp8 else table.setdefault("mok", {})
    section["fwd_rows"] = _geomean_best(cases, "fwd_rows_ms", ROWS)
    env = record["environment"]
    table["rows_tuned_on"] = {"commit": env["commit"], "utc": env["utc"],
                              "record": os.path.basename(record["path"])}  # fmt: skip
    _write_kept_head(path, head, table)


def _read_table(path, what: str, first: str) -> tuple[str, dict]:
    """A table another sweep wrote, to add ``what`` to: its comment lines and its contents; an
    error naming the sweep to run ``first`` where there is none."""
    import yaml

    if not os.path.isfile(path):
        raise SystemExit(f"{path}: no tuned table to add {what} to; run {first} first")
    with open(path) as f:
        text = f.read()
    head = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    return head, yaml.safe_load(text) or {}


def _write_kept_head(path, head: str, table: dict) -> None:
    """Write ``table`` to ``path`` under the comment lines it had (``_read_table``)."""
    import yaml

    with open(path, "w") as f:
        f.write(head)
        yaml.safe_dump(table, f, sort_keys=False)


def _slowest_rank(ms: float) -> float:
    worst = torch.tensor([ms], device="cuda")
    if dist.get_world_size() > 1:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())


def _geomean_best(cases, field: str, keys) -> str:
    """The key of ``field``'s times that is best on the geometric mean over the shapes."""
    geo = {k: math.exp(sum(math.log(c[field][k]) for c in cases) / len(cases)) for k in keys}
    return min(geo, key=geo.get)


def write_fp8_entries(path, record, points) -> None:
    """Add the FP8 sweep's knobs to the table at ``path`` (written by a BF16 sweep first): an
    ``fp8_blockwise:`` section and one in each swept shape's entry (added if the table lacks the
    shape); every other entry is kept as it is."""
    head, table = _read_table(path, "FP8 knobs", "the BF16 sweep")
    cases = record["cases"]
    comm, mini = _pair(_geomean_best(cases, "forward_ms", [f"{c},{m}" for c, m in points]))
    env = record["environment"]
    table["fp8_blockwise"] = {
        "fwd_num_comm_sms": comm, "minibatch_size": mini,
        "tuned_on": {"commit": env["commit"], "utc": env["utc"],
                     "record": os.path.basename(record["path"])},
    }  # fmt: skip
    shapes = table.setdefault("shapes", {})
    for c in cases:
        entry = shapes.setdefault(c["shape"], {
            **dict(zip(LayerDims._fields, bench_moe.SHAPES[c["shape"]])),
            "tokens_per_rank": c["tokens_per_rank"],
        })  # fmt: skip
        entry["fp8_blockwise"] = {
            **dict(zip(FORWARD_TUNED_KNOBS, _pair(c["best"]))),
            "forward_ms": round(c["forward_ms"][c["best"]], 4),
        }  # fmt: skip
    _write_kept_head(path, head, table)


def write_table(path, record, points) -> None:
    import yaml

    cases = record["cases"]
    comm, mini = _pair(_geomean_best(cases, "forward_ms", [f"{c},{m}" for c, m in points]))
    bwd_comm = int(_geomean_best(cases, "fwd_bwd_ms", list(cases[0]["fwd_bwd_ms"])))
    env = record["environment"]
    table = {
        "mok": {"cuda_forward": "megakernel", "fwd_num_comm_sms": comm, "minibatch_size": mini,
                "bwd_num_comm_sms": bwd_comm},
        "tuned_on": {"gpu": env.get("gpu"), "ep": env["world_size"], "commit": env["commit"],
                     "utc": env["utc"], "record": os.path.basename(record["path"])},
        "shapes": {
            c["shape"]: {
                **dict(zip(LayerDims._fields, bench_moe.SHAPES[c["shape"]])),
                "tokens_per_rank": c["tokens_per_rank"],
                **dict(zip(FORWARD_TUNED_KNOBS, _pair(c["best"]))),
                "forward_ms": round(c["forward_ms"][c["best"]], 4),
                "bwd_num_comm_sms": int(c["bwd_best"]),
                "fwd_bwd_ms": round(c["fwd_bwd_ms"][c["bwd_best"]], 4),
            }
            for c in cases
        },
    }  # fmt: skip
    old = {}
    if os.path.isfile(path):
        with open(path) as f:
            old = yaml.safe_load(f) or {}
    # An FP8 sweep's entries (write_fp8_entries) and a rows sweep's (write_rows) stay.
    kept = ("fwd_rows", "fwd_rows_ms", "fp8_blockwise")
    if "fwd_rows" in old.get("mok", {}):
        table["mok"]["fwd_rows"] = old["mok"]["fwd_rows"]
    for name in ("fp8_blockwise", "rows_tuned_on"):
        if name in old:
            table[name] = old[name]
    for name, entry in (old.get("shapes") or {}).items():
        for key in kept:
            if key in entry:
                table["shapes"].setdefault(name, dict(entry))
                table["shapes"][name][key] = entry[key]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("# Written by scripts/tune.py: the megakernels' knobs on this GPU and EP size.\n"
                "# `mok:` holds the best on the geometric mean over the shapes, `shapes:` each "
                "shape's own. MoKConfig's 'auto'\n# knobs (fwd_num_comm_sms, minibatch_size, "
                "bwd_num_comm_sms) on this GPU and EP size read the entry\n# of the layer's shape "
                "where there is one, else `mok:`; as --mok-config `mok:` also selects the "
                "megakernel.\n")  # fmt: skip
        yaml.safe_dump(table, f, sort_keys=False)


def _write_record(record) -> None:
    with open(record["path"], "w") as f:
        json.dump(record, f, indent=1)


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, world = bench_moe.init_distributed("cuda")
    points = [(int(c), int(m)) for c in args.comm_sms.split(",") for m in args.minibatch.split(",")]
    record = {"benchmark": "tune", "environment": bench_moe.environment(bench_moe.parse_args([])),
              "args": vars(args), "cases": [], "path": args.out}  # fmt: skip
    table = args.table or str(tuned_table_path(torch.device("cuda"), world))
    if args.rows and world != 1:
        raise SystemExit("--rows compares the rows pulled and read in place, which only one rank "
                         "can read: run it on one GPU")  # fmt: skip
    for name in args.shapes.split(","):
        if args.rows:
            case = sweep_rows(name, args, rank, Path(table))
            record["cases"].append(case)
            print(f"{name}: {case['precision']} forward at {case['knobs']}: "
                  f"{case['fwd_rows_ms']} ms: {case['best']}", flush=True)  # fmt: skip
            _write_record(record)  # after each shape: a run cut short keeps what it timed
            continue
        record["cases"].append(sweep_shape(name, args, points, rank))
        if rank == 0:
            case = record["cases"][-1]
            if args.fp8:
                print(f"{name}: FP8 forward: best (fwd_num_comm_sms, minibatch_size) = "
                      f"({case['best']}): {case['forward_ms'][case['best']]:.3f} ms; all: "
                      f"{case['forward_ms']}", flush=True)  # fmt: skip
                continue
            print(f"{name}: best (fwd_num_comm_sms, minibatch_size) = ({case['best']}): "
                  f"{case['forward_ms'][case['best']]:.3f} ms; fallback (16,256): "
                  f"{case['forward_ms'].get('16,256', float('nan')):.3f} ms; best "
                  f"bwd_num_comm_sms = {case['bwd_best']}: forward + backward "
                  f"{case['fwd_bwd_ms'][case['bwd_best']]:.3f} ms", flush=True)  # fmt: skip
    if rank == 0:
        _write_record(record)
        if args.rows:
            write_rows(table, record)
        else:
            (write_fp8_entries if args.fp8 else write_table)(table, record, points)
        print(f"wrote {args.out} and {table}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
