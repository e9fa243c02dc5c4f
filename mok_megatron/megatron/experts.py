"""``MoKExperts``: the routed experts' SwiGLU MLP, fused with dispatch and combine.

One ``functional.moe`` call does the whole routed part of the layer (a collective over the EP
group): it takes the local tokens and their routing, not pre-dispatched rows, so it works behind
``MoKTokenDispatcher`` in fused mode only.

Parameters (per rank, E_l local experts, I = moe_ffn_hidden_size, H = hidden_size):
``weight_gate_up`` [E_l, 2I, H] and ``weight_down`` [E_l, H, I], each marked ``allreduce = False``
(expert parameters: Megatron's DDP reduces them over the expert-data-parallel group only).
``weight_gate_up`` holds each expert's gate and up rows interleaved in blocks of 8
(``ops.interleave_gate_up``): the form ``functional.moe`` takes as ``(gate_up, None, down)``, so
the CUDA backend runs gate and up as one GEMM with SwiGLU in its epilogue, without copying the
weight every pass. Megatron's experts hold ``linear_fc1`` [2I, H] = [gate; up] and
``linear_fc2`` [H, I] per expert; ``sharded_state_dict`` writes exactly their
distributed-checkpoint tensors (same keys, shapes, offsets and replica ids; the gate/up halves
de-interleaved on save, re-interleaved on load), so a checkpoint moves between
``SequentialMLP`` / ``TEGroupedMLP`` (alltoall) and ``MoKExperts`` (mok) in both directions.

Initial values: for the same seed, the weights ``init_order`` names would start from, bitwise
(interleaved): ``"sequential_mlp"`` (default; what Megatron builds without TE, and with TE
without ``moe_grouped_gemm``) draws expert by expert, fc1 then fc2, through Megatron's own
linears' init paths; ``"te_grouped_mlp"`` (what the MoK layer specs pick where the stock spec
builds ``TEGroupedMLP``) draws every expert's fc1, then every fc2, as TE's GroupedLinear does.
So a same-seed run starts from the same model whichever dispatcher it uses.

Gradient-accumulation fusion: with ``config.gradient_accumulation_fusion`` and a float32
``main_grad`` on both weights (as Megatron's DDP gives them with ``grad_reduce_in_fp32``), the
backward adds the weight gradients straight into ``main_grad`` (on the CUDA engine, inside the
weight-gradient GEMM) and hands autograd Megatron's placeholder, as
``LinearWithGradAccumulationAndAsyncCommunication`` does: ``grad_added_to_main_grad`` set and a
dummy gradient (zeros under ``zero_out_wgrad``) where the weight has that attribute, else None.
The down weight's dummy comes from the backward's first step and gate_up's from its second
(``functional.moe``), so DDP's hook drops the first before the second is made.
Without main_grad, with the flag off, or with a main_grad MoK cannot add into (not float32, not
16-byte aligned: said once in a warning), the gradients go through ``.grad`` as before.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (
    _get_extra_state_offsets,
    ensure_metadata_has_dp_cp_group,
)

from mok_megatron.functional.api import TENSOR_ALIGN_BYTES
from mok_megatron.ops.grouped_gemm import (
    SWIGLU_INTERLEAVE,
    deinterleave_gate_up,
    interleave_gate_up,
)

__all__ = ["INIT_ORDERS", "MoKExperts", "check_mok_experts_config", "main_grad_placeholder"]

_GATE, _UP = 0, 1  # NOTE: Megatron's SwiGLU fc1 is [gate; up]: gate is chunk 0, up chunk 1.

SEQUENTIAL_MLP, TE_GROUPED_MLP = "sequential_mlp", "te_grouped_mlp"
INIT_ORDERS = (SEQUENTIAL_MLP, TE_GROUPED_MLP)  # whose same-seed initial weights MoKExperts has


def check_mok_experts_config(config) -> None:
    """Raise a clear error for a TransformerConfig the fused experts cannot serve.

    ``gradient_accumulation_fusion`` needs no rule: either value is served (module docstring);
    unlike Megatron's own linear layers, MoK does not need APEX's fused_weight_gradient_mlp_cuda.
    """
    rules = [
        (config.gated_linear_unit and config.activation_func is F.silu,
         "the experts must be SwiGLU (gated_linear_unit=True, activation_func=silu; --swiglu)"),
        (config.glu_linear_offset == 0.0 and config.activation_func_clamp_value is None,
         "plain SwiGLU only (glu_linear_offset=0, activation_func_clamp_value=None)"),
        (config.moe_mlp_glu_interleave_size is None, "moe_mlp_glu_interleave_size must be None"),
        (not config.add_bias_linear, "expert biases are not supported; use --disable-bias-linear"),
        (not config.moe_apply_probs_on_input, "moe_apply_probs_on_input is not supported"),
        (not config.moe_latent_size, "moe_latent_size (latent MoE) is not supported"),
        (not (config.fp8 or config.fp4), "fp8/fp4 recipes are not supported yet; use bf16"),
        ((config.expert_tensor_parallel_size or 1) == 1,
         "expert_tensor_parallel_size must be 1 (MoK shards experts over EP only)"),
        (config.moe_ffn_hidden_size % SWIGLU_INTERLEAVE == 0,
         f"moe_ffn_hidden_size={config.moe_ffn_hidden_size} must be a multiple of "
         f"{SWIGLU_INTERLEAVE} (the gate/up interleave block)"),
    ]  # fmt: skip
    for ok, rule in rules:
        if not ok:
            raise ValueError(f"MoKExperts: {rule}; or use Megatron's experts with mok dispatch")


class MoKExperts(MegatronModule):
    """Fused routed experts; Megatron's experts interface (``forward``, ``backward_dw``).

    Args:
        num_local_experts: E_l.
        config: Megatron's TransformerConfig (SwiGLU, no bias, expert TP 1).
        pg_collection: process groups; ``.ep`` is the expert-parallel group, ``.expt_dp`` the
            expert-data-parallel group (checkpoint replica ids).
        name: module name, unused (Megatron passes it).
    """

    def __init__(
        self, num_local_experts, config, *, pg_collection, name=None, init_order=SEQUENTIAL_MLP
    ):
        super().__init__(config=config)
        del name
        check_mok_experts_config(config)
        if init_order not in INIT_ORDERS:
            raise ValueError(f"MoKExperts: init_order={init_order!r} must be one of {INIT_ORDERS}")
        self.num_local_experts, self.init_order = num_local_experts, init_order
        self.ep_group, self.dp_group = pg_collection.ep, pg_collection.expt_dp
        h, i = config.hidden_size, config.moe_ffn_hidden_size
        self.weight_gate_up = self._param((num_local_experts, 2 * i, h))  # interleaved
        self.weight_down = self._param((num_local_experts, h, i))
        self.reset_parameters()
        # Set by MoKMoELayer.bind(); plain attributes, not submodules.
        self.__dict__["_layer_runtime"] = None

    def _param(self, shape) -> torch.nn.Parameter:
        device = "cpu" if self.config.use_cpu_initialization else _default_device()
        p = torch.nn.Parameter(torch.empty(shape, dtype=self.config.params_dtype, device=device))
        p.allreduce = False  # expert parameter: reduced over the expert-data-parallel group
        return p

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The values Megatron's experts of ``init_order`` hold for the same seed (module
        docstring): fc1 [2I, H] = [gate; up] by ``init_method``, fc2 [H, I] by
        ``output_layer_init_method``, drawn in that module's order, dtype, device and RNG."""
        if not self.config.perform_initialization:
            return
        num_local, draw = self.num_local_experts, _Drawer(self)
        if self.init_order == SEQUENTIAL_MLP:  # expert by expert: fc1, fc2
            for e in range(num_local):
                self._set_fc1(e, draw.fc1())
                self.weight_down[e].copy_(draw.fc2())
        else:  # TE_GROUPED_MLP: one grouped linear after the other
            for e in range(num_local):
                self._set_fc1(e, draw.fc1())
            for e in range(num_local):
                self.weight_down[e].copy_(draw.fc2())

    def _set_fc1(self, expert: int, fc1: torch.Tensor) -> None:
        gate, up = fc1.chunk(2, dim=0)  # chunks _GATE, _UP
        self.weight_gate_up[expert].copy_(interleave_gate_up(gate, up))

    def bind(self, runtime) -> None:
        """Called by ``MoKMoELayer``: ``runtime.run(x, routing, weights)`` does the fused call."""
        self.__dict__["_layer_runtime"] = runtime

    def forward(self, x, topk_experts, router_weights):
        """x: [T, H] local tokens; topk_experts: [T, K] int64 (what MoKTokenDispatcher passes in
        the ``tokens_per_expert`` slot in fused mode); router_weights: [T, K] float32.

        Returns (out [T, H], None): the routed experts' weighted sum (plus the shared expert when
        the layer fuses it), already combined back onto the local tokens.
        """
        if topk_experts.dim() != 2 or self._layer_runtime is None:
            raise TypeError(
                "MoKExperts needs MoKTokenDispatcher in fused mode (it dispatches and combines "
                "itself) and got Megatron's dispatched rows (tokens_per_expert of shape "
                f"{tuple(topk_experts.shape)}); build the layer with get_mok_moe_module_spec() or "
                "use SequentialMLP/TEGroupedMLP with another dispatcher"
            )
        weights = (self.weight_gate_up, None, self.weight_down)  # the fused gate/up form
        out = self._layer_runtime.run(
            x, topk_experts, router_weights, weights, wgrad_accumulators=self._main_grads(),
            accumulated_grad=main_grad_placeholder,
        )  # fmt: skip
        return out, None

    def backward_dw(self) -> None:
        """Weight gradients are computed inside the fused backward; nothing is deferred."""

    def _main_grads(self):
        """(weight_gate_up.main_grad, None, weight_down.main_grad) when the weight gradients go
        straight into them (gradient-accumulation fusion, module docstring), else None. Taken at
        the forward, as Megatron's linear layers take ``main_grad``."""
        if not self.config.gradient_accumulation_fusion:
            return None
        params = {"weight_gate_up": self.weight_gate_up, "weight_down": self.weight_down}
        if not all(hasattr(p, "main_grad") for p in params.values()):
            return None
        reasons = [why for name, p in params.items() if (why := _unusable_main_grad(name, p))]
        if reasons:
            _warn_once(
                f"MoKExperts: gradient_accumulation_fusion is on but {'; '.join(reasons)}; the "
                "expert weight gradients go through .grad (a separate add into main_grad)"
            )
            return None
        return (self.weight_gate_up.main_grad, None, self.weight_down.main_grad)

    # ---------------------------------------------------------------- distributed checkpoint
    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Megatron's expert checkpoint tensors: ``{prefix}experts.linear_fc1.weight`` (global
        [E, 2I, H], gate rows then up rows) and ``{prefix}experts.linear_fc2.weight`` ([E, H, I]),
        or per-expert keys when ``metadata['singleton_local_shards']``; plus the per-expert
        ``_extra_state`` objects Megatron's expert linears write (MoK's hold None)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        layout = _ExpertLayout(self, prefix, sharded_offsets, metadata)
        return {
            f"{prefix}weight_gate_up": layout.fc1_factory(self.weight_gate_up),
            f"{prefix}weight_down": layout.fc2_factory(self.weight_down),
            f"{prefix}_extra_state": layout.extra_states(self.num_local_experts),
        }

    def get_extra_state(self):
        """Nothing beyond the weights (the ``_extra_state`` slot keeps checkpoints symmetric)."""
        return None

    def set_extra_state(self, state) -> None:
        """Megatron experts' extra states (None, or TE's FP8 metadata) do not apply to MoK."""
        del state


