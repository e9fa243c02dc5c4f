"""Megatron's full activation recompute (``--recompute-granularity full``: each transformer
layer's forward run without gradients, rerun in the backward) with the mok dispatcher: a 2-layer
GPT-MoE (EP 2, gloo, the reference backend) trains from the same weights and data to the same
losses, bitwise, as without recompute, and its MoK layers' forwards did rerun.
tests/gpu/test_megatron_parity.py runs the same on the CUDA backend at EP 1 (the megakernels), and
the MoE-module recompute (``--recompute-modules moe``) layer by layer."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from mok_megatron.megatron.training import replace_training
from mok_megatron.megatron.yaml_config import load_run_config
from mok_megatron.testing import run_ranks

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
STEPS = 3


def _rank(rank, world_size, run, root):
    from mok_megatron.megatron.parity import full_recompute_losses

    del rank, world_size
    return full_recompute_losses(run, os.path.join(root, "start"))


def test_full_recompute_trains_bitwise_like_no_recompute():
    run = replace_training(load_run_config(TINY), train_iters=STEPS)
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_ranks(_rank, 2, run, root)
    got = per_rank[0]
    plain, recomputed, (calls, rerun_calls) = got["plain"], got["recomputed"], got["calls"]
    assert calls["layer"] > 0 and rerun_calls["layer"] == 2 * calls["layer"], got["calls"]
    assert len(plain) == STEPS and plain[-1] < plain[0]
    assert recomputed == plain, (recomputed, plain)
    assert per_rank[1]["plain"] == plain  # every rank reports the same (reduced) losses
