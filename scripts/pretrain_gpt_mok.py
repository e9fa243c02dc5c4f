#!/usr/bin/env python
"""Train a Megatron-Core GPT-MoE with ``--moe-token-dispatcher-type mok`` on mock data.

    python scripts/pretrain_gpt_mok.py --config configs/tiny_cpu.yaml
    python scripts/pretrain_gpt_mok.py --config configs/tiny_cpu.yaml --compare-dispatcher alltoall
    torchrun --nproc-per-node 8 scripts/pretrain_gpt_mok.py --config configs/examples/<model>.yaml

Without torchrun it starts its own ranks (``parallelism`` in the YAML sets how many): gloo on
CPU, NCCL on GPUs. It prints the loss of every step under a progress bar; with
``--compare-dispatcher alltoall`` it then trains the same model from the same weights (moved
through a distributed checkpoint) and data with Megatron's dispatcher and prints the largest loss
difference over the steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

# Megatron warns at import that optional accelerators (TE, Apex, absl) are missing; on a CPU demo
# that is expected, so hide those lines here and in the ranks this script spawns.
_QUIET = (
    "ignore:Transformer Engine and Apex are not installed:UserWarning",
    "ignore:Apex is not installed:UserWarning",
    "ignore:absl.logging is not installed:UserWarning",
    "ignore:full scope is deprecated:UserWarning",
)
os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), *_QUIET]))
for _rule in _QUIET:
    _action, _message, _category = _rule.split(":")
    warnings.filterwarnings(_action, message=_message, category=UserWarning)

from mok_megatron.megatron.training import PretrainOptions, pretrain_rank  # noqa: E402
from mok_megatron.megatron.yaml_config import load_run_config  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", required=True, help="run file (model/parallelism/training/mok)")
    p.add_argument(
        "--compare-dispatcher",
        choices=("alltoall", "allgather"),
        default=None,
        help="also train with this Megatron dispatcher and print the largest loss gap",
    )
    p.add_argument("--train-iters", type=int, default=None, help="override training.train_iters")
    p.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default=None, help="override training.device"
    )
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="shared directory for the comparison's initial weights (default: a "
        "temporary one; multi-node runs must pass a shared path)",
    )
    p.add_argument("--no-progress", action="store_true", help="plain output, no progress bar")
    return p.parse_args(argv)  # fmt: skip


def load_run(args: argparse.Namespace):
    run = load_run_config(args.config)
    changes = {}
    if args.train_iters is not None:
        changes["train_iters"] = args.train_iters
    if args.device is not None:
        changes["device"] = args.device
    if changes:
        run = dataclasses.replace(run, training=dataclasses.replace(run.training, **changes))
    return run


def print_summary(run, report) -> None:
    main = report.main
    tokens = run.training.micro_batch_size * run.gpt("seq_length") * len(main.losses)
    rate = tokens / main.seconds
    print(
        f"[mok] {len(main.losses)} steps, loss {main.losses[0]:.4f} -> {main.losses[-1]:.4f}, "
        f"{main.seconds:.1f} s ({rate:.0f} tokens/s per data-parallel rank)"
    )
    if report.compare is not None:
        gap = report.max_loss_difference()
        print(
            f"[{report.compare.dispatcher}] loss {report.compare.losses[-1]:.4f}, "
            f"{report.compare.seconds:.1f} s"
        )
        print(
            f"largest |loss(mok) - loss({report.compare.dispatcher})| over "
            f"{len(main.losses)} steps: {gap:.3e}"
        )


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_torchrun(run, options: PretrainOptions):
    """One rank of a torchrun / SLURM launch."""
    import torch
    import torch.distributed as dist

    cuda = run.training.resolved_device() == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    expected = run.parallelism.world_size()
    if run.parallelism.data_parallel_size is not None and dist.get_world_size() != expected:
        raise SystemExit(
            f"{run.path}: parallelism asks for {expected} ranks (TP x CP x PP x DP) but torchrun "
            f"started {dist.get_world_size()}; fix data_parallel_size or the launch"
        )
    try:
        if options.compare_dispatcher and options.checkpoint_dir is None:
            shared = [tempfile.mkdtemp(prefix="mok_compare_") if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(shared, src=0)
            options = dataclasses.replace(options, checkpoint_dir=shared[0])
        report = pretrain_rank(dist.get_rank(), dist.get_world_size(), run, options)
        if dist.get_rank() == 0:
            print_summary(run, report)
    finally:
        dist.destroy_process_group()


def run_spawned(run, options: PretrainOptions):
    """Start ``parallelism``'s world size of local ranks and report rank 0's result."""
    from mok_megatron.testing import run_ranks

    world = run.parallelism.world_size()
    backend = "nccl" if run.training.resolved_device() == "cuda" else "gloo"
    print(f"[mok] starting {world} {backend} rank(s) for {run.path}")
    with tempfile.TemporaryDirectory(prefix="mok_compare_") as tmp:
        options = dataclasses.replace(options, checkpoint_dir=options.checkpoint_dir or tmp)
        reports = run_ranks(pretrain_rank, world, run, options, backend=backend)
    print_summary(run, reports[0])


def main(argv=None) -> None:
    args = parse_args(argv)
    run = load_run(args)
    options = PretrainOptions(
        compare_dispatcher=args.compare_dispatcher, checkpoint_dir=args.checkpoint_dir,
        progress=not args.no_progress,
    )  # fmt: skip
    if under_torchrun():
        run_torchrun(run, options)
    else:
        run_spawned(run, options)


if __name__ == "__main__":
    main()
