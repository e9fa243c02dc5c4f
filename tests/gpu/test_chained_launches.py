"""Chained launches (``MoKConfig.chained_launches``, launch/chain.h) on one GPU.

With the knob on, the pass's kernels launch with programmatic stream serialization:
each may start while the kernel before it on the stream finishes and waits for it on the device
(``griddepcontrol.wait``). Only the launch order changes, so every output and gradient must be
bitwise those of plain stream order, on both CUDA paths (stage 1's kernel sequence, the
megakernels: in place, pulled, in macrobatch rounds, in clusters of two, with the down weight's
gradient in the backward launch, the FP8 forward), and with virtual ranks, whose W megakernels share the GPU's
SMs with the chained kernels of the other ranks' streams. The knob reaches the launch through the
workspace's ``comm`` list.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_cuda_backend import (
    SHAPES,
    Run,
    VirtualRuns,
    _bitwise_equal,
    _check_accuracy,
    _graph_check,
    _no_sync_check,
    _problem,
)
from test_fp8_experts_cuda import SHAPES as FP8_SHAPES
from test_megakernel_backward import MEGA

from mok_megatron import functional as F
from mok_megatron.functional.cuda.mega import unavailable_here
from mok_megatron.ops.moe import comm_field

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(unavailable_here()), reason=f"megakernel: {unavailable_here()}"),
]

CONFIGS = {
    "megakernel": MEGA,
    "megakernel_pull": dataclasses.replace(MEGA, fwd_rows="pull"),
    "megakernel_rounds": dataclasses.replace(MEGA, minibatch_size=128, macrobatch_size=256),
    "megakernel_clusters_of_2": dataclasses.replace(MEGA, megakernel_cluster=2),
    "megakernel_bwd_wgrad_down": dataclasses.replace(MEGA, bwd_wgrad="down"),
    "megakernel_fp8": dataclasses.replace(MEGA, expert_precision="fp8_blockwise"),
    "stage1": F.MoKConfig(cuda_forward="stage1"),
}


def _pass(problem, config, chained: bool):
    run = Run(problem, "cuda", config=dataclasses.replace(config, chained_launches=chained),
              form="fused_auto")  # fmt: skip
    assert comm_field(run.ws.buffers.comm, "chained") == int(chained)
    return run, run()[1]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chained_launches_give_the_bits_of_plain_stream_order(name):
    fp8 = CONFIGS[name].expert_precision != "bf16"  # FP8 needs whole 128-wide scale blocks
    problem = _problem([300], (FP8_SHAPES if fp8 else SHAPES)["qwen3-30b-a3b"], seed=53)
    _, plain = _pass(problem, CONFIGS[name], chained=False)
    run, chained = _pass(problem, CONFIGS[name], chained=True)
    if not fp8:  # FP8's bounds: test_megakernel_fp8.py's
        failures = _check_accuracy(problem, chained)
        assert not failures, failures
    bad = _bitwise_equal(plain, chained)
    assert not bad, f"chained launches differ from plain stream order in {bad}"
    for i in range(3):  # back to back: each pass's first kernels start beside the last pass's
        _, again = run()
        assert not _bitwise_equal(chained, again), f"chained pass {i + 2} differs"


def test_chained_launches_replay_from_a_graph_without_host_sync():
    problem = _problem([211], SHAPES["deepseek-v3"], seed=59)
    run, _ = _pass(problem, MEGA, chained=True)
    _graph_check(run)
    _no_sync_check(run)


@pytest.mark.parametrize("w", [2, 4])
def test_virtual_ranks_chained_give_the_bits_of_plain_stream_order(w):
    tokens = [150, 90, 33, 81][:w]
    problem = _problem(tokens, SHAPES["qwen3-30b-a3b"], seed=61)
    config = F.MoKConfig(cuda_forward="megakernel", fwd_num_comm_sms=4, bwd_num_comm_sms=4,
                         schedule_capacity_multiplier=float(w), minibatch_size=128)  # fmt: skip
    results = {}
    for chained in (False, True):
        vruns = VirtualRuns(problem, w, config=dataclasses.replace(config, chained_launches=chained),
                            form="fused_auto")  # fmt: skip
        assert all(comm_field(ws.buffers.comm, "chained") == int(chained)
                   for ws in vruns.workspaces)  # fmt: skip
        results[chained] = [vruns()[1] for _ in range(2)]
        del vruns
        torch.cuda.synchronize()
    for rank, plain in enumerate(results[False][0]):
        for i, got in enumerate(r[rank] for r in results[True]):
            bad = _bitwise_equal(plain, got)
            assert not bad, f"rank {rank}, chained pass {i + 1}: differs from plain in {bad}"