def main_grad_placeholder(weight: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor | None:
    """The gradient autograd gets for ``weight`` once its gradient is in ``main_grad``: Megatron's
    contract (``LinearWithGradAccumulationAndAsyncCommunication.backward`` in
    megatron/core/tensor_parallel/layers.py). Where the weight has ``grad_added_to_main_grad``
    (DDP sets it), that becomes True and a dummy of main_grad's shape is returned, zeros under
    ``zero_out_wgrad`` (DDP's hook then adds it), so the hook runs on the main backward thread
    and skips its add; otherwise None. The dummy comes from Transformer Engine's reused buffer
    when TE is installed, as in Megatron."""
    from megatron.core.tensor_parallel import layers as mcore_layers

    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    shape, zero = list(main_grad.shape), getattr(weight, "zero_out_wgrad", False)
    # NOTE: the weight's dtype (Megatron: the input's, the same in its training): autograd would
    # cast a dummy of another dtype, a pass over a weight-sized tensor.
    if mcore_layers.HAVE_TE:
        grad = mcore_layers.get_dummy_wgrad(shape, weight.dtype, zero=zero)
    else:
        make = torch.zeros if zero else torch.empty
        grad = make(shape, dtype=weight.dtype, device=weight.device, requires_grad=False)
    weight.grad_added_to_main_grad = True
    return grad


def _unusable_main_grad(name: str, p: torch.Tensor) -> str | None:
    """Why MoK cannot add into ``p.main_grad`` (None: it can); functional.backward's rules."""
    grad = p.main_grad
    if grad.dtype != torch.float32:
        return (f"{name}.main_grad is {grad.dtype}; MoK accumulates into float32 only "
                "(DistributedDataParallelConfig(grad_reduce_in_fp32=True))")  # fmt: skip
    if grad.shape != p.shape or grad.device != p.device:
        return (f"{name}.main_grad {tuple(grad.shape)} on {grad.device} is not shaped and placed "
                f"like {name} {tuple(p.shape)} on {p.device}")  # fmt: skip
    if not grad.is_contiguous() or grad.data_ptr() % TENSOR_ALIGN_BYTES:
        return (f"{name}.main_grad is not a contiguous, {TENSOR_ALIGN_BYTES}-byte aligned "
                "buffer (the distributed optimizer aligns each parameter's; without it an offset "
                "may be any)")  # fmt: skip
    return None


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


class _ExpertLayout:
    """Where this rank's experts sit in Megatron's expert checkpoint tensors."""

    def __init__(self, experts: MoKExperts, prefix, sharded_offsets, metadata):
        self.prefix, self.offsets = prefix, tuple(sharded_offsets)
        self.singleton = bool(metadata.get("singleton_local_shards", False))
        self.num_global = experts.ep_group.size() * experts.num_local_experts
        self.first_global = experts.ep_group.rank() * experts.num_local_experts
        self.replica_id = (0, 0, experts.dp_group.rank())

    def fc1_factory(self, gate_up) -> ShardedTensorFactory:
        """Megatron's fc1 shards from the interleaved [E_l, 2I, H] weight: built from contiguous
        copies of each expert's gate and up halves, re-interleaved on load."""

        def build(key, data, replica_id, flattened_range):
            _check_not_flattened(flattened_range)
            halves = deinterleave_gate_up(data, dim=-2)  # (gate, up): chunks _GATE, _UP
            return [
                [self._shard(key, half[e], e, chunk, replica_id) for e in range(len(half))]
                for chunk, half in enumerate(halves)
            ]

        def merge(loaded: list[list[torch.Tensor]]) -> torch.Tensor:
            return interleave_gate_up(torch.stack(loaded[_GATE]), torch.stack(loaded[_UP]))

        key = f"{self.prefix}experts.linear_fc1.weight"
        return ShardedTensorFactory(key, gate_up, build, merge, self.replica_id)

    def fc2_factory(self, down) -> ShardedTensorFactory:
        """Megatron's per-expert fc2 shards: views of the [E_l, H, I] weight."""

        def build(key, data, replica_id, flattened_range):
            _check_not_flattened(flattened_range)
            return [self._shard(key, data[e], e, None, replica_id) for e in range(len(data))]

        key = f"{self.prefix}experts.linear_fc2.weight"
        return ShardedTensorFactory(key, down, build, _stack, self.replica_id)

    def extra_states(self, num_local: int) -> list[ShardedObject]:
        """The ``linear_fc{1,2}._extra_state`` objects Megatron's experts write, data None."""
        objects = []
        for local_idx in range(num_local):
            for linear in ("linear_fc1", "linear_fc2"):
                key, offsets = self._expert_key_and_offsets(
                    f"experts.{linear}._extra_state", local_idx
                )
                shape, offset = _get_extra_state_offsets(offsets)
                objects.append(ShardedObject(key, None, shape, offset, self.replica_id))
        return objects

    def _expert_key_and_offsets(self, name: str, local_idx: int):
        """Megatron's key and prepended offsets for one local expert's ``name``."""
        expert = self.first_global + local_idx
        if self.singleton:
            return f"{self.prefix}{name.replace('experts.', f'experts.{expert}.', 1)}", self.offsets
        offsets = (*self.offsets, (len(self.offsets), expert, self.num_global))
        return f"{self.prefix}{name}", offsets

    def _shard(self, key, data, local_idx, fc1_chunk, replica_id) -> ShardedTensor:
        expert = self.first_global + local_idx
        axis = len(self.offsets)
        if self.singleton:  # '...experts.linear_fc1.weight' -> '...experts.7.linear_fc1.weight_w'
            head, tail = key.rsplit("experts.", 1)
            key = f"{head}experts.{expert}.{tail}"
            key = key if fc1_chunk is None else f"{key}_{'wv'[fc1_chunk]}"
            offsets, prepend = self.offsets, axis
        else:
            offsets, prepend = (*self.offsets, (axis, expert, self.num_global)), axis + 1
        if fc1_chunk is not None and not self.singleton:
            offsets = (*offsets, (prepend, fc1_chunk, 2))
        return ShardedTensor.from_rank_offsets(
            key, data, *offsets, replica_id=replica_id, prepend_axis_num=prepend
        )


def _stack(loaded: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(loaded)


def _check_not_flattened(flattened_range) -> None:
    if flattened_range is not None:
        raise NotImplementedError("MoKExperts: flattened (fully-sharded) checkpoint shards")


def _default_device():
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


class _Drawer:
    """One expert's fc1 [2I, H] and fc2 [H, I] initial values, drawn the way the linears of
    ``experts.init_order`` draw them (Megatron-Core 0.19, expert TP 1):

    - ``sequential_mlp`` (ColumnParallelLinear / RowParallelLinear): with
      ``use_cpu_initialization`` a float32 master weight on the CPU from the default generator
      (no RNG fork), cast to ``params_dtype``; else the weight itself, ``params_dtype`` on the
      current device, under the expert-parallel RNG state;
    - ``te_grouped_mlp`` (TE's GroupedLinear): the weight itself, ``params_dtype`` on the CPU
      (``use_cpu_initialization``) or the current device, under the expert-parallel RNG state.

    Without Megatron's RNG tracker (Megatron itself would fail there) the default RNG is used.
    """

    def __init__(self, experts: MoKExperts):
        config = experts.config
        self.config, self.device = config, experts.weight_down.device
        self.cpu_master = experts.init_order == SEQUENTIAL_MLP and config.use_cpu_initialization
        self.dtype = torch.float32 if self.cpu_master else config.params_dtype
        self.fc1_shape = tuple(experts.weight_gate_up.shape[1:])  # [2I, H]
        self.fc2_shape = tuple(experts.weight_down.shape[1:])  # [H, I]

    def fc1(self) -> torch.Tensor:
        return self._draw(self.fc1_shape, self.config.init_method)

    def fc2(self) -> torch.Tensor:
        return self._draw(self.fc2_shape, self.config.output_layer_init_method)

    def _draw(self, shape, init_method) -> torch.Tensor:
        weight = torch.empty(shape, dtype=self.dtype, device=self.device)
        with nullcontext() if self.cpu_master else _expert_rng():
            init_method(weight)
        return weight.to(self.config.params_dtype)


def _expert_rng():
    """Megatron's expert-parallel RNG state if its tracker is set up, else the default RNG."""
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        get_expert_parallel_rng_tracker_name,
    )

    tracker = get_cuda_rng_tracker()
    name = get_expert_parallel_rng_tracker_name()
    if tracker.is_initialized() and name in tracker.get_states():
        return tracker.fork(name)
    return nullcontext()
