"""``MoKMoELayer``: Megatron's ``MoELayer`` with the MoK dispatcher (and, usually, fused experts).

Megatron-Core 0.19 picks a layer's dispatcher by the string ``moe_token_dispatcher_type`` inside
``MoELayer.__init__`` and rejects strings it does not know, so the MoK layer arrives through the
layer spec: ``MoKMoELayer`` builds the parent with a stock dispatcher, then installs
``MoKTokenDispatcher``. It stays an ``MoELayer`` (``TransformerLayer`` checks ``isinstance``),
so router, aux losses, shared experts, recompute and checkpointing are Megatron's own code.

With ``MoKExperts`` the layer is fused: one ``functional.moe`` call dispatches, runs the experts
and combines, and can also run the shared expert (``fuse_shared_experts``), whose parameters stay
in Megatron's ``SharedExpertMLP`` (same checkpoint keys either way).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.distributed as dist
from megatron.core import utils as mcore_utils
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

from mok_megatron import functional
from mok_megatron.functional.workspace import workspace_cache_generation

from .experts import MoKExperts
from .token_dispatcher import MoKTokenDispatcher

__all__ = ["MoKMoELayer", "MOK_DISPATCHER_TYPE"]

MOK_DISPATCHER_TYPE = "mok"


class MoKMoELayer(MoELayer):
    """An ``MoELayer`` whose tokens move through MoK.

    Args (besides ``MoELayer``'s: config, submodules, layer_number, pg_collection, is_mtp_layer,
    name):
        mok_config: ``functional.MoKConfig``, a dict of its fields, or None (Megatron-LM's
            ``--mok-*`` flags when they were parsed, else the defaults).
        backend: ``"auto"`` (CUDA kernels where they serve the shape, else the reference),
            ``"reference"`` or ``"cuda"``.
        fuse_shared_experts: run the shared expert inside the fused call. None: whenever it can
            (``SharedExpertMLP`` without gate, tensor-parallel size 1); True: require it.
        max_local_tokens: the most tokens one rank passes in a forward (sequence × micro-batch /
            TP); None: the largest first-call token count over the EP group.
    """

    def __init__(
        self,
        config,
        submodules=None,
        layer_number=None,
        pg_collection=None,
        is_mtp_layer=False,
        name=None,
        *,
        mok_config=None,
        backend="auto",
        fuse_shared_experts=None,
        max_local_tokens=None,
    ):
        _check_layer_config(config)
        pg_collection = pg_collection or get_default_pg_collection()
        with _stock_dispatcher_type(config):
            super().__init__(config, submodules, layer_number, pg_collection, is_mtp_layer, name)
        fused = isinstance(self.experts, MoKExperts)
        self.token_dispatcher = MoKTokenDispatcher(
            self.num_local_experts, self.local_expert_indices, config, pg_collection, fused
        )
        self.fuse_shared_experts = fused and _resolve_shared_fusion(
            fuse_shared_experts, self.shared_experts, pg_collection
        )
        if fused:
            from .arguments import honour_megatron_fp8, resolve_mok_config

            runtime = FusedRuntime(
                honour_megatron_fp8(resolve_mok_config(mok_config), config), backend,
                self.ep_group, max_local_tokens,
                self.shared_experts if self.fuse_shared_experts else None,
            )  # fmt: skip
            self.experts.bind(runtime)

    def shared_experts_compute(self, hidden_states):
        """The shared expert runs inside the fused call when ``fuse_shared_experts``."""
        if self.fuse_shared_experts:
            return None
        return super().shared_experts_compute(hidden_states)


class FusedRuntime:
    """What the fused experts need besides their weights: config, workspace, shared expert.

    Not an ``nn.Module``: it references the layer's shared expert without registering it twice.
    """

    def __init__(self, mok_config, backend, ep_group, max_local_tokens, shared_experts):
        self.mok_config, self.backend, self.ep_group = mok_config, backend, ep_group
        self.max_local_tokens = max_local_tokens
        self.shared_experts = shared_experts
        self.last_workspace = None  # the workspace of the latest call (benchmarks report it)
        self._kept: _KeptWorkspace | None = None  # the latest workspace() call's

    def run(self, x, topk_experts, router_weights, routed, wgrad_accumulators=None,
            accumulated_grad=None):  # fmt: skip
        """x: [T, H]; topk_experts / router_weights: [T, K]; routed: the routed experts' weights,
        (gate [E_l, I, H], up [E_l, I, H], down [E_l, H, I]) or the fused form (gate_up
        [E_l, 2I, H] interleaved, None, down) that ``MoKExperts`` passes. wgrad_accumulators /
        accumulated_grad: ``functional.moe``'s (the experts' main_grads and Megatron's
        placeholder under gradient-accumulation fusion), or None.

        Returns out: [T, H] = routed experts (+ the shared expert when fused), on local tokens.
        """
        ws = self.last_workspace = self.workspace(x, topk_experts, routed)
        return functional.moe(
            x, topk_experts, router_weights, *routed, shared=self.shared_weights(),
            config=self._kept.config, workspace=ws, wgrad_accumulators=wgrad_accumulators,
            accumulated_grad=accumulated_grad if wgrad_accumulators is not None else None,
        )  # fmt: skip

    def shared_weights(self):
        """(gate [I_s, H], up [I_s, H], down [H, I_s]) views of SharedExpertMLP's weights."""
        if self.shared_experts is None:
            return None
        fc1 = self.shared_experts.linear_fc1.weight  # [2 I_s, H] = [gate; up]
        gate, up = fc1.chunk(2, dim=0)  # row blocks of a contiguous matrix stay contiguous
        return gate, up, self.shared_experts.linear_fc2.weight

    def workspace(self, x, topk_experts, routed):
        """The cached ``functional`` workspace for this shape (made once, collectively).

        The latest call's is kept and given again while ``get_workspace`` would give it: for
        the same config, group, backend and shape, with no ``clear_workspace_cache()`` since
        (get_workspace builds, sorts and hashes its key on every call: host time per forward)."""
        shape = self._workspace_shape(x, topk_experts, routed)
        key = (self.mok_config, self.ep_group, self.backend, shape, workspace_cache_generation())
        if self._kept is None or self._kept.key != key:
            ws = functional.get_workspace(
                self.mok_config, self.ep_group, **shape._asdict(), backend=self.backend
            )
            # NOTE: calls pass the workspace's own config object where it equals ours (the
            # cache keys by value: another layer's equal config made it), so the API's config
            # checks take their identity test, not two field-by-field compares per call
            same = ws.given_config == self.mok_config
            self._kept = _KeptWorkspace(key, ws, ws.given_config if same else self.mok_config)
        return self._kept.workspace

    def _workspace_shape(self, x, topk_experts, routed) -> _WorkspaceShape:
        gate_rows = routed[0].shape[1]  # I, or 2I in the fused form (routed[1] is None)
        return _WorkspaceShape(
            device=x.device, num_local_tokens=self._max_tokens(x), hidden_size=x.shape[1],
            topk=topk_experts.shape[1],
            num_experts=routed[0].shape[0] * mcore_utils.get_pg_size(self.ep_group),
            intermediate_size=gate_rows // 2 if routed[1] is None else gate_rows,
            shared_intermediate_size=self._shared_intermediate_size(), dtype=x.dtype,
        )  # fmt: skip

    def _shared_intermediate_size(self) -> int:
        """I_s, the rows of ``shared_weights()``' gate (0 without a fused shared expert), from
        fc1's shape: no chunk of the weight (a view with an autograd node, on every forward)."""
        if self.shared_experts is None:
            return 0
        return (self.shared_experts.linear_fc1.weight.shape[0] + 1) // 2  # chunk(2)'s first

    def _max_tokens(self, x) -> int:
        if self.max_local_tokens is None:
            self.max_local_tokens = _max_over_group(x.shape[0], self.ep_group, x.device)
        if x.shape[0] > self.max_local_tokens:
            raise ValueError(
                f"MoKMoELayer got {x.shape[0]} tokens on this rank but its workspace holds "
                f"max_local_tokens={self.max_local_tokens}; pass max_local_tokens (sequence length "
                "x micro-batch size / TP) to get_mok_moe_module_spec()"
            )
        return self.max_local_tokens


