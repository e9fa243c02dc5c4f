"""The benchmark baseline's expert module: Megatron's experts interface on ``torch._grouped_mm``.

Megatron-Core 0.19 offers grouped-GEMM experts only through Transformer Engine (``TEGroupedMLP``);
without TE its experts are ``SequentialMLP``, a Python loop over experts. What users run today is
the alltoall dispatcher with grouped GEMMs, so this module gives Megatron's ``MoELayer`` exactly
that: one grouped GEMM for fc1 over all local experts, SwiGLU times the routing probability,
one grouped GEMM for fc2. On CPU (sanity runs only) it loops over experts instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

__all__ = ["TorchGroupedMLP"]


class TorchGroupedMLP(MegatronModule):
    """Experts as two grouped GEMMs. weight_fc1: [E_l, 2I, H] ([gate; up]); weight_fc2: [E_l, H, I].

    forward(x [N, H] in expert order, tokens_per_expert [E_l], probs [N]) -> (out [N, H], None).
    """

    def __init__(self, num_local_experts, config, submodules=None, pg_collection=None, name=None):
        super().__init__(config=config)
        del submodules, pg_collection, name
        h, i = config.hidden_size, config.moe_ffn_hidden_size
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight_fc1 = torch.nn.Parameter(
            torch.empty(num_local_experts, 2 * i, h, dtype=config.params_dtype, device=device)
        )
        self.weight_fc2 = torch.nn.Parameter(
            torch.empty(num_local_experts, h, i, dtype=config.params_dtype, device=device)
        )
        for p in (self.weight_fc1, self.weight_fc2):
            p.allreduce = False
        with torch.no_grad():
            for e in range(num_local_experts):
                config.init_method(self.weight_fc1[e])
                config.output_layer_init_method(self.weight_fc2[e])

    def forward(self, x, tokens_per_expert, probs):
        if x.is_cuda:
            offs = torch.cumsum(tokens_per_expert.to(x.device, torch.int32), 0, dtype=torch.int32)
            h = torch._grouped_mm(x, self.weight_fc1.transpose(1, 2), offs=offs)
            gate, up = h.chunk(2, dim=-1)
            act = (F.silu(gate) * up * probs[:, None]).to(x.dtype)
            return torch._grouped_mm(act, self.weight_fc2.transpose(1, 2), offs=offs), None
        outs = []
        for e, rows in enumerate(torch.split(x, tokens_per_expert.tolist())):
            gate, up = (rows @ self.weight_fc1[e].T).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ self.weight_fc2[e].T)
        return (torch.cat(outs) * probs[:, None]).to(x.dtype), None

    def backward_dw(self):
        """Weight gradients are computed in the ordinary backward."""
