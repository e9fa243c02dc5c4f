"""Independent oracles: a dense float64 MoE written with none of the backends' machinery, and
random problems to feed it (fresh inputs each call, never zeros)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["MoEProblem", "dense_moe", "random_moe_problem", "relative_error"]


def dense_moe(x, topk_experts, router_weights, w_gate, w_up, w_down, shared=None):
    """The whole (global) layer, token by expert, with plain autograd-friendly ops.

    x: [N, H]; topk_experts: [N, K] (-1 = empty); router_weights: [N, K];
    w_gate / w_up: [E, I, H]; w_down: [E, H, I]; shared: (gate [I_s, H], up, down [H, I_s]).
    """
    out = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        hit = topk_experts == e
        tokens = hit.any(-1).nonzero().flatten()
        if tokens.numel() == 0:
            continue
        weight = (router_weights * hit).sum(-1)[tokens]
        xs = x[tokens]
        y = (F.silu(xs @ w_gate[e].T) * (xs @ w_up[e].T)) @ w_down[e].T
        out = out.index_add(0, tokens, weight[:, None].to(y.dtype) * y)
    if shared is not None:
        g, u, d = shared
        out = out + (F.silu(x @ g.T) * (x @ u.T)) @ d.T
    return out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64; inf if either holds a NaN or Inf."""
    a, e = actual.double(), expected.double()
    if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
        return float("inf")
    denom = e.norm().item()
    return (a - e).norm().item() / (denom if denom > 0 else 1.0)


@dataclass
class MoEProblem:
    """A global MoE problem split over ``len(tokens_per_rank)`` ranks (rank-major token order)."""

    tokens_per_rank: list[int]
    x: torch.Tensor
    topk_experts: torch.Tensor
    router_weights: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None

    @property
    def num_ranks(self) -> int:
        return len(self.tokens_per_rank)

    def token_slice(self, rank: int) -> slice:
        start = sum(self.tokens_per_rank[:rank])
        return slice(start, start + self.tokens_per_rank[rank])

    def expert_slice(self, rank: int) -> slice:
        e_l = self.w_gate.shape[0] // self.num_ranks
        return slice(rank * e_l, (rank + 1) * e_l)

    def to(self, device) -> MoEProblem:
        """The same problem with its tensors on ``device`` (e.g. where its float64 oracle runs)."""
        from dataclasses import replace

        move = lambda t: t.to(device)  # noqa: E731
        return replace(
            self, x=move(self.x), topk_experts=move(self.topk_experts),
            router_weights=move(self.router_weights), w_gate=move(self.w_gate),
            w_up=move(self.w_up), w_down=move(self.w_down),
            shared=tuple(map(move, self.shared)) if self.shared else None,
        )  # fmt: skip

    def local(self, rank: int, dtype=None, device="cpu"):
        """This rank's (x, topk, router_weights, routed weights, shared) as fresh contiguous
        tensors (copies, not views of the problem's: each starts on an aligned address, as the
        functional API requires)."""
        ts, es = self.token_slice(rank), self.expert_slice(rank)

        def cast(t, dt=dtype):
            return t.to(device=device, dtype=dt or t.dtype, copy=True,
                        memory_format=torch.contiguous_format)  # fmt: skip

        shared = tuple(cast(w) for w in self.shared) if self.shared else None
        routed = tuple(cast(w[es]) for w in (self.w_gate, self.w_up, self.w_down))
        return (cast(self.x[ts]), cast(self.topk_experts[ts], None),
                cast(self.router_weights[ts], None), routed, shared)  # fmt: skip


def random_moe_problem(
    tokens_per_rank: list[int],
    hidden: int,
    inter: int,
    num_experts: int,
    topk: int,
    *,
    shared_inter: int = 0,
    routing: str = "uniform",
    empty_slot_fraction: float = 0.0,
    dtype: torch.dtype = torch.float64,
    seed: int | None = None,
) -> MoEProblem:
    """Fresh random inputs: distinct experts per token; routing 'uniform', 'skewed' (Zipf-like),
    or 'one_expert' (every slot-0 to expert 0); some slots set to -1 if asked."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    n = sum(tokens_per_rank)
    x = torch.randn(n, hidden, generator=gen, dtype=torch.float64)
    if routing == "skewed":
        pref = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.2
        scores = torch.log(pref)[None] - torch.log(
            -torch.log(torch.rand(n, num_experts, generator=gen, dtype=torch.float64))
        )
    else:
        scores = torch.rand(n, num_experts, generator=gen, dtype=torch.float64)
    if routing == "one_expert":
        scores[:, 0] = 10.0
    topk_experts = scores.topk(topk, dim=-1).indices
    router_weights = torch.rand(n, topk, generator=gen).float() + 0.1
    if empty_slot_fraction > 0:
        empty = torch.rand(n, topk, generator=gen) < empty_slot_fraction
        topk_experts = topk_experts.masked_fill(empty, -1)
    scale_in, scale_mid = hidden**-0.5, inter**-0.5

    def w(*shape, scale):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    shared = None
    if shared_inter:
        shared = (w(shared_inter, hidden, scale=scale_in), w(shared_inter, hidden, scale=scale_in),
                  w(hidden, shared_inter, scale=shared_inter**-0.5))  # fmt: skip
    return MoEProblem(
        tokens_per_rank=list(tokens_per_rank), x=x.to(dtype), topk_experts=topk_experts,
        router_weights=router_weights, w_gate=w(num_experts, inter, hidden, scale=scale_in),
        w_up=w(num_experts, inter, hidden, scale=scale_in),
        w_down=w(num_experts, hidden, inter, scale=scale_mid), shared=shared,
    )  # fmt: skip
