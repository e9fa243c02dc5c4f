"""Megatron-Bridge HF <-> Megatron weight conversion for ``MoKExperts`` (imports Bridge).

Bridge's model bridges map routed-expert weights by the names of Megatron's experts
(``experts.linear_fc1.weight<e>`` for TEGroupedMLP, ``experts.local_experts.<e>.linear_fc1.weight``
for SequentialMLP), one HF tensor (or gate/up pair) per Megatron parameter. ``MoKExperts`` holds
all local experts of a layer in two parameters, so each maps to every expert's HF tensors:

- ``experts.weight_gate_up`` [E_l, 2I, H] <-> ``{gate,up}_proj.weight`` [I, H] of each expert,
  gate and up rows interleaved in blocks of 8 (``interleave_gate_up``);
- ``experts.weight_down`` [E_l, H, I] <-> ``down_proj.weight`` [H, I] of each expert.

The HF names come from the bridge's own TEGroupedMLP mappings (the last ``*`` of an HF pattern
is the expert index), so any bridge that maps grouped experts with a ``GatedMLPMapping`` and an
``AutoMapping`` gets MoK's. Import takes the rank's slice of experts ``[ep_rank * E_l, ...)``;
export gathers all experts over the EP group (every rank yields every tensor, as Bridge's do).
Expert tensor parallelism is not supported (MoK shards experts over EP only).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.param_mapping import (
    AutoMapping,
    GatedMLPMapping,
    MegatronParamMapping,
)

from mok_megatron.ops.grouped_gemm import deinterleave_gate_up, interleave_gate_up

__all__ = ["MoKDownMapping", "MoKGateUpMapping", "mok_expert_mappings", "mok_mapping_registry"]

logger = logging.getLogger(__name__)

#: Where HF configs keep the number of routed experts (Qwen3-MoE, DeepSeek-V3, Mixtral).
_NUM_EXPERTS_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts")


class _MoKExpertsMapping(MegatronParamMapping[dict[str, torch.Tensor]]):
    """One ``MoKExperts`` parameter [E_l, ...] <-> per-expert HF tensors.

    ``hf_param`` is a dict ``{f"{part}{e}": name}`` for every global expert ``e`` and each of
    ``PARTS``; the default ``resolve`` fills in the layer wildcards.
    """

    PARTS: tuple[str, ...] = ()

    @property
    def num_experts(self) -> int:
        return len(self.hf_param) // len(self.PARTS)

    def hf_to_megatron(self, hf_weights, megatron_module) -> torch.Tensor:
        num_local = self._local_param(megatron_module).shape[0]
        first = _ep_rank(megatron_module) * num_local
        experts = range(first, first + num_local)
        parts = [torch.stack([hf_weights[f"{p}{e}"] for e in experts]) for p in self.PARTS]
        return self.merge(*parts)

    def megatron_to_hf(self, megatron_weights, megatron_module) -> dict[str, torch.Tensor]:
        if megatron_weights is not None and megatron_module is not None:
            megatron_weights = _gather_experts(megatron_weights, megatron_module.ep_group)
        megatron_weights = self.broadcast_from_pp_rank(
            megatron_weights, cache_key=self.megatron_param
        )
        if megatron_weights is None:
            return {}
        if megatron_weights.shape[0] != self.num_experts:
            raise ValueError(
                f"{self.megatron_param}: {megatron_weights.shape[0]} experts after the EP gather, "
                f"the HF config has {self.num_experts}"
            )
        parts = self.split(megatron_weights)
        return {
            self.hf_param[f"{p}{e}"]: t[e]
            for p, t in zip(self.PARTS, parts, strict=True)
            for e in range(self.num_experts)
        }

    def _local_param(self, module) -> torch.Tensor:
        return getattr(module, self.megatron_param.rsplit(".", 1)[1])

    def merge(self, *parts: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def split(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError


class MoKGateUpMapping(_MoKExpertsMapping):
    """``weight_gate_up`` [E_l, 2I, H] (interleaved) <-> each expert's gate and up [I, H]."""

    PARTS = ("gate", "up")

    def merge(self, gate, up):
        return interleave_gate_up(gate, up)

    def split(self, weight):
        return deinterleave_gate_up(weight, dim=-2)


class MoKDownMapping(_MoKExpertsMapping):
    """``weight_down`` [E_l, H, I] <-> each expert's down [H, I]."""

    PARTS = ("down",)

    def merge(self, down):
        return down

    def split(self, weight):
        return (weight,)


def mok_expert_mappings(mappings, num_experts: int) -> list[MegatronParamMapping]:
    """MoK mappings derived from a bridge's TEGroupedMLP expert ``mappings``, for
    ``num_experts`` routed experts."""
    out = []
    for m in mappings:
        base = m.megatron_param
        if base.endswith(".experts.linear_fc1.weight*") and isinstance(m, GatedMLPMapping):
            name = base.removesuffix("linear_fc1.weight*") + "weight_gate_up"
            out.append(MoKGateUpMapping(name, _per_expert(m.hf_param, num_experts)))
        elif base.endswith(".experts.linear_fc2.weight*") and isinstance(m, AutoMapping):
            name = base.removesuffix("linear_fc2.weight*") + "weight_down"
            out.append(MoKDownMapping(name, _per_expert({"down": m.hf_param}, num_experts)))
    return out


def mok_mapping_registry(bridge, registry: MegatronMappingRegistry) -> MegatronMappingRegistry:
    """``registry`` (the model bridge's own) plus ``MoKExperts``' mappings; the expert count
    comes from the bridge's HF config (``bridge.hf_config``, set by ``AutoBridge``)."""
    num_experts = num_routed_experts(getattr(bridge, "hf_config", None))
    if num_experts is None:
        logger.warning("%s has no HF config with an expert count: no MoK mappings", bridge)
        return registry
    extra = mok_expert_mappings(registry.mappings, num_experts)
    return MegatronMappingRegistry(*registry.mappings, *extra)


def num_routed_experts(hf_config) -> int | None:
    """The HF config's number of routed experts, or None."""
    for field in _NUM_EXPERTS_FIELDS:
        value = getattr(hf_config, field, None)
        if isinstance(value, int):
            return value
    return None


def _per_expert(patterns: dict[str, str], num_experts: int) -> dict[str, str]:
    """``{"gate": "...experts.*.gate_proj.weight"}`` -> ``{"gate0": "...experts.0...", ...}``:
    the pattern's last ``*`` is the expert index."""
    out = {}
    for part, pattern in patterns.items():
        head, _, tail = pattern.rpartition("*")
        out.update({f"{part}{e}": f"{head}{e}{tail}" for e in range(num_experts)})
    return out


def _ep_rank(module) -> int:
    group = getattr(module, "ep_group", None)
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def _gather_experts(weight: torch.Tensor, group) -> torch.Tensor:
    """[E_l, ...] on each EP rank -> [E, ...] (rank order), on every rank."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return weight
    parts = [torch.empty_like(weight) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, weight.detach().contiguous(), group=group)
    return torch.cat(parts)
