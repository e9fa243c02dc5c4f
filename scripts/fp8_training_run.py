#!/usr/bin/env python
"""Train the tiny GPT-MoE twice from the same weights and data, MoK's experts in BF16 and in
blockwise FP8 (MoKConfig.expert_precision="fp8_blockwise"), and record both loss curves (issue
15, item 4).

    python scripts/fp8_training_run.py --out $OUT/fp8_training.json       (one GPU)
    python scripts/fp8_training_run.py --render docs/results/fp8_training_<gpu>_<commit>.json \\
        --png docs/fp8_training.png --md docs/FP8.md                         (plot and table)

The band: after the first ``BAND_FROM_STEP`` steps (the loss falls fast there and a small shift
in time is a large difference), every step's FP8 loss is within ``BAND_RELATIVE`` of the BF16
loss at that step. The record says whether it held; it is a measurement, not a check that
fails the run.

The noise floor: a third run, BF16 experts again from the same weights and data but with the
other expert-GEMM engine (``MoKConfig.expert_gemm``: the same bf16 arithmetic summed in another
order), measures how far two runs of equal precision drift apart on this config; the record
gives its gaps beside FP8's (beside the band, never instead of it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mok_megatron.testing.records import commit  # noqa: E402

#: The stated band: |loss_fp8 - loss_bf16| <= BAND_RELATIVE * loss_bf16 from BAND_FROM_STEP on.
BAND_RELATIVE = 0.02
BAND_FROM_STEP = 20
TABLE_BEGIN, TABLE_END = "<!-- fp8_training table begin -->", "<!-- fp8_training table end -->"


def rank_body(rank: int, world: int, run, ckpt: str) -> dict:
    """One rank: BF16 experts (saving the initial weights), then FP8 experts from them."""
    from mok_megatron.megatron.training import train

    del rank, world
    bf16 = train(run, "mok", save_initial_to=ckpt, progress=False)
    fp8_run = dataclasses.replace(run, mok=dataclasses.replace(run.mok,
                                                               expert_precision="fp8_blockwise"))  # fmt: skip
    fp8 = train(fp8_run, "mok", load_from=ckpt, progress=False)
    other = noise_floor_gemm(run.mok.expert_gemm)
    alt_run = dataclasses.replace(run, mok=dataclasses.replace(run.mok, expert_gemm=other))
    alt = train(alt_run, "mok", load_from=ckpt, progress=False)
    return {"bf16": bf16.losses, "fp8": fp8.losses, "bf16_other_gemm": alt.losses,
            "other_gemm": other, "seconds": [bf16.seconds, fp8.seconds, alt.seconds]}  # fmt: skip


def noise_floor_gemm(expert_gemm: str) -> str:
    """The noise-floor run's expert GEMM: torch's grouped GEMM, or the engine where the config
    already asks for torch's."""
    return "engine" if expert_gemm == "torch" else "torch"


def summarise(losses_bf16: list[float], losses_fp8: list[float]) -> dict:
    rel = [abs(f - b) / abs(b) for b, f in zip(losses_bf16, losses_fp8)]
    tail = rel[BAND_FROM_STEP:]
    return {
        "max_relative_gap": max(rel),
        "max_relative_gap_from_band_step": max(tail) if tail else None,
        "final_loss_bf16": losses_bf16[-1],
        "final_loss_fp8": losses_fp8[-1],
        "band_relative": BAND_RELATIVE,
        "band_from_step": BAND_FROM_STEP,
        "within_band": bool(tail) and max(tail) <= BAND_RELATIVE,
    }


def run_and_record(args) -> None:
    import torch

    from mok_megatron.megatron.yaml_config import load_run_config
    from mok_megatron.testing import run_ranks

    run = load_run_config(args.config)
    if args.steps:
        run = dataclasses.replace(run, training=dataclasses.replace(run.training,
                                                                    train_iters=args.steps))  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="mok_fp8_") as ckpt:
        result = run_ranks(rank_body, 1, run, ckpt, backend="nccl")[0]
    record = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit(),
        "config": {"file": args.config, "steps": len(result["bf16"])},
        "losses_bf16": result["bf16"], "losses_fp8": result["fp8"],
        "losses_bf16_other_gemm": result["bf16_other_gemm"], "other_gemm": result["other_gemm"],
        "seconds_bf16_fp8_other": result["seconds"], **summarise(result["bf16"], result["fp8"]),
        "noise_floor": summarise(result["bf16"], result["bf16_other_gemm"]),
    }  # fmt: skip
    if result["bf16_other_gemm"] == result["bf16"]:
        raise SystemExit("the noise-floor run repeated the BF16 run bit for bit: no floor")
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps({k: v for k, v in record.items() if not k.startswith("losses")}, indent=1))


