"""One forward + backward of the functional API on a rank's share of a ``MoEProblem``, and the
dense float64 oracle's answer for the whole problem, as dicts keyed by gradient name."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mok_megatron import functional as F

from .oracles import MoEProblem, dense_moe

__all__ = ["GRAD_NAMES", "global_d_out", "problem_workspace", "run_local", "run_oracle"]

GRAD_NAMES = ("d_x", "d_router_weights", "d_w_routed_gate", "d_w_routed_up", "d_w_routed_down",
              "d_w_shared_gate", "d_w_shared_up", "d_w_shared_down")  # fmt: skip


def global_d_out(problem: MoEProblem, seed: int) -> torch.Tensor:
    """The upstream gradient for every token of the problem: [N, H], float64."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(problem.x.shape, generator=gen, dtype=torch.float64)


def problem_workspace(problem: MoEProblem, *, dtype: torch.dtype,
                      config: F.MoKConfig | None = None, num_local_tokens: int | None = None,
                      device: str = "cpu", backend: str = "reference") -> F.MoKWorkspace:  # fmt: skip
    """A workspace sized for ``problem`` (T_max = its largest rank unless given)."""
    shared = problem.shared[0].shape[0] if problem.shared else 0
    return F.create_workspace(
        config or F.MoKConfig(), None, device=device,
        num_local_tokens=num_local_tokens or max(problem.tokens_per_rank),
        hidden_size=problem.x.shape[1], topk=problem.topk_experts.shape[1],
        num_experts=problem.w_gate.shape[0], intermediate_size=problem.w_gate.shape[1],
        shared_intermediate_size=shared, dtype=dtype, backend=backend,
    )  # fmt: skip


def run_local(problem: MoEProblem, *, rank: int, dtype: torch.dtype, seed: int = 0,
              num_local_tokens: int | None = None, config: F.MoKConfig | None = None,
              device: str = "cpu", backend: str = "reference") -> dict:  # fmt: skip
    """This rank's out and gradients (collective when torch.distributed is initialised)."""
    config = config or F.MoKConfig()
    x, topk, rw, routed, shared = problem.local(rank, dtype=dtype, device=device)
    if dtype == torch.float64:
        rw = rw.double()
    ws = problem_workspace(problem, dtype=dtype, config=config, device=device,
                           num_local_tokens=num_local_tokens, backend=backend)  # fmt: skip
    sched = F.build_schedule(ws, config, topk, ws.num_local_experts)
    weights = (*(shared or (None, None, None)), *routed)
    out, ctx = F.forward(config, ws, sched, x, rw, *weights)
    d_out = global_d_out(problem, seed)[problem.token_slice(rank)].to(device, dtype).contiguous()
    grads = F.backward(config, ws, sched, ctx, d_out, x, rw, *weights)
    result = {"out": out, "d_out": d_out, "schedule": sched}
    result.update(grads._asdict())
    if dist.is_initialized():
        result = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in result.items()}
    return result


def run_oracle(problem: MoEProblem, d_out: torch.Tensor) -> dict:
    """Dense float64 autograd over the whole problem: out [N, H] and every gradient (global)."""
    leaves = [problem.x, problem.router_weights, problem.w_gate, problem.w_up, problem.w_down]
    leaves += list(problem.shared or ())
    leaves = [t.detach().double().clone().requires_grad_() for t in leaves]
    shared = tuple(leaves[5:]) if problem.shared else None
    out = dense_moe(leaves[0], problem.topk_experts, leaves[1], *leaves[2:5], shared=shared)
    out.backward(d_out.double())
    grads = [leaf.grad for leaf in leaves] + [None] * (8 - len(leaves))
    return {"out": out.detach(), **dict(zip(GRAD_NAMES, grads))}
