"""MoK against Megatron's alltoall dispatcher, layer by layer (the parity oracle of DESIGN.md).

Build an ``MoELayer`` with Megatron's alltoall dispatcher and ``SequentialMLP`` and a MoK layer
(fused ``MoKExperts``, or ``MoKTokenDispatcher`` feeding ``SequentialMLP``) from the same
TransformerConfig; move the weights from one to the other through a distributed checkpoint;
run forward and backward on the same tokens; compare the output and every gradient, with the
expert gradients in one canonical form (gate / up / down per local expert). Used by the CPU and
GPU tests and usable by anyone checking a config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "LAYER_KINDS",
    "LayerCase",
    "assert_same_weights",
    "build_moe_layer",
    "full_recompute_losses",
    "canonical_weights",
    "init_megatron_parallel",
    "layer_step",
    "relative_errors",
    "require_checkpoint_writer",
    "share_weights",
    "tiny_moe_config",
]

LAYER_KINDS = ("alltoall", "mok_fused", "mok_unfused")


@dataclass(frozen=True)
class LayerCase:
    """One parity case: sizes, top-k, shared expert on/off, dtype and device."""

    num_experts: int = 8
    topk: int = 2
    hidden: int = 32
    ffn: int = 48
    shared_ffn: int | None = None
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    backend: str = "auto"


def init_megatron_parallel(ep_size: int, seed: int = 1234, device: str = "cpu") -> None:
    """Megatron's process groups with expert parallelism ``ep_size`` over the initialised world,
    and its RNG; the CPU shim first on a machine without a GPU.

    The CPU generator is seeded too, as Megatron's training does: the router weight is always
    initialised on the CPU (and every weight with use_cpu_initialization), so a generator left in a
    rank-dependent state (e.g. by an earlier test in the process) gives the ranks different
    copies of a replicated weight, which a checkpoint then cannot share consistently."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from . import cpu_shim

    if device == "cpu":
        cpu_shim.install()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep_size)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    torch.manual_seed(seed)


def tiny_moe_config(case: LayerCase, dispatcher: str, ep_size: int):
    """A TransformerConfig for one MoE layer (SwiGLU, no bias, no dropout)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=case.hidden, num_attention_heads=4,
        ffn_hidden_size=case.ffn, moe_ffn_hidden_size=case.ffn,
        num_moe_experts=case.num_experts, moe_router_topk=case.topk,
        moe_shared_expert_intermediate_size=case.shared_ffn,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=ep_size,
        params_dtype=case.dtype, bf16=case.dtype == torch.bfloat16,
        use_cpu_initialization=case.device == "cpu", init_method_std=0.1,
        moe_router_pre_softmax=case.topk == 1,  # Megatron requires it for top-1 softmax routing
        moe_router_dtype="fp32",  # routing decisions from fp32 logits in every dtype
    )  # fmt: skip


def build_moe_layer(case: LayerCase, kind: str, ep_size: int, **config_overrides):
    """An MoE layer of ``kind`` (one of LAYER_KINDS) on ``case.device``; ``config_overrides``
    set TransformerConfig fields (e.g. ``use_cpu_initialization=False``) after tiny_moe_config."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from .layer_specs import get_mok_moe_module_spec

    if kind not in LAYER_KINDS:
        raise ValueError(f"kind={kind!r} must be one of {LAYER_KINDS}")
    if kind == "alltoall":
        builder = get_moe_module_spec(use_te=False, num_experts=case.num_experts)
    else:
        builder = get_mok_moe_module_spec(
            use_te=False, fused_experts=kind == "mok_fused", backend=case.backend
        )
    dispatcher = "alltoall" if kind == "alltoall" else "mok"
    config = tiny_moe_config(case, dispatcher, ep_size)
    for field, value in config_overrides.items():
        setattr(config, field, value)
    layer = builder(config=config, pg_collection=get_default_pg_collection(), is_mtp_layer=False)
    return layer.to(case.device)


