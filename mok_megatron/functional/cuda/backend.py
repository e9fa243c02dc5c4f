"""``CudaBackend``: what a CUDA workspace runs, behind the backend interface of ``functional``.

It serves a workspace only when every op it needs is compiled into ``mok_megatron._C``;
``unsupported_reasons`` says what is missing, and backend selection reports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mok_megatron.ops import moe as mops

from ..schedule import MoKSchedule
from . import mega, stage1
from .buffers import MAX_RANKS, CudaBuffers, allocate, allocate_virtual
from .plan import GROUP_ALIGN

if TYPE_CHECKING:
    from ..workspace import MoKWorkspace

__all__ = ["CudaBackend"]


class CudaBackend:
    name = "cuda"

    @staticmethod
    def unsupported_reasons(ws: MoKWorkspace) -> list[str]:
        from mok_megatron.ops import extension_error, has_op

        reasons = []
        if ws.device.type != "cuda":
            reasons.append(f"the workspace device is {ws.device}, not a CUDA device")
        if ws.dtype != torch.bfloat16:
            reasons.append(f"the CUDA backend takes bfloat16 activations, not {ws.dtype}")
        for name, size in (
            ("hidden_size", ws.hidden_size),
            ("intermediate_size", ws.intermediate_size),
        ):
            if size % GROUP_ALIGN:
                reasons.append(f"{name}={size} is not a multiple of {GROUP_ALIGN} (16-byte rows)")
        if ws.num_ranks > MAX_RANKS:
            reasons.append(
                f"{ws.num_ranks} expert-parallel ranks; the barrier serves <= {MAX_RANKS}"
            )
        missing = [op for op in mops.CUDA_OPS if not has_op(op)]
        if extension_error() is not None:
            reasons.append(f"mok_megatron._C did not load ({extension_error()})")
        elif missing:
            reasons.append(f"mok_megatron._C lacks the ops {missing}")
        return reasons

    @staticmethod
    def workspace_bytes(**shape) -> int:
        """The layout's bytes; with the megakernel's regions when the config asks for it on
        the current CUDA device (``mega.wanted``)."""
        from mok_megatron.ops import extension_error

        if extension_error() is not None:
            raise RuntimeError(
                f"the CUDA backend's workspace layout needs mok_megatron._C ({extension_error()})"
            )
        c = shape["config"]
        device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        )
        words = 0
        if mega.wanted(c, device):
            words = mega.mega_shape(
                c, shape["row_capacity"], shape["num_experts"] // shape["num_ranks"],
                shape["hidden_size"], shape["intermediate_size"],
            ).counter_words  # fmt: skip
        return mops.moe_workspace_layout(
            shape["num_ranks"],
            shape["num_local_tokens"],
            shape["topk"],
            shape["hidden_size"],
            words > 0,
            words,
        ).total_bytes

    def path(self, ws: MoKWorkspace) -> str:
        """The forward this workspace runs: "megakernel" (when its layout holds the
        megakernel's regions; calls with separate gate and up weights still take stage 1) or
        "stage1"."""
        return "megakernel" if ws.buffers is not None and ws.buffers.mega is not None else "stage1"

    # ------------------------------------------------------------------------------ workspace
    def allocate(self, ws: MoKWorkspace) -> CudaBuffers:
        return allocate(ws, self._mega_shape(ws))

    def allocate_virtual(self, workspaces: list[MoKWorkspace]) -> list[CudaBuffers]:
        return allocate_virtual(workspaces, self._mega_shape(workspaces[0]))

    @staticmethod
    def _mega_shape(ws: MoKWorkspace):
        """The megakernel's sizes when this workspace should run it (MoKConfig.cuda_forward),
        else None; 'megakernel' where it cannot run raises, saying why."""
        if not mega.wanted(ws.config, ws.device):
            return None
        reasons = mega.unsupported_reasons(ws.device)
        if reasons:  # only 'megakernel' is wanted where it cannot run
            raise RuntimeError(
                "MoKConfig.cuda_forward='megakernel' but the megakernel cannot run here: "
                + "; ".join(reasons)
                + "; use cuda_forward='auto' or 'stage1'"
            )
        return mega.mega_shape(ws.config, ws.row_capacity, ws.num_local_experts,
                               ws.hidden_size, ws.intermediate_size)  # fmt: skip

    # ------------------------------------------------------------------------------- schedule
    def build_schedule(self, ws: MoKWorkspace, topk_experts, router_weights=None) -> MoKSchedule:
        """Gather the routing (and the router weights, when given: one gather for both) and
        plan this rank's rows on the device. On the megakernel path the schedule is pending:
        the forward's one op call makes it (or the first read of one of its tensors)."""
        weights = router_weights
        if weights is None:  # gathered as zeros; forward gathers the weights it gets
            weights = torch.zeros(topk_experts.shape, dtype=torch.float32, device=ws.device)
        weights = weights.contiguous()
        if self.path(ws) == "megakernel":
            return mega.build_schedule(ws, topk_experts, weights, router_weights)
        num_tokens = topk_experts.shape[0]
        global_topk, global_weights = mops.moe_gather_routing(
            topk_experts.contiguous(), weights, ws.buffers.comm
        )
        fields = mops.moe_build_schedule(
            global_topk, ws.rank, ws.num_experts, ws.row_capacity, ws.token_capacity
        )
        names = MoKSchedule.INTEGER_FIELDS[1:]
        sched = MoKSchedule(
            rank=ws.rank, num_ranks=ws.num_ranks, num_tokens=num_tokens,
            max_tokens=ws.num_local_tokens, topk=ws.topk, num_local_experts=ws.num_local_experts,
            row_capacity=ws.row_capacity, token_capacity=ws.token_capacity,
            global_topk=global_topk, **dict(zip(names, fields)),
        )  # fmt: skip
        if router_weights is not None:
            sched.global_weights = global_weights
            sched.weights_source = (router_weights, router_weights._version)
        return sched

    # -------------------------------------------------------------------------------- passes
    def forward(self, ws, sched, x, router_weights, shared, routed, save: bool = True):
        if self.path(ws) == "megakernel":
            if mega.can_run(routed):
                return mega.forward(ws, sched, x, router_weights, shared, routed, save)
            if ws.config.cuda_forward == "megakernel":
                raise ValueError(
                    "MoKConfig.cuda_forward='megakernel' takes the fused gate/up weights "
                    "(gate_up [E_l, 2I, H] interleaved, None, down): MoKExperts' form, "
                    "ops.interleave_gate_up makes it; separate gate and up run on 'stage1'"
                )
        return stage1.forward(ws, sched, x, router_weights, shared, routed, save)

    def backward(self, ws, sched, ctx, d_out, x, router_weights, shared, routed, wgrad_acc=None):
        return stage1.backward(ws, sched, ctx, d_out, x, router_weights, shared, routed, wgrad_acc)

    def backward_steps(self, ws, sched, ctx, d_out, x, router_weights, shared, routed,
                       wgrad_acc=None):  # fmt: skip
        """``backward`` in two steps (``api.backward_steps``); consumes ``ctx``."""
        return stage1.backward_steps(ws, sched, ctx, d_out, x, router_weights, shared, routed,
                                     wgrad_acc)  # fmt: skip
