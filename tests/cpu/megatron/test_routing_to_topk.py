"""``routing_to_topk``: Megatron's [T, E] routing map → MoK's [T, K] slots, checked against an
independent per-token loop (ascending expert ids, the first K kept, -1 / 0.0 for empty slots)."""

import pytest
import torch

from mok_megatron.megatron.token_dispatcher import routing_to_topk


def _oracle(probs: torch.Tensor, routing_map: torch.Tensor, topk: int):
    experts = torch.full((routing_map.shape[0], topk), -1, dtype=torch.int64)
    weights = torch.zeros(routing_map.shape[0], topk, dtype=torch.float32)
    for t in range(routing_map.shape[0]):
        ids = [e for e in range(routing_map.shape[1]) if routing_map[t, e]][:topk]
        for j, e in enumerate(ids):
            experts[t, j] = e
            weights[t, j] = float(probs[t, e])
    return experts, weights


@pytest.mark.parametrize(
    "tokens,experts,topk", [(7, 16, 4), (100, 256, 8), (33, 8, 2), (5, 4, 1), (64, 16, 3)]
)
def test_matches_per_token_loop(tokens, experts, topk):
    gen = torch.Generator().manual_seed(tokens * 1000 + experts)
    # About 1.5 K experts per token: some tokens have fewer than K (empty slots), some more.
    routing_map = torch.rand(tokens, experts, generator=gen) < 1.5 * topk / experts
    routing_map[0] = False  # a token routed nowhere
    routing_map[-1] = True  # a token routed everywhere: the first K ids are kept
    probs = torch.rand(tokens, experts, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    got = routing_to_topk(probs, routing_map, topk)
    want_experts, want_weights = _oracle(probs, routing_map, topk)
    assert got.topk_experts.dtype == torch.int64 and got.router_weights.dtype == torch.float32
    assert torch.equal(got.topk_experts, want_experts)
    assert torch.equal(got.router_weights, want_weights)
