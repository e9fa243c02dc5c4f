"""Megatron-Bridge (NeMo) recipes with MoK: ``apply_mok(cfg)`` on a ``ConfigContainer``.

A Bridge recipe returns a ``ConfigContainer`` whose ``model`` is a ``GPTModelProvider`` (a
TransformerConfig) with a ``transformer_layer_spec`` that is a ``ModuleSpec`` or a callable
``spec(provider, vp_stage=None)``. ``apply_mok`` switches the dispatcher to ``mok``, turns off
what only Megatron's alltoall / flex dispatchers support, and wraps the recipe's own layer spec
so its MoE layers become MoK layers (attention, norms, TE choice and dense layers stay the
recipe's). The wrapper is ``MoKLayerSpec``, a dataclass: Bridge's ``ConfigContainer.to_yaml``
(the run_config.yaml in every checkpoint) writes a dataclass field by field, ``mok_config``
included, where a ``functools.partial``'s keywords would keep only a ``_target_``.
``ConfigContainer.from_yaml`` instantiates only allowlisted ``_target_``s; ``allow_mok_targets()``
adds MoK's through Bridge's public ``register_allowed_target_prefix``. ``apply_mok`` calls it;
a process that only loads a saved config must call it (or import a MoK recipe) first.

HF checkpoint conversion (``AutoBridge`` import / export): ``enable_mok_hf_conversion()`` adds
``MoKExperts``' parameter mappings (``bridge_conversion``) to Bridge's Qwen3-MoE model bridge (or
the model bridges given); ``apply_mok`` calls it too.

Tested against the real Megatron-Bridge 0.6.2 (``tests/cpu/megatron/test_megatron_bridge.py``).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from pathlib import Path
from typing import Any

__all__ = [
    "MoKLayerSpec",
    "allow_mok_targets",
    "apply_mok",
    "enable_mok_hf_conversion",
    "mok_transformer_layer_spec",
]

#: The modules whose names a saved Bridge config holds as ``_target_``s.
_MOK_TARGET_PREFIXES = ("mok_megatron.megatron.bridge", "mok_megatron.functional.config")

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


@dataclasses.dataclass(slots=True)
class MoKLayerSpec:
    """``transformer_layer_spec`` for a Bridge provider: ``base_spec`` with MoK MoE layers.

    A dataclass, not a ``functools.partial``, so Bridge's YAML writer stores every field
    (``mok_config`` as its ``_target_`` and all its knobs) and ``from_yaml`` rebuilds it.
    NOTE: slots (no ``__dict__``): Bridge's HF export copies the provider config through
    ``remove_non_pickleables``, which sets every attribute of anything with a ``__dict__``, two
    levels down, and so fails on the frozen ``MoKConfig`` inside; it leaves this spec as is.
    """

    base_spec: Any  # the recipe's spec: a ModuleSpec or a callable spec(provider, vp_stage=None)
    fused_experts: bool = True
    mok_config: Any = None  # a MoKConfig (None: the defaults)
    backend: str = "auto"
    fuse_shared_experts: bool | None = None
    max_local_tokens: int | None = None

    def __call__(self, config, vp_stage: int | None = None):
        """The ModuleSpec for ``config`` (the provider), as Bridge's ``provide()`` calls it."""
        return mok_transformer_layer_spec(
            config, vp_stage, base_spec=self.base_spec, fused_experts=self.fused_experts,
            mok_config=self.mok_config, backend=self.backend,
            fuse_shared_experts=self.fuse_shared_experts, max_local_tokens=self.max_local_tokens,
        )  # fmt: skip


def allow_mok_targets() -> bool:
    """Let Bridge's ``ConfigContainer.from_yaml`` instantiate MoK's ``_target_``s.

    Returns False (and does nothing) where Megatron-Bridge is not installed.
    """
    try:
        from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix
    except ImportError:
        return False
    for prefix in _MOK_TARGET_PREFIXES:
        register_allowed_target_prefix(prefix)
    return True


def enable_mok_hf_conversion(*bridge_classes) -> bool:
    """Make Bridge's HF import / export map ``MoKExperts``' parameters, for the model bridges
    ``bridge_classes`` (``MegatronModelBridge`` subclasses; default: Bridge's ``Qwen3MoEBridge``).

    Wraps each class's ``mapping_registry`` (once) to add ``bridge_conversion``'s mappings,
    which match only MoK's parameter names. Returns False where Megatron-Bridge is not installed.
    """
    try:
        from .bridge_conversion import mok_mapping_registry

        if not bridge_classes:
            from megatron.bridge.models.qwen.qwen3_moe_bridge import Qwen3MoEBridge

            bridge_classes = (Qwen3MoEBridge,)
    except ImportError:
        return False
    for cls in bridge_classes:
        if getattr(cls.mapping_registry, "_mok_wrapped", False):
            continue
        own = cls.mapping_registry

        def mapping_registry(self, _own=own):
            return mok_mapping_registry(self, _own(self))

        mapping_registry._mok_wrapped = True
        cls.mapping_registry = mapping_registry
    return True


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
    model.transformer_layer_spec = MoKLayerSpec(
        base_spec=model.transformer_layer_spec, fused_experts=fused_experts,
        mok_config=_mok_config(mok_config), backend=backend,
        fuse_shared_experts=fuse_shared_experts, max_local_tokens=max_local_tokens,
    )  # fmt: skip
    allow_mok_targets()  # so the run_config.yaml Bridge writes loads back
    enable_mok_hf_conversion()  # so AutoBridge loads / exports the MoK experts' weights
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