class _KeptWorkspace(NamedTuple):
    """``FusedRuntime.workspace``'s latest answer and what it was for."""

    key: tuple  # (config, group, backend, _WorkspaceShape, workspace_cache_generation())
    workspace: functional.MoKWorkspace
    config: functional.MoKConfig  # the object calls pass: the workspace's own where it is equal


class _WorkspaceShape(NamedTuple):
    """``functional.get_workspace``'s shape arguments for one call of the fused layer."""

    device: torch.device
    num_local_tokens: int
    hidden_size: int
    topk: int
    num_experts: int
    intermediate_size: int
    shared_intermediate_size: int
    dtype: torch.dtype


def _max_over_group(value: int, group, device) -> int:
    """The largest ``value`` over the ranks of ``group`` (a one-time collective)."""
    if not dist.is_initialized() or mcore_utils.get_pg_size(group) == 1:
        return value
    on = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.int64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def _resolve_shared_fusion(requested, shared_experts, pg_collection) -> bool:
    """Whether the fused call runs the shared expert; raise if it was required but cannot."""
    if shared_experts is None or requested is False:
        return False
    reasons = []
    if type(shared_experts) is not SharedExpertMLP:
        reasons.append(f"the shared expert is a {type(shared_experts).__name__}")
    if shared_experts.use_shared_expert_gate:
        reasons.append("the shared expert has a gate (moe_shared_expert_gate)")
    if mcore_utils.get_pg_size(pg_collection.tp) > 1:
        reasons.append("tensor parallelism shards the shared expert")
    if reasons and requested:
        raise ValueError(
            f"fuse_shared_experts=True but {'; '.join(reasons)}; pass fuse_shared_experts=None "
            "(fuse when possible) or False"
        )
    return not reasons


