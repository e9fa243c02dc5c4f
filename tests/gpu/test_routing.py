"""The CUDA ``routing_to_topk`` (one kernel, ``ops.moe.routing_to_topk``) against the torch ops it
replaces and an independent per-token loop: the same slots and weights bitwise, the same gradient
to the router's probabilities bitwise, outputs poisoned before the run, no host sync."""

from __future__ import annotations

import pytest
import torch

from mok_megatron import ops
from mok_megatron.megatron.token_dispatcher import routing_to_topk, routing_to_topk_torch
from mok_megatron.testing.poison import assert_fully_written, poisoned_memory

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not ops.has_op("routing_to_topk"),
        reason="needs a GPU and mok_megatron._C with routing_to_topk",
    ),
]

CASES = [(7, 16, 4), (1000, 256, 8), (333, 8, 2), (5, 4, 1), (640, 128, 8), (129, 40, 3)]


def _routing(tokens, experts, topk, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    # About 1.5 K experts per token: some tokens have fewer than K (empty slots), some more.
    routing_map = torch.rand(tokens, experts, generator=gen) < 1.5 * topk / experts
    routing_map[0] = False  # a token routed nowhere
    routing_map[-1] = True  # a token routed everywhere: the first K ids are kept
    probs = torch.rand(tokens, experts, generator=gen, dtype=torch.float64).to(dtype)
    return probs.cuda(), routing_map.cuda()


def _oracle(probs, routing_map, topk):
    probs, routing_map = probs.cpu(), routing_map.cpu()
    experts = torch.full((routing_map.shape[0], topk), -1, dtype=torch.int64)
    weights = torch.zeros(routing_map.shape[0], topk, dtype=torch.float32)
    for t in range(routing_map.shape[0]):
        for j, e in enumerate(routing_map[t].nonzero().flatten().tolist()[:topk]):
            experts[t, j] = e
            weights[t, j] = float(probs[t, e])
    return experts, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,experts,topk", CASES)
def test_matches_torch_ops_and_per_token_loop(tokens, experts, topk, dtype):
    probs, routing_map = _routing(tokens, experts, topk, dtype, seed=tokens + experts)
    with poisoned_memory():
        got = routing_to_topk(probs, routing_map, topk)
    assert_fully_written("topk_experts", got.topk_experts)
    assert_fully_written("router_weights", got.router_weights)
    want = routing_to_topk_torch(probs, routing_map, topk)
    assert torch.equal(got.topk_experts, want.topk_experts)
    assert torch.equal(got.router_weights, want.router_weights)
    want_experts, want_weights = _oracle(probs, routing_map, topk)
    assert torch.equal(got.topk_experts.cpu(), want_experts)
    assert torch.equal(got.router_weights.cpu(), want_weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_to_probs_equals_torch_ops(dtype):
    probs, routing_map = _routing(512, 64, 6, dtype, seed=5)
    d_weights = torch.randn(512, 6, device="cuda")
    grads = []
    for fn in (routing_to_topk, routing_to_topk_torch):
        p = probs.clone().requires_grad_()
        fn(p, routing_map, 6).router_weights.backward(d_weights)
        grads.append(p.grad)
    assert grads[0].dtype == dtype and torch.equal(grads[0], grads[1])
    assert grads[0][0].abs().sum() == 0  # the token routed nowhere gets no gradient


def test_no_host_sync_and_bitwise_repeats():
    probs, routing_map = _routing(4096, 128, 8, torch.float32, seed=9)
    first = routing_to_topk(probs, routing_map, 8)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = routing_to_topk(probs, routing_map, 8)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(first.topk_experts, again.topk_experts)
    assert torch.equal(first.router_weights, again.router_weights)


def test_bad_input_names_the_rule():
    probs, routing_map = _routing(8, 16, 2, torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="routing_map"):
        ops.moe.routing_to_topk(probs, routing_map.int(), 2)
    with pytest.raises(RuntimeError, match="probs"):
        ops.moe.routing_to_topk(probs[:, :8], routing_map, 2)