#: The smoothed view (reported beside the stated band, never instead of it): moving averages
#: over this many steps, compared from BAND_FROM_STEP on.
SMOOTH_STEPS = 10


def smoothed_gap(losses_bf16: list[float], losses_fp8: list[float]) -> float:
    """The largest relative gap between the two curves' SMOOTH_STEPS-step moving averages."""

    def average(x):
        return [
            sum(x[i - SMOOTH_STEPS : i]) / SMOOTH_STEPS for i in range(SMOOTH_STEPS, len(x) + 1)
        ]

    b, f = average(losses_bf16), average(losses_fp8)
    start = max(0, BAND_FROM_STEP - SMOOTH_STEPS)
    return max(abs(y - x) / abs(x) for x, y in zip(b[start:], f[start:]))


def render(args) -> None:
    with open(args.render) as f:
        record = json.load(f)
    smooth = smoothed_gap(record["losses_bf16"], record["losses_fp8"])
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(record["losses_bf16"], label="MoK, BF16 experts")
        ax.plot(record["losses_fp8"], label="MoK, FP8 blockwise experts", linestyle="--")
        if "losses_bf16_other_gemm" in record:
            ax.plot(record["losses_bf16_other_gemm"], linestyle=":",
                    label=f"MoK, BF16 experts, expert_gemm={record['other_gemm']}")  # fmt: skip
        ax.set_xlabel("step")
        ax.set_ylabel("lm loss")
        ax.set_title(f"{record['config']['file']} on {record['gpu']} ({record['commit'][:7]})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
    table = "\n".join([
        f"Record: {record['gpu']}, torch {record['torch']}, commit `{record['commit'][:7]}`, "
        f"`{record['config']['file']}`, {record['config']['steps']} steps, the same initial "
        "weights and data.",
        "",
        "| final loss BF16 | final loss FP8 | largest relative gap (all steps) | largest from "
        f"step {record['band_from_step']} | band | within | {SMOOTH_STEPS}-step averages, "
        "largest gap |",
        "|---|---|---|---|---|---|---|",
        f"| {record['final_loss_bf16']:.4f} | {record['final_loss_fp8']:.4f} | "
        f"{record['max_relative_gap']:.2e} | {record['max_relative_gap_from_band_step']:.2e} | "
        f"{record['band_relative']:.0%} | {'yes' if record['within_band'] else 'no'} | "
        f"{smooth:.2e} |",
    ])  # fmt: skip
    if "noise_floor" in record:  # the BF16 run against BF16 with the other expert GEMM
        floor = record["noise_floor"]
        other = smoothed_gap(record["losses_bf16"], record["losses_bf16_other_gemm"])
        table += (
            f"\n| {record['final_loss_bf16']:.4f} | BF16, expert_gemm={record['other_gemm']}: "
            f"{floor['final_loss_fp8']:.4f} | {floor['max_relative_gap']:.2e} | "
            f"{floor['max_relative_gap_from_band_step']:.2e} | (noise floor) | - | {other:.2e} |"
        )
    if args.md:
        text = Path(args.md).read_text()
        head, rest = text.split(TABLE_BEGIN, 1)
        _, tail = rest.split(TABLE_END, 1)
        Path(args.md).write_text(f"{head}{TABLE_BEGIN}\n{table}\n{TABLE_END}{tail}")
    else:
        print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="configs/tiny_gpu_ep1_fp8.yaml")
    ap.add_argument("--steps", type=int, default=None, help="override training.train_iters")
    ap.add_argument("--out", help="the JSON record to write")
    ap.add_argument("--render", help="a record to plot / tabulate instead of training")
    ap.add_argument("--png")
    ap.add_argument("--md", help="with --render: the markdown file whose table to replace")
    args = ap.parse_args()
    if args.render:
        render(args)
    elif args.out:
        run_and_record(args)
    else:
        ap.error("give --out (train) or --render (plot a record)")


if __name__ == "__main__":
    main()