def _check_layer_config(config) -> None:
    """Raise for a TransformerConfig the MoK layer cannot serve. ``gradient_accumulation_fusion``
    needs no rule: MoKExperts honours it (experts.py) and Megatron's experts behind
    MoKTokenDispatcher handle it themselves."""
    if config.moe_token_dispatcher_type != MOK_DISPATCHER_TYPE:
        raise ValueError(
            f"MoKMoELayer needs moe_token_dispatcher_type='mok', got "
            f"{config.moe_token_dispatcher_type!r}; pass --moe-token-dispatcher-type mok (or use "
            "Megatron's own layer spec for other dispatchers)"
        )
    unsupported = {
        "moe_pad_expert_input_to_capacity": "token padding to capacity (MoK is dropless)",
        "moe_router_padding_for_quantization": "router padding for FP8/FP4",
        "moe_latent_size": "latent MoE projections",
    }
    for field, what in unsupported.items():
        if getattr(config, field, None):
            raise ValueError(
                f"moe_token_dispatcher_type='mok' does not support {what}: unset {field}"
            )
    if config.transformer_impl == "inference_optimized":
        raise ValueError("moe_token_dispatcher_type='mok' does not support inference_optimized")


@contextlib.contextmanager
def _stock_dispatcher_type(config):
    """Let ``MoELayer.__init__`` build a throw-away stock dispatcher; restore 'mok' after."""
    config.moe_token_dispatcher_type = "allgather"
    try:
        yield
    finally:
        config.moe_token_dispatcher_type = MOK_DISPATCHER_TYPE
