#!/usr/bin/env python3
"""Train with Megatron-LM's real ``pretrain_gpt.py`` (core_v0.19.0, tests/fixtures/) on one GPU,
alltoall against mok, and record the losses (issue 16, item 1).

    python scripts/megatron_lm_run.py --out docs/results/megatron_lm_h200_<commit>.json \\
        --md docs/MEGATRON_LM_RUN.md
    python scripts/megatron_lm_run.py --render docs/results/megatron_lm_h200_<commit>.json \\
        --md docs/MEGATRON_LM_RUN.md   # the table again from a record

Runs, each a fresh ``python -m mok_megatron.megatron.launch pretrain_gpt.py ...`` process with
the same tiny bf16 MoE GPT, seed and mock data:

1. ``fresh``: alltoall and mok each train ``--iters`` iterations from the same seed (MoKExperts
   draws the same initial weights as Megatron's experts);
2. ``checkpoint``: alltoall trains ``--warmup-iters`` and saves a checkpoint; alltoall and mok
   each load it with Megatron-LM's own ``load_checkpoint`` and train ``--iters`` more.

The record holds every iteration's ``lm loss`` as Megatron-LM logs it, per run, and the largest
relative gap between mok and alltoall per comparison; ``--md`` writes the loss table from it.
Exit status 1 if a run failed or printed no losses.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRETRAIN_GPT = ROOT / "tests" / "fixtures" / "megatron_lm_core_v0_19_0" / "pretrain_gpt.py"

# A small MoE GPT; the fused-kernel switches that need Apex are off (the fixture's README).
MODEL = (
    "--transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion "
    "--no-rope-fusion --num-layers 4 --hidden-size 256 --num-attention-heads 8 "
    "--seq-length 128 --max-position-embeddings 128 --micro-batch-size 4 --global-batch-size 4 "
    "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 256 --ffn-hidden-size 512 "
    "--swiglu --disable-bias-linear --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 1024 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --bf16 "
    "--log-interval 1 --eval-iters 0 --eval-interval 1000000 --seed 1234 "
    "--ckpt-format torch_dist"
).split()

LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.]+E[+-]\d+)")


def ensure_dataset_makefile() -> str | None:
    """Megatron-LM's start-up runs ``make`` in megatron/core/datasets; the megatron-core wheel
    ships the built helpers but not the Makefile. Writes a no-op one if it is missing (the
    fixture README); returns its path if written."""
    import megatron.core.datasets as datasets

    path = Path(datasets.__file__).parent / "Makefile"
    if path.exists():
        return None
    path.write_text("default:\n\t@true\n")
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name: str, dispatcher: str, train_iters: int, extra: list[str], logs: Path) -> dict:
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONWARNINGS": "ignore"}  # fmt: skip
    cmd = [sys.executable, "-m", "mok_megatron.megatron.launch", str(PRETRAIN_GPT), *MODEL,
           "--moe-token-dispatcher-type", dispatcher, "--train-iters", str(train_iters),
           *extra]  # fmt: skip
    began = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    log = logs / f"{name}.log"
    log.write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    losses = {int(i): float(v) for i, v in LOSS.findall(done.stdout)}
    ok = done.returncode == 0 and bool(losses)
    if not ok:
        print(f"{name}: exit {done.returncode}, {len(losses)} losses; tail of {log}:")
        print((done.stdout + done.stderr)[-3000:])
    return {"name": name, "dispatcher": dispatcher, "exit_code": done.returncode, "ok": ok,
            "seconds": round(time.time() - began, 1), "losses": losses,
            "command": " ".join(cmd[1:])}  # fmt: skip


def gap(a: dict, b: dict) -> float | None:
    """Largest |b - a| / |a| over the iterations both logged."""
    common = sorted(set(a["losses"]) & set(b["losses"]))
    if not common:
        return None
    return max(abs(b["losses"][i] - a["losses"][i]) / abs(a["losses"][i]) for i in common)


def environment() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "python": sys.version.split()[0], "commit": os.environ.get("MOK_COMMIT"),
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    from megatron.core.package_info import __version__

    info["megatron_core"] = __version__
    return info


def markdown(record: dict) -> str:
    # JSON keys are strings: iterations back to ints
    runs = {r["name"]: {**r, "losses": {int(i): v for i, v in r["losses"].items()}}
            for r in record["runs"]}  # fmt: skip
    lines = [
        "# Megatron-LM's pretrain_gpt.py with MoK (generated)",
        "",
        "Generated by `scripts/megatron_lm_run.py` from "
        f"`{record['record']}`; do not edit by hand. Megatron-LM core_v0.19.0's own "
        "`pretrain_gpt.py` (tests/fixtures/, unmodified) through `python -m "
        "mok_megatron.megatron.launch`, one process per run.",
        "",
        f"- {record['environment'].get('gpu')}, torch {record['environment']['torch']}, "
        f"megatron-core {record['environment']['megatron_core']}, commit "
        f"`{record['environment'].get('commit')}`, {record['environment']['utc']}",
        f"- model flags: `{' '.join(record['model_flags'])}`",
        "",
    ]
    for comp in record["comparisons"]:
        a, b = runs[comp["alltoall"]], runs[comp["mok"]]
        lines += [f"## {comp['name']}: {comp['what']}", "",
                  f"Largest relative loss gap: {comp['max_rel_gap']:.2e}" if comp["max_rel_gap"]
                  is not None else "No common iterations.", "",
                  "| iteration | alltoall lm loss | mok lm loss | relative gap |",
                  "|---|---|---|---|"]  # fmt: skip
        for i in sorted(set(a["losses"]) & set(b["losses"])):
            la, lb = a["losses"][i], b["losses"][i]
            lines.append(f"| {i} | {la:.6f} | {lb:.6f} | {abs(lb - la) / abs(la):.2e} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="the JSON record (required unless --render)")
    p.add_argument(
        "--render", default=None, help="only write --md from this existing record (no runs)"
    )
    p.add_argument("--md", default=None, help="also write the loss table (markdown) here")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup-iters", type=int, default=10)
    p.add_argument("--logs", default=None, help="folder for each run's output (default: a temp)")
    args = p.parse_args(argv)
    if args.render:
        Path(args.md).write_text(markdown(json.loads(Path(args.render).read_text())) + "\n")
        return 0
    if not args.out:
        p.error("--out is required")
    logs = Path(args.logs or tempfile.mkdtemp(prefix="megatron_lm_"))
    logs.mkdir(parents=True, exist_ok=True)
    makefile = ensure_dataset_makefile()
    ckpt = Path(tempfile.mkdtemp(prefix="megatron_lm_ckpt_"))
    total = args.warmup_iters + args.iters
    saving = ["--save", str(ckpt), "--save-interval", str(args.warmup_iters)]
    loading = ["--load", str(ckpt), "--no-load-optim", "--no-load-rng"]
    runs = [
        run("fresh_alltoall", "alltoall", args.iters, [], logs),
        run("fresh_mok", "mok", args.iters, [], logs),
        run("save_alltoall", "alltoall", args.warmup_iters, saving, logs),
    ]
    runs += [
        run("ckpt_alltoall", "alltoall", total, loading, logs),
        run("ckpt_mok", "mok", total, loading, logs),
    ]
    by = {r["name"]: r for r in runs}
    comparisons = [
        {"name": "fresh", "what": f"{args.iters} iterations from the same seed",
         "alltoall": "fresh_alltoall", "mok": "fresh_mok"},
        {"name": "checkpoint", "what": f"{args.iters} iterations from an alltoall checkpoint "
         f"saved at iteration {args.warmup_iters} (weights only: --no-load-optim)",
         "alltoall": "ckpt_alltoall", "mok": "ckpt_mok"},
    ]  # fmt: skip
    for comp in comparisons:
        comp["max_rel_gap"] = gap(by[comp["alltoall"]], by[comp["mok"]])
    record = {"suite": "megatron_lm_pretrain_gpt", "record": os.path.basename(args.out),
              "environment": environment(), "model_flags": MODEL, "iters": args.iters,
              "warmup_iters": args.warmup_iters, "dataset_makefile_written": makefile,
              "runs": runs, "comparisons": comparisons}  # fmt: skip
    Path(args.out).write_text(json.dumps(record, indent=1))
    if args.md:
        Path(args.md).write_text(markdown(record) + "\n")
    for comp in comparisons:
        print(f"{comp['name']}: max relative loss gap {comp['max_rel_gap']}")
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
