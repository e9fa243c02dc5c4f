"""``MoKTokenDispatcher``: Megatron's six dispatcher hooks, for MoK's fused experts or Megatron's.

Two modes, picked by ``MoKMoELayer`` from its experts:

- **fused** (``MoKExperts``): the dispatcher moves nothing. It turns the router's output into
  ``topk_experts`` / ``router_weights`` and hands the local tokens to the experts, which dispatch,
  compute and combine in one ``functional.moe`` call.
- **unfused** (Megatron's ``SequentialMLP`` / ``TEGroupedMLP``): a deterministic all-to-all.
  Rows arrive sorted by (local expert, source rank, source token), the order Megatron's alltoall
  dispatcher produces, with ``tokens_per_expert`` left on the device (the experts read it on the
  host, as they do with every dispatcher). The all-to-all needs its split sizes on the host: one
  device-to-host copy of a ``[2, EP]`` tensor per forward, as in Megatron's alltoall. The combine
  puts every row back in its (token, slot) place and sums the slots in slot order.

No float atomics anywhere, so outputs and gradients are bitwise reproducible run to run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from mok_megatron import ops
from mok_megatron.ops import moe as mops

__all__ = ["MoKRouting", "MoKTokenDispatcher", "routing_to_topk", "routing_to_topk_torch"]


@dataclass
class MoKRouting:
    """The router's choice for the local tokens, in MoK's form.

    topk_experts: [T, K] int64, global expert ids ascending per token, -1 = empty slot;
    router_weights: [T, K] float32, 0 where the slot is empty (differentiable to the router).
    """

    topk_experts: torch.Tensor
    router_weights: torch.Tensor


def routing_to_topk(probs: torch.Tensor, routing_map: torch.Tensor, topk: int) -> MoKRouting:
    """Megatron's router output → ``MoKRouting``, deterministically and without a host sync.

    probs: [T, E] float (any float dtype); routing_map: [T, E] bool; topk: K, the slots per token.
    A token with fewer than K experts (dropped by capacity, or padding) gets -1 slots; the experts
    of a token are listed in ascending id. A token may not hold more than K experts.
    On CUDA (float32 / bf16 / fp16 probs) one kernel does it (``ops.moe.routing_to_topk``, the
    same values and gradients as the torch ops below, which were about 0.3 ms of host time per
    pass); elsewhere the torch ops.
    """
    if (probs.is_cuda and probs.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and ops.has_op("routing_to_topk")):  # fmt: skip
        topk_experts, router_weights = mops.routing_to_topk(probs, routing_map, topk)
        return MoKRouting(topk_experts=topk_experts, router_weights=router_weights)
    return routing_to_topk_torch(probs, routing_map, topk)


def routing_to_topk_torch(probs: torch.Tensor, routing_map: torch.Tensor,
                          topk: int) -> MoKRouting:  # fmt: skip
    """``routing_to_topk`` in torch ops (any device and float dtype)."""
    num_tokens, num_experts = routing_map.shape
    # Slot j of a token holds its expert with j earlier chosen experts: the first column where
    # the row's running count of chosen experts reaches j + 1 (num_experts where none does).
    # NOTE: a search over the running counts, not a sort of [T, E] keys (a sort per row costs
    # 0.3 ms at deepseek-v3's 8192 x 256 on an H200, docs/results/profile_moe_h200_ep1_*.json).
    counts = routing_map.to(torch.int32).cumsum(dim=1, dtype=torch.int32)
    wanted = torch.arange(1, topk + 1, dtype=torch.int32, device=routing_map.device)
    chosen = torch.searchsorted(counts, wanted.expand(num_tokens, topk).contiguous())
    empty = chosen == num_experts
    topk_experts = torch.where(empty, -1, chosen)
    weights = probs.gather(1, torch.where(empty, 0, chosen)).float()
    router_weights = torch.where(empty, 0.0, weights)
    return MoKRouting(topk_experts=topk_experts.contiguous(), router_weights=router_weights)


class _AllToAll(torch.autograd.Function):
    """All-to-all with host split sizes; output on the input's device (gloo and NCCL)."""

    @staticmethod
    def forward(ctx, group, x, send_splits: list[int], recv_splits: list[int]):
        ctx.group, ctx.send_splits, ctx.recv_splits = group, send_splits, recv_splits
        if dist.get_world_size(group) == 1:
            return x
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, d_out):
        d_x = _AllToAll.apply(ctx.group, d_out, ctx.recv_splits, ctx.send_splits)
        return None, d_x, None, None


