"""Megatron-Bridge (NeMo) recipes with MoK: ``apply_mok(cfg)`` on a ``ConfigContainer``.

A Bridge recipe returns a ``ConfigContainer`` whose ``model`` is a ``GPTModelProvider`` (a
TransformerConfig) with a ``transformer_layer_spec`` that is a ``ModuleSpec`` or a callable
``spec(provider, vp_stage=None)``. ``apply_mok`` switches the dispatcher to ``mok``, turns off
what only Megatron's alltoall / flex dispatchers support, and wraps the recipe's own layer spec
so its MoE layers become MoK layers (attention, norms, TE choice and dense layers stay the
recipe's). The wrapper is a ``functools.partial`` of a module-level function, so Bridge can
still serialise the config.

Checked against Megatron-Bridge 0.6.2's source (``GPTModelProvider.transformer_layer_spec``,
``ConfigContainer.model``); the tests use a stand-in with the same attributes, because the
Bridge wheel's dependencies (transformers, flashinfer, TE, ...) do not install on a CPU runner.
"""

from __future__ import annotations

import functools
import inspect
import logging
from pathlib import Path
from typing import Any

__all__ = ["apply_mok", "mok_transformer_layer_spec"]

logger = logging.getLogger(__name__)

#: Megatron features tied to the alltoall / flex dispatchers, and the value MoK needs.
_DISPATCHER_ONLY = {
    "moe_shared_expert_overlap": False,  # MoK fuses the shared expert instead
    "overlap_moe_expert_parallel_comm": False,  # alltoall/flex 1F1B overlap
    "moe_flex_dispatcher_backend": None,  # what Bridge sets when leaving flex
    "moe_enable_deepep": False,
}


def mok_transformer_layer_spec(
    config, vp_stage: int | None = None, *, base_spec: Any, fused_experts: bool, **layer_params
):
    """The recipe's spec for ``config`` (a ModuleSpec, or a callable as Bridge calls it) with
    its MoE layers made ``MoKMoELayer``s."""
    from .layer_specs import mokify_spec

    spec = base_spec
    if callable(spec) and not _is_module_spec(spec):
        takes_vp = "vp_stage" in inspect.signature(spec).parameters
        spec = spec(config, vp_stage=vp_stage) if takes_vp else spec(config)
    return mokify_spec(spec, fused_experts=fused_experts, **layer_params)


def apply_mok(
    cfg,
    mok_config: Any = None,
    *,
    fused_experts: bool = True,
    backend: str = "auto",
    fuse_shared_experts: bool | None = None,
    max_local_tokens: int | None = None,
):
    """Turn a Bridge ``ConfigContainer`` (or a bare model provider) to MoK, in place.

    mok_config: a ``MoKConfig``, a dict of its fields, a YAML path (its ``mok:`` section), or
    None (defaults). The other arguments are ``MoKMoELayer``'s. Returns ``cfg``.
    """
    model = getattr(cfg, "model", cfg)
    _check_model(model)
    model.moe_token_dispatcher_type = "mok"
    for name, value in _DISPATCHER_ONLY.items():
        if hasattr(model, name) and getattr(model, name) != value:
            logger.info("apply_mok: %s %r -> %r", name, getattr(model, name), value)
            setattr(model, name, value)
    _drop_cuda_graph_module(model, "moe_preprocess")
    _disable_comm_overlap_ep(cfg)
    model.transformer_layer_spec = functools.partial(
        mok_transformer_layer_spec, base_spec=model.transformer_layer_spec,
        fused_experts=fused_experts, mok_config=_mok_config(mok_config), backend=backend,
        fuse_shared_experts=fuse_shared_experts, max_local_tokens=max_local_tokens,
    )  # fmt: skip
    return cfg


def _check_model(model) -> None:
    if not getattr(model, "num_moe_experts", None):
        raise ValueError("apply_mok: the model has no MoE layers (num_moe_experts is not set)")
    if not hasattr(model, "transformer_layer_spec"):
        raise TypeError(
            f"apply_mok: {type(model).__name__} has no transformer_layer_spec; pass a Bridge "
            "ConfigContainer or a GPTModelProvider"
        )
    if (getattr(model, "expert_tensor_parallel_size", 1) or 1) != 1:
        raise ValueError(
            "apply_mok: set model.expert_tensor_parallel_size = 1 (MoK shards over EP)"
        )
    if getattr(model, "moe_pad_expert_input_to_capacity", False):
        raise ValueError("apply_mok: MoK is dropless; unset model.moe_pad_expert_input_to_capacity")


def _mok_config(value):
    from mok_megatron.functional import MoKConfig

    if isinstance(value, (str, Path)):
        return MoKConfig.from_yaml(value)
    if isinstance(value, dict):
        return MoKConfig.from_dict(value)
    return value if value is not None else MoKConfig()


def _drop_cuda_graph_module(model, name: str) -> None:
    """MoK's dispatcher has no tensors for a partial CUDA-graph capture of ``name``."""
    for attr in ("cuda_graph_modules", "cuda_graph_scope"):
        modules = getattr(model, attr, None)
        if isinstance(modules, (list, tuple)) and any(name in str(m) for m in modules):
            kept = [m for m in modules if name not in str(m)]
            logger.info("apply_mok: %s drops %s (not capturable with mok)", attr, name)
            setattr(model, attr, kept)


def _disable_comm_overlap_ep(cfg) -> None:
    overlap = getattr(cfg, "comm_overlap", None)
    if overlap is not None and getattr(overlap, "overlap_moe_expert_parallel_comm", False):
        overlap.overlap_moe_expert_parallel_comm = False


def _is_module_spec(obj) -> bool:
    from megatron.core.transformer.spec_utils import ModuleSpec

    return isinstance(obj, ModuleSpec)