def share_weights(src, dst, directory: str, prefix: str = "mlp.", metadata=None) -> None:
    """Copy ``src``'s weights into ``dst`` through a distributed checkpoint (a collective);
    ``metadata`` goes to both ``sharded_state_dict`` calls (e.g. ``singleton_local_shards``)."""
    import os

    from megatron.core import dist_checkpointing

    require_checkpoint_writer()
    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(src.sharded_state_dict(prefix=prefix, metadata=metadata), directory)
    loaded = dist_checkpointing.load(
        dst.sharded_state_dict(prefix=prefix, metadata=metadata), directory
    )
    dst.load_state_dict({k[len(prefix) :]: v for k, v in loaded.items()}, strict=True)


def canonical_weights(layer) -> dict[str, torch.Tensor]:
    """This rank's weights of an MoE layer in layer_step's canonical names (CPU float64 copies):
    router, ``expert{j}.gate|up|down`` per local expert, ``shared.gate|up|down``."""
    from .experts import MoKExperts

    weights = {"router": layer.router.weight}
    experts = layer.experts
    if isinstance(experts, MoKExperts):
        weights.update(_mok_expert_tensors(experts.weight_gate_up, experts.weight_down))
    else:
        for j, mlp in enumerate(experts.local_experts):
            weights.update(_fc_weights(f"expert{j}", mlp))
    if layer.shared_experts is not None:
        weights.update(_fc_weights("shared", layer.shared_experts))
    return {k: v.detach().double().cpu() for k, v in weights.items()}


def _fc_weights(name: str, mlp) -> dict[str, torch.Tensor]:
    gate, up = mlp.linear_fc1.weight.chunk(2, dim=0)
    return {f"{name}.gate": gate, f"{name}.up": up, f"{name}.down": mlp.linear_fc2.weight}


def assert_same_weights(actual, expected) -> None:
    """Raise unless two MoE layers hold equal weights on this rank (every local shard, compared
    on the CPU after rounding both to the lower-precision dtype), e.g. after share_weights."""
    a, e = canonical_weights(actual), canonical_weights(expected)
    if set(a) != set(e):
        raise AssertionError(f"different weights: {sorted(set(a) ^ set(e))}")
    dtypes = (actual.router.weight.dtype, expected.router.weight.dtype)
    dtype = max(dtypes, key=lambda d: torch.finfo(d).eps)  # the lower precision
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    bad = []
    for name in e:
        if a[name].shape != e[name].shape:
            bad.append(f"{name}: shape {tuple(a[name].shape)} vs {tuple(e[name].shape)}")
        elif not torch.equal(a[name].to(dtype), e[name].to(dtype)):
            bad.append(f"{name}: max |diff| {float((a[name] - e[name]).abs().max()):.3e}")
    if bad:
        raise AssertionError(
            f"rank {rank}: the layers do not hold the same weights after sharing:\n"
            + "\n".join(bad)
            + "\n(only the router / shared expert differing: the ranks built different copies of "
            "these replicated weights; seed every generator alike, see init_megatron_parallel)"
        )


def require_checkpoint_writer() -> None:
    """Megatron's torch_dist checkpoint writer imports psutil when it writes; fail up front."""
    try:
        import psutil  # noqa: F401
    except ImportError:
        raise ImportError(
            "Megatron-Core's distributed checkpoint writer needs psutil (not a megatron-core "
            "dependency); pip install psutil"
        ) from None


