"""mok_megatron: a deterministic, fused, sync-free mixture-of-experts layer for Megatron-Core.

Subpackages are imported lazily (``mok_megatron.ops``, ``mok_megatron.functional``), so
``import mok_megatron`` works whether or not the CUDA extension or any subpackage loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY_SUBPACKAGES = ("functional", "ops")

__all__ = ["__version__", "functional", "ops"]

if TYPE_CHECKING:
    from mok_megatron import functional, ops


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBPACKAGES:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_SUBPACKAGES))
