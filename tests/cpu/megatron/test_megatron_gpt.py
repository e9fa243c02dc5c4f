"""A 2-layer Megatron-Core GPTModel (EP 2, gloo) trained a few steps with mok and with Megatron's
alltoall dispatcher, from the same weights (moved through a distributed checkpoint) and data:
the same losses. And the main script, end to end."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mok_megatron.megatron.training import replace_training
from mok_megatron.megatron.yaml_config import load_run_config
from mok_megatron.testing import run_ranks

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
STEPS = 4


def _train_rank(rank, world_size, run, root):
    """mok (fused and unfused experts) and alltoall on the same start and data."""
    from mok_megatron.megatron.training import train

    del rank, world_size
    losses = {}
    for fused in (True, False):
        variant = dataclasses.replace(
            run, layer=dataclasses.replace(run.layer, fused_experts=fused)
        )
        ckpt = os.path.join(root, f"fused_{fused}")
        losses[f"mok fused={fused}"] = train(
            variant, "mok", save_initial_to=ckpt, progress=False
        ).losses
        losses[f"alltoall fused={fused}"] = train(
            variant, "alltoall", load_from=ckpt, progress=False
        ).losses
    return losses


@pytest.fixture(scope="module")
def losses():
    run = replace_training(load_run_config(TINY), train_iters=STEPS)
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_ranks(_train_rank, 2, run, root)
    assert per_rank[0] == per_rank[1]  # every rank reports the same (reduced) loss
    return per_rank[0]


def test_fused_mok_trains_like_alltoall(losses):
    mok, ref = losses["mok fused=True"], losses["alltoall fused=True"]
    assert len(mok) == STEPS and mok[-1] < mok[0]
    assert max(abs(a - b) for a, b in zip(mok, ref)) < 1e-5, (mok, ref)


def test_unfused_mok_dispatch_trains_bitwise_like_alltoall(losses):
    """MoKTokenDispatcher + SequentialMLP runs the same float ops as alltoall + SequentialMLP."""
    assert losses["mok fused=False"] == losses["alltoall fused=False"]


def test_pretrain_script_compares_dispatchers():
    cmd = [sys.executable, str(ROOT / "scripts" / "pretrain_gpt_mok.py"), "--config", str(TINY),
           "--train-iters", "2", "--compare-dispatcher", "alltoall", "--no-progress"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "step    1/2  loss" in out and "step    2/2  loss" in out
    gap = out.split("largest |loss(mok) - loss(alltoall)| over 2 steps: ")[1].split()[0]
    assert float(gap) < 1e-5
