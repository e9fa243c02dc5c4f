"""Backend selection: ``"auto" | "reference" | "cuda"``.

Every backend offers the same methods (see ``ReferenceBackend``): ``allocate``,
``workspace_bytes``, ``build_schedule``, ``forward``, ``backward``; and optionally
``backward_steps`` (``api.backward_steps``: the backward in two steps for autograd; the CUDA
backend's frees as it goes, and without it the whole ``backward`` runs at the first step). ``"auto"`` picks the CUDA
backend only where the compiled extension has every op a call needs; where it does not on a GPU,
it says so in a warning that names the missing ops, and never pretends the reference is fast.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .workspace import MoKWorkspace

__all__ = ["resolve_backend", "backend_class", "cuda_backend_missing"]


def backend_class(name: str):
    if name == "reference":
        from .reference import ReferenceBackend

        return ReferenceBackend
    if name == "cuda":
        from .cuda import CudaBackend

        return CudaBackend
    raise ValueError(f"backend={name!r} must be 'reference' or 'cuda'")


def cuda_backend_missing(ws: MoKWorkspace) -> list[str]:
    """Why the CUDA backend cannot serve ``ws``: an empty list when it can."""
    from .cuda import CudaBackend

    return CudaBackend.unsupported_reasons(ws)


def resolve_backend(choice: str, ws: MoKWorkspace):
    if choice == "reference":
        return backend_class("reference")()
    reasons = cuda_backend_missing(ws)
    if choice == "cuda":
        if reasons:
            raise RuntimeError(
                "backend='cuda' was asked for but cannot run this workspace: "
                + "; ".join(reasons)
                + ". Build the extension (pip install -e . --no-build-isolation with nvcc and a "
                "CUDA torch) or pass backend='reference'"
            )
        return backend_class("cuda")()
    if reasons and ws.device.type == "cuda":
        warnings.warn(
            "mok_megatron: the CUDA backend cannot run this workspace ("
            + "; ".join(reasons)
            + "); falling back to the slow pure-PyTorch reference backend",
            stacklevel=3,
        )
    return backend_class("reference" if reasons else "cuda")()
