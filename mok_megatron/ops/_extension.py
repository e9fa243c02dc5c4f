"""Loads the CUDA extension ``mok_megatron._C`` once and says which of its ops are usable.

Importing ``_C`` runs its ``TORCH_LIBRARY(mok, ...)`` registrations, after which the ops are
``torch.ops.mok.<name>``. A missing or broken extension is not an error here: callers ask
:func:`extension_available` / :func:`has_op` and fall back to the reference backend, and
:func:`extension_error` says why it did not load.
"""

from __future__ import annotations

import importlib
import threading

import torch

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_error: str | None = None


def _load() -> bool:
    global _loaded, _error
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is None:
            try:
                importlib.import_module("mok_megatron._C")
                _loaded, _error = True, None
            except (ImportError, OSError) as exc:
                _loaded = False
                _error = f"{type(exc).__name__}: {exc}"
    return _loaded


def extension_available() -> bool:
    """True when ``mok_megatron._C`` imported (the CUDA ops are registered)."""
    return _load()


def extension_error() -> str | None:
    """Why ``mok_megatron._C`` did not import, or None when it did."""
    _load()
    return _error


#: has_op's answers once the extension is loaded (its registrations do not change after that;
#: the layer asks on every pass, and the dispatcher lookup is microseconds of host time).
_has_op: dict[str, bool] = {}


def has_op(name: str) -> bool:
    """True when ``torch.ops.mok.<name>`` exists and has a CUDA kernel."""
    known = _has_op.get(name)
    if known is not None:
        return known
    if not _load():
        return False
    try:
        found = torch._C._dispatch_has_kernel_for_dispatch_key(f"mok::{name}", "CUDA")
    except RuntimeError:  # no such operator
        found = False
    _has_op[name] = found
    return found