def _collective_device(group, device: torch.device) -> torch.device:
    """gloo collectives take CPU tensors; NCCL takes the GPU's."""
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


@dataclass
class _UnfusedPlan:
    """Where every routed row goes and comes back (unfused mode), all on the device.

    send_order: [T*K] slot indices sorted by (expert, token, slot), empty slots last;
    num_send: rows actually sent (host int); send_splits / recv_splits: per-rank row counts (host);
    sort_by_expert: [R] permutation of received rows into (local expert, source rank) order;
    tokens_per_expert: [E_l] int64 on the device.
    """

    send_order: torch.Tensor
    num_send: int
    send_splits: list[int]
    recv_splits: list[int]
    sort_by_expert: torch.Tensor
    tokens_per_expert: torch.Tensor


class MoKTokenDispatcher(MoETokenDispatcher):
    """Megatron dispatcher hooks over MoK routing; see the module docstring for the two modes.

    Args:
        num_local_experts: E_l, experts on this rank (rank r owns [r*E_l, (r+1)*E_l)).
        local_expert_indices: the global ids of those experts.
        config: Megatron's TransformerConfig (``moe_router_topk`` is K).
        pg_collection: process groups; ``pg_collection.ep`` is the expert-parallel group.
        fused: True when the experts are ``MoKExperts``.
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection, fused):
        super().__init__(config=config, pg_collection=pg_collection)
        if self.tp_size > 1:
            raise ValueError(
                f"MoKTokenDispatcher supports expert_tensor_parallel_size=1, got {self.tp_size}; "
                "set --expert-tensor-parallel-size 1 (MoK shards experts over EP only)"
            )
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.fused = fused
        self.routing: MoKRouting | None = None
        self._plan: _UnfusedPlan | None = None
        self.hidden_shape = None

    # ------------------------------------------------------------------------------- dispatch
    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """hidden_states: [S, B, H]; routing_map / probs: [S*B, E] → ([S*B, H], [S*B, K])."""
        self.hidden_shape = hidden_states.shape
        self.routing = routing_to_topk(probs, routing_map, self.topk)
        hidden = hidden_states.reshape(-1, self.hidden_shape[-1])
        if not self.fused:
            self._plan = self._plan_rows(self.routing.topk_experts)
        return hidden, self.routing.router_weights

    def token_dispatch(self, hidden_states, probs):
        """Fused: nothing moves. Unfused: send each routed row to its expert's rank."""
        if self.fused:
            return hidden_states, probs
        rows = self._plan.send_order[: self._plan.num_send]
        # One copy per (token, slot), then a permutation: every gather index is unique, so the
        # backward is a plain scatter plus a sum over K, with no accumulation into shared rows.
        slots = hidden_states.unsqueeze(1).expand(-1, self.topk, -1).reshape(-1, self._hidden())
        x = _AllToAll.apply(self.ep_group, slots[rows], *self._splits())
        p = _AllToAll.apply(self.ep_group, probs.reshape(-1)[rows], *self._splits())
        return x, p

    def dispatch_postprocess(self, hidden_states, probs):
        """Fused: (x [T, H], topk_experts [T, K], router_weights [T, K]).

        Unfused: (rows [R, H] sorted by local expert, tokens_per_expert [E_l] int64 on the
        device, probs [R]).
        """
        if self.fused:
            return hidden_states, self.routing.topk_experts, probs
        order = self._plan.sort_by_expert
        return hidden_states[order], self._plan.tokens_per_expert, probs[order]

    # -------------------------------------------------------------------------------- combine
    def combine_preprocess(self, hidden_states):
        """Unfused: undo the sort by local expert (a gather by the inverse permutation)."""
        if self.fused:
            return hidden_states
        inverse = torch.argsort(self._plan.sort_by_expert)
        return hidden_states[inverse]

    def token_combine(self, hidden_states):
        """Unfused: send every row back to the rank that owns its token."""
        if self.fused:
            return hidden_states
        send, recv = self._splits()
        return _AllToAll.apply(self.ep_group, hidden_states, recv, send)

    def combine_postprocess(self, hidden_states):
        """→ [S, B, H]. Unfused: rows back to their (token, slot) place, slots summed in order."""
        if not self.fused:
            hidden_states = self._sum_slots(hidden_states)
        out = hidden_states.view(self.hidden_shape)
        self.routing, self._plan = None, None
        return out

    # ---------------------------------------------------------------------- unfused internals
    def _hidden(self) -> int:
        return self.hidden_shape[-1]

    def _splits(self) -> tuple[list[int], list[int]]:
        return self._plan.send_splits, self._plan.recv_splits

    def _sum_slots(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [num_send, H] in send order → [T, H], each token's slots summed in slot order."""
        num_slots = self.routing.topk_experts.numel()
        slots = rows.new_zeros((num_slots, rows.shape[-1]))
        slots = slots.index_copy(0, self._plan.send_order[: self._plan.num_send], rows)
        return slots.view(-1, self.topk, rows.shape[-1]).sum(dim=1)

    def _plan_rows(self, topk_experts: torch.Tensor) -> _UnfusedPlan:
        """Row placement for the all-to-all: a pure function of every rank's routing."""
        flat = topk_experts.reshape(-1)
        valid = flat >= 0
        send_order = torch.sort(torch.where(valid, flat, self.num_experts), stable=True).indices
        per_expert = torch.bincount(flat[valid], minlength=self.num_experts)
        every = self._all_gather_counts(per_expert)  # [EP, E]
        ep_rank, e_l = self.ep_rank, self.num_local_experts
        recv_grid = every[:, ep_rank * e_l : (ep_rank + 1) * e_l]  # [EP source, E_l]
        send_per_rank = per_expert.view(self.ep_size, e_l).sum(dim=1)
        host = torch.stack([send_per_rank, recv_grid.sum(dim=1)]).cpu()  # the one host copy
        send_splits, recv_splits = host[0].tolist(), host[1].tolist()
        return _UnfusedPlan(
            send_order=send_order,
            num_send=sum(send_splits),
            send_splits=send_splits,
            recv_splits=recv_splits,
            sort_by_expert=_sort_by_local_expert(recv_grid, sum(recv_splits)),
            tokens_per_expert=recv_grid.sum(dim=0),
        )

    def _all_gather_counts(self, per_expert: torch.Tensor) -> torch.Tensor:
        """per_expert: [E] int64 → [EP, E], every rank's counts."""
        if self.ep_size == 1:
            return per_expert.unsqueeze(0)
        device = _collective_device(self.ep_group, per_expert.device)
        out = torch.empty(self.ep_size * self.num_experts, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(out, per_expert.to(device), group=self.ep_group)
        return out.view(self.ep_size, self.num_experts).to(per_expert.device)


def _sort_by_local_expert(recv_grid: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Received rows come grouped (source rank, local expert); → (local expert, source rank).

    recv_grid: [EP, E_l] rows per (source, expert). Returns [num_rows] int64 gather indices.
    """
    num_src, num_local = recv_grid.shape
    chunk = torch.arange(num_src * num_local, device=recv_grid.device)
    chunk_of_row = torch.repeat_interleave(chunk, recv_grid.reshape(-1), output_size=num_rows)
    expert_major = (chunk_of_row % num_local) * num_src + chunk_of_row // num_local
    return torch.sort(expert_major, stable=True).indices
