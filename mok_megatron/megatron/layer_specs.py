"""Layer specs that put MoK into Megatron-Core models.

Every spec here is Megatron's own spec with its ``MoELayer`` builders swapped for
``MoKMoELayer`` (``mokify_spec``), so attention, norms, dense layers, ``moe_layer_freq`` and the
TE / local choice stay exactly Megatron's.

- ``get_mok_moe_module_spec(...)``: the MLP builder of one MoK MoE layer.
- ``get_gpt_layer_mok_spec(...)``: a GPT TransformerLayer spec (TE when Transformer Engine is
  installed, else local). It is also a ``ModuleSpec`` itself (the default MoK layer), because
  Megatron-LM's ``--spec mok_megatron.megatron get_gpt_layer_mok_spec`` imports the named object
  and uses it as the spec without calling it.
- ``get_gpt_decoder_block_mok_spec(config, ...)``: Megatron's decoder block spec (dense and MoE
  layers per ``moe_layer_freq``) with MoK MoE layers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.models.gpt import gpt_layer_specs as mcore_specs
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from .experts import TE_GROUPED_MLP, MoKExperts
from .moe_layer import MoKMoELayer

__all__ = [
    "get_mok_moe_module_spec",
    "get_gpt_layer_mok_spec",
    "get_gpt_decoder_block_mok_spec",
    "mokify_spec",
]


def mokify_spec(spec: Any, *, fused_experts: bool = True, **layer_params: Any) -> Any:
    """Megatron spec → the same spec with every ``MoELayer`` builder made a ``MoKMoELayer``.

    spec: a ``TransformerBlockSubmodules``, a ``ModuleSpec`` of a TransformerLayer, a list of
    layer specs, a multi-token-prediction block spec (its layers' transformer layers), or an MoE
    MLP builder (``functools.partial(MoELayer, submodules=...)``).
    fused_experts: use ``MoKExperts`` (True) or keep Megatron's experts behind MoK dispatch.
    layer_params: ``MoKMoELayer`` keyword arguments (mok_config, backend, fuse_shared_experts,
    max_local_tokens). Inputs are not modified.
    """
    again = functools.partial(mokify_spec, fused_experts=fused_experts, **layer_params)
    if isinstance(spec, list):
        return [again(s) for s in spec]
    if isinstance(spec, (TransformerBlockSubmodules, MultiTokenPredictionBlockSubmodules)):
        return dataclasses.replace(spec, layer_specs=[again(s) for s in spec.layer_specs])
    if isinstance(spec, MultiTokenPredictionLayerSubmodules):  # an MTP layer's own block/layer
        return dataclasses.replace(spec, mtp_model_layer=again(spec.mtp_model_layer))
    if isinstance(spec, TransformerLayerSubmodules):
        return dataclasses.replace(spec, mlp=again(spec.mlp))
    if isinstance(spec, ModuleSpec) and isinstance(spec.submodules, _NESTED_SUBMODULES):
        submodules = again(spec.submodules)
        return ModuleSpec(spec.module, dict(spec.params), submodules, dict(spec.metainfo))
    if isinstance(spec, functools.partial) and spec.func is MoELayer:
        return _mok_moe_builder(spec, fused_experts, layer_params)
    return spec


#: Spec submodules mokify_spec looks inside (a layer's MLP, a block's or MTP block's layers, an
#: MTP layer's transformer layer).
_NESTED_SUBMODULES = (
    TransformerLayerSubmodules,
    TransformerBlockSubmodules,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayerSubmodules,
)


def _mok_moe_builder(moe: functools.partial, fused_experts: bool, layer_params: dict):
    submodules = moe.keywords["submodules"]
    if fused_experts:
        submodules = dataclasses.replace(submodules, experts=_mok_experts_like(submodules.experts))
    keywords = {**moe.keywords, "submodules": submodules, **layer_params}
    return functools.partial(MoKMoELayer, *moe.args, **keywords)


def _mok_experts_like(stock):
    """MoKExperts starting from the weights ``stock`` (Megatron's experts builder) would hold
    for the same seed: TEGroupedMLP's init order where the spec builds it, else SequentialMLP's."""
    stock_cls = stock.func if isinstance(stock, functools.partial) else stock
    if isinstance(stock_cls, type) and issubclass(stock_cls, TEGroupedMLP):
        return functools.partial(MoKExperts, init_order=TE_GROUPED_MLP)
    return MoKExperts


def get_mok_moe_module_spec(
    use_te: bool | None = None,
    *,
    fused_experts: bool = True,
    moe_grouped_gemm: bool = False,
    mok_config: Any = None,
    backend: str = "auto",
    fuse_shared_experts: bool | None = None,
    max_local_tokens: int | None = None,
):
    """The MLP builder of a MoK MoE layer (``TransformerLayerSubmodules.mlp``).

    use_te: Megatron's TE modules for the shared expert / stock experts (None: if installed).
    fused_experts: ``MoKExperts`` (True) or Megatron's experts (``SequentialMLP``, or
    ``TEGroupedMLP`` with ``moe_grouped_gemm``) fed by ``MoKTokenDispatcher``.
    The rest are ``MoKMoELayer`` arguments.
    """
    use_te = HAVE_TE if use_te is None else use_te
    stock = get_moe_module_spec(use_te=use_te, num_experts=1, moe_grouped_gemm=moe_grouped_gemm)
    return mokify_spec(stock, fused_experts=fused_experts, **_layer_params(locals()))


def _build_gpt_layer_mok_spec(
    use_te: bool | None = None,
    *,
    qk_layernorm: bool = False,
    multi_latent_attention: bool = False,
    normalization: str | None = None,
    fused_experts: bool = True,
    moe_grouped_gemm: bool = False,
    mok_config: Any = None,
    backend: str = "auto",
    fuse_shared_experts: bool | None = None,
    max_local_tokens: int | None = None,
) -> ModuleSpec:
    """A GPT TransformerLayer spec whose MLP is a MoK MoE layer (see ``get_gpt_layer_mok_spec``)."""
    use_te = HAVE_TE if use_te is None else use_te
    common = dict(
        num_experts=1, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm,
        multi_latent_attention=multi_latent_attention,
    )  # fmt: skip
    if use_te:
        stock = mcore_specs.get_gpt_layer_with_transformer_engine_spec(**common)
    else:
        stock = mcore_specs.get_gpt_layer_local_spec(**common, normalization=normalization)
    return mokify_spec(stock, fused_experts=fused_experts, **_layer_params(locals()))


def _layer_params(scope: dict) -> dict:
    names = ("mok_config", "backend", "fuse_shared_experts", "max_local_tokens")
    return {name: scope[name] for name in names}


class _GptLayerMoKSpec(ModuleSpec):
    """The default MoK GPT layer spec, callable to make one with other arguments.

    Called with spec arguments (all keyword, or ``use_te`` first) it returns a new ``ModuleSpec``
    (``_build_gpt_layer_mok_spec``). Called with a TransformerConfig (how a ``ModuleSpec`` builds
    its module) it builds the layer, as any ``ModuleSpec`` does.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if "config" in kwargs or (args and isinstance(args[0], TransformerConfig)):
            return super().__call__(*args, **kwargs)
        return _build_gpt_layer_mok_spec(*args, **kwargs)


def _default_gpt_layer_mok_spec() -> _GptLayerMoKSpec:
    spec = _build_gpt_layer_mok_spec()
    return _GptLayerMoKSpec(TransformerLayer, spec.params, spec.submodules, spec.metainfo)


#: ``get_gpt_layer_mok_spec(use_te=None, *, qk_layernorm=False, multi_latent_attention=False,
#: normalization=None, fused_experts=True, moe_grouped_gemm=False, mok_config=None,
#: backend="auto", fuse_shared_experts=None, max_local_tokens=None) -> ModuleSpec``; uncalled,
#: it is the default spec (what Megatron-LM's ``--spec`` gets).
get_gpt_layer_mok_spec = _default_gpt_layer_mok_spec()
get_gpt_layer_mok_spec.__doc__ = _build_gpt_layer_mok_spec.__doc__


def get_gpt_decoder_block_mok_spec(
    config: TransformerConfig,
    use_transformer_engine: bool | None = None,
    *,
    fused_experts: bool = True,
    normalization: str | None = None,
    vp_stage: int | None = None,
    mok_config: Any = None,
    backend: str = "auto",
    fuse_shared_experts: bool | None = None,
    max_local_tokens: int | None = None,
) -> TransformerBlockSubmodules:
    """Megatron's GPT decoder block spec for ``config`` (dense / MoE layers per
    ``moe_layer_freq``, this pipeline stage's layers) with MoK MoE layers."""
    use_te = HAVE_TE if use_transformer_engine is None else use_transformer_engine
    stock = mcore_specs.get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization=normalization, vp_stage=vp_stage
    )
    return mokify_spec(stock, fused_experts=fused_experts, **_layer_params(locals()))
