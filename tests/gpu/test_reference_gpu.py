"""The reference backend keeps the rules on a GPU too: no host sync, CUDA-graph capturable,
bitwise repeatable, and equal to the float64 oracle (one GPU, EP = 1)."""

from __future__ import annotations

import pytest
import torch

from mok_megatron import functional as F
from mok_megatron.testing import random_moe_problem, relative_error
from mok_megatron.testing.runs import GRAD_NAMES, run_oracle

pytestmark = pytest.mark.gpu


def _setup(dtype):
    problem = random_moe_problem([300], 64, 96, 8, 2, shared_inter=32, empty_slot_fraction=0.1)
    config = F.MoKConfig()
    ws = F.create_workspace(config, None, device="cuda", num_local_tokens=300, hidden_size=64,
                            topk=2, num_experts=8, intermediate_size=96, dtype=dtype,
                            backend="reference")  # fmt: skip
    x, topk, rw, routed, shared = problem.local(0, dtype=dtype, device="cuda")
    return problem, config, ws, x, topk, rw, (*shared, *routed)


def _pass(config, ws, x, topk, rw, weights, d_out):
    sched = F.build_schedule(ws, config, topk, ws.num_local_experts)
    out, ctx = F.forward(config, ws, sched, x, rw, *weights)
    return (out, *F.backward(config, ws, sched, ctx, d_out, x, rw, *weights))


def test_reference_on_gpu_matches_oracle_without_host_sync():
    problem, config, ws, x, topk, rw, weights = _setup(torch.float32)
    d_out = torch.randn_like(x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _pass(config, ws, x, topk, rw, weights, d_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = run_oracle(problem, d_out.double().cpu())
    assert relative_error(got[0].cpu(), want["out"]) < 1e-5
    for name, value in zip(GRAD_NAMES, got[1:]):
        assert relative_error(value.cpu(), want[name]) < 1e-5, name
    ws.check_errors()


def test_reference_pass_replays_in_a_cuda_graph_bitwise():
    _, config, ws, x, topk, rw, weights = _setup(torch.bfloat16)
    d_out = torch.randn_like(x)
    eager = _pass(config, ws, x, topk, rw, weights, d_out)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _pass(config, ws, x, topk, rw, weights, d_out)  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _pass(config, ws, x, topk, rw, weights, d_out)
    for _ in range(3):
        for t in captured:
            if t is not None:
                t.fill_(float("nan"))  # poison: the replay must rewrite every output
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(eager, captured):
            assert (a is None and b is None) or torch.equal(a, b)
    ws.check_errors()