def layer_step(layer, x: torch.Tensor, d_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """Forward + backward of one layer: out, d_x and every gradient (CPU float64 copies).

    x, d_out: [S, B, H]. Expert gradients are named ``expert{j}.gate|up|down`` (local expert j,
    Megatron's fc1 split into its [gate; up] halves) whatever the expert module.
    """
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out, _ = layer(x)
    out.backward(d_out)
    result = {"out": out, "d_x": x.grad, "router": layer.router.weight.grad}
    result.update(_expert_grads(layer.experts))
    if layer.shared_experts is not None:
        result.update(_fc_grads("shared", layer.shared_experts))
    return {k: v.detach().double().cpu() for k, v in result.items()}


def _expert_grads(experts) -> dict[str, torch.Tensor]:
    from .experts import MoKExperts

    if isinstance(experts, MoKExperts):
        gate_up, down = (_grad_or_zeros(p) for p in (experts.weight_gate_up, experts.weight_down))
        return _mok_expert_tensors(gate_up, down)
    grads = {}
    for j, mlp in enumerate(experts.local_experts):  # SequentialMLP
        grads.update(_fc_grads(f"expert{j}", mlp))
    return grads


def _mok_expert_tensors(gate_up, down) -> dict[str, torch.Tensor]:
    """MoKExperts' gate_up [E_l, 2I, H] (interleaved) and down [E_l, H, I] weights or gradients
    as ``expert{j}.gate|up|down``."""
    from mok_megatron.ops import deinterleave_gate_up

    gate, up = deinterleave_gate_up(gate_up, dim=-2)
    tensors = {}
    for j in range(len(down)):
        tensors |= {f"expert{j}.gate": gate[j], f"expert{j}.up": up[j], f"expert{j}.down": down[j]}
    return tensors


def _fc_grads(name: str, mlp) -> dict[str, torch.Tensor]:
    """An MLP's fc1 [2I, H] = [gate; up] and fc2 [H, I] gradients, canonically named."""
    fc1, fc2 = (_grad_or_zeros(lin.weight) for lin in (mlp.linear_fc1, mlp.linear_fc2))
    gate, up = fc1.chunk(2, dim=0)
    return {f"{name}.gate": gate, f"{name}.up": up, f"{name}.down": fc2}


def _grad_or_zeros(p: torch.Tensor) -> torch.Tensor:
    """An expert that received no token may have no gradient; that gradient is zero."""
    return p.grad if p.grad is not None else torch.zeros_like(p)


def relative_errors(actual: dict, expected: dict) -> dict[str, float]:
    """‖a − e‖ / ‖e‖ per entry (inf on a NaN/Inf or a missing gradient)."""
    if set(actual) != set(expected):
        raise KeyError(f"different gradients: {sorted(set(actual) ^ set(expected))}")
    errors = {}
    for name, e in expected.items():
        a = actual[name]
        finite = bool(torch.isfinite(a).all() and torch.isfinite(e).all())
        denom = float(e.norm()) or 1.0
        errors[name] = float((a - e).norm()) / denom if finite else float("inf")
    return errors


def full_recompute_losses(run, checkpoint_dir: str) -> dict:
    """The GPT run ``run`` with the mok dispatcher trained twice from one start (saved to and
    loaded from ``checkpoint_dir``): without recompute and with Megatron's full activation
    recompute (``--recompute-granularity full``: each transformer layer's forward run without
    gradients, rerun in the backward). Returns both runs' losses and, per run, how often the MoK
    layer's forward ran (``functional.api.forward``: "layer") and how often the megakernel's
    (``functional.cuda.mega.forward``: "megakernel"); a recomputed layer runs twice per pass."""
    from mok_megatron.functional import api
    from mok_megatron.functional.cuda import mega

    from .training import train

    calls: list[dict[str, int]] = []
    sites = {"layer": (api, "forward"), "megakernel": (mega, "forward")}
    originals = {key: getattr(module, name) for key, (module, name) in sites.items()}

    def counting(key):
        def call(*args, **kwargs):
            calls[-1][key] += 1
            return originals[key](*args, **kwargs)

        return call

    for key, (module, name) in sites.items():
        setattr(module, name, counting(key))
    try:
        calls.append(dict.fromkeys(sites, 0))
        plain = train(run, "mok", save_initial_to=checkpoint_dir, progress=False).losses
        full = dataclasses.replace(
            run, training=dataclasses.replace(run.training, recompute_granularity="full")
        )
        calls.append(dict.fromkeys(sites, 0))
        recomputed = train(full, "mok", load_from=checkpoint_dir, progress=False).losses
    finally:
        for key, (module, name) in sites.items():
            setattr(module, name, originals[key])
    return {"plain": plain, "recomputed": recomputed, "calls": calls}
