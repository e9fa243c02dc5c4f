"""The CUDA backend: compiled kernels over symmetric memory (DESIGN.md, "Kernel roadmap").

It serves a workspace only when every op it needs is compiled into ``mok_megatron._C``;
``unsupported_reasons`` says what is missing, and backend selection reports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .workspace import MoKWorkspace

__all__ = ["CudaBackend", "REQUIRED_OPS"]

#: torch.ops.mok ops the stage-1 CUDA pass is built from.
REQUIRED_OPS = (
    "moe_build_schedule",
    "moe_dispatch",
    "moe_l1_swiglu",
    "moe_l2",
    "moe_combine",
)


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
        missing = [op for op in REQUIRED_OPS if not has_op(op)]
        if extension_error() is not None:
            reasons.append(f"mok_megatron._C did not load ({extension_error()})")
        elif missing:
            reasons.append(f"mok_megatron._C lacks the ops {missing}")
        return reasons

    @staticmethod
    def workspace_bytes(**shape) -> int:
        raise NotImplementedError(
            "the CUDA backend's workspace layout is not compiled in this build; "
            "use backend='reference'"
        )
