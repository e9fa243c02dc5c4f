"""Run Megatron-Core 0.19 MoE code on a machine without a GPU (CPU + gloo): tests and the demo.

Megatron-Core assumes a GPU in a few places that a CPU run reaches:

- ``torch.cuda.current_device()`` as an allocation device: the router moves its weight there
  on every forward (``Router.gating``), the all-to-all / all-gather autograd functions
  allocate their outputs there, and so do rotary embeddings and the attention mask helpers;
- CUDA streams and events: ``MoEAlltoAllTokenDispatcher`` makes a stream in ``__init__`` and
  records an event on it in every forward (its device-to-host copy of the split sizes);
- the CUDA RNG tracker (``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()``);
- the alltoall dispatcher turns its split sizes into numpy arrays only as part of a
  device-to-host copy (``maybe_move_tensor_to_cpu``), so on CPU they would stay tensors, which
  ``all_to_all_single`` rejects.

``install()`` points exactly those ``torch.cuda`` entry points at CPU equivalents (the CPU
device, a no-op stream and event, the CPU generator), routes Megatron's two private RNG-state
helpers to the CPU generator, and makes the dispatcher's host copy of a CPU tensor produce the
numpy array the GPU path produces; only when ``torch.cuda.is_available()`` is false. On a GPU
machine it does nothing. It does replace attributes of ``torch.cuda`` and of those Megatron
modules (``_PATCHED_NAMES`` and the helpers below, the originals kept in ``_ORIGINALS``), for
the rest of the process; no Megatron function body changes, so Megatron's own alltoall dispatcher runs its own code
on CPU and stays a faithful parity oracle.
``mok_megatron.megatron``'s own modules need none of this: MoKTokenDispatcher and MoKExperts
allocate on their inputs' device.
"""

from __future__ import annotations

import contextlib
import logging

import torch

_INSTALLED = False
_ORIGINALS: dict[str, object] = {}
_PATCHED_NAMES = (
    "current_device",
    "Stream",
    "Event",
    "current_stream",
    "stream",
    "synchronize",
    "get_rng_state",
    "set_rng_state",
    "manual_seed",
)


class _CpuEvent:
    """A CUDA-event stand-in: CPU work is already complete when it is recorded."""

    def record(self, stream=None):
        """Nothing to record on CPU."""

    def synchronize(self):
        """Nothing to wait for on CPU."""

    def wait(self, stream=None):
        """Nothing to wait for on CPU."""

    def query(self) -> bool:
        """CPU work is always complete."""
        return True


class _CpuStream:
    """A CUDA-stream stand-in: CPU ops run in program order, so every wait is a no-op."""

    def __init__(self, *args, **kwargs):
        del args, kwargs

    def wait_stream(self, stream):
        """Program order already holds on CPU."""

    def wait_event(self, event):
        """Program order already holds on CPU."""

    def record_event(self, event=None):
        """Returns an event that is already complete."""
        return event if event is not None else _CpuEvent()

    def synchronize(self):
        """Nothing to wait for on CPU."""

    def __eq__(self, other):
        return isinstance(other, _CpuStream)

    def __hash__(self):
        return 0


_DEFAULT_STREAM = _CpuStream()


def _current_device():
    return torch.device("cpu")


def _current_stream(device=None):
    del device
    return _DEFAULT_STREAM


def _stream(stream):
    del stream
    return contextlib.nullcontext()


def _synchronize(device=None):
    del device


def _get_rng_state(device="cuda"):
    del device
    return torch.get_rng_state()


def _set_rng_state(new_state, device="cuda"):
    del device
    torch.set_rng_state(new_state)


def _manual_seed(seed):
    torch.manual_seed(seed)


_REPLACEMENTS = {
    "current_device": _current_device,
    "Stream": _CpuStream,
    "Event": _CpuEvent,
    "current_stream": _current_stream,
    "stream": _stream,
    "synchronize": _synchronize,
    "get_rng_state": _get_rng_state,
    "set_rng_state": _set_rng_state,
    "manual_seed": _manual_seed,
}


class _SameGeneratorFilter(logging.Filter):
    """The tracker warns when the CPU RNG changes inside a fork; on CPU the "CUDA" generator the
    fork swaps *is* the CPU one, so that change is the fork working as intended."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _patch_rng_tracker():
    """Megatron's RNG tracker sets CUDA generator state through private helpers; on CPU the
    tracked states are CPU generator states, so route those helpers to the CPU generator."""
    from megatron.core.tensor_parallel import random as mcore_random

    logging.getLogger(mcore_random.__name__).addFilter(_SameGeneratorFilter())
    _ORIGINALS["mcore_random._set_cuda_rng_state"] = mcore_random._set_cuda_rng_state
    _ORIGINALS["mcore_random._get_cuda_rng_state"] = mcore_random._get_cuda_rng_state
    mcore_random._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)
    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()


def _patch_host_copy():
    """``maybe_move_tensor_to_cpu(t, as_numpy=True)`` returns numpy only for CUDA tensors; make
    a CPU tensor take the same form, as the alltoall dispatcher's split sizes need."""
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu
    _ORIGINALS["token_dispatcher.maybe_move_tensor_to_cpu"] = original

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def install() -> bool:
    """Installs the CPU shim if (and only if) CUDA is unavailable; idempotent.

    Returns:
        True if the shim is active after the call, False on a machine with a usable GPU.
    """
    global _INSTALLED
    if _INSTALLED:
        return True
    if torch.cuda.is_available():
        return False
    for name in _PATCHED_NAMES:
        _ORIGINALS[name] = getattr(torch.cuda, name)
        setattr(torch.cuda, name, _REPLACEMENTS[name])
    _patch_rng_tracker()
    _patch_host_copy()
    _INSTALLED = True
    return True


def is_installed() -> bool:
    """Whether ``install()`` replaced the ``torch.cuda`` entry points in this process."""
    return _INSTALLED
