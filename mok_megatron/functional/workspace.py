"""The workspace: per-(group, shape, config) state that every pass of the MoK layer reuses.

It fixes the capacities (so shapes never depend on routing), picks the backend, checks that all
ranks hold the same config, owns backend buffers (symmetric memory on the CUDA backend) and the
error monitor that turns device-side error flags into host exceptions without a host sync.
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .config import MOK_ROW_ALIGN, LayerDims, MoKConfig, warn_ignored_knobs
from .schedule import MOK_ERR_EXPERT_ID, MOK_ERR_ROW_OVERFLOW

__all__ = [
    "MoKWorkspace",
    "ErrorMonitor",
    "MoKCapacityError",
    "create_workspace",
    "create_virtual_workspaces",
    "get_workspace",
    "workspace_bytes",
    "row_capacity",
    "clear_workspace_cache",
    "workspace_cache_generation",
    "poll_errors",
    "check_all_errors",
]

BACKEND_CHOICES = ("auto", "reference", "cuda")


class MoKCapacityError(RuntimeError):
    """Routing exceeded a capacity fixed when the workspace was made."""


class ErrorMonitor:
    """Turns device-side ``error_flags`` into exceptions at the next host-visible point.

    CPU flags are checked at once. CUDA flags are OR-ed into a device word, and every pass also
    enqueues a copy of that word into a pinned host word (a graph captures the copy, so each
    replay refreshes it too). ``poll()`` reads the host word: no CUDA call, so it never blocks
    and works while a graph is being captured; it raises for whatever the copies have brought
    back so far (in eager mode the pass before last at the latest; after a sync, everything).
    ``check()`` waits for the device first. Each workspace calls ``poll()`` when it plans a pass;
    ``functional.poll_errors()`` polls every live workspace (what a training loop calls where it
    syncs anyway, e.g. for logging, so a CUDA-graph replay that overflowed is reported too).
    """

    def __init__(self, num_experts: int, device: torch.device | None = None) -> None:
        self.num_experts = num_experts
        self._accum: torch.Tensor | None = None  # device int32 [1]
        self._host: torch.Tensor | None = None  # pinned int32 [1]
        if device is not None and device.type == "cuda":
            # NOTE: made here, not in a pass: a pinned allocation may wait for the device, which
            # would deadlock ranks whose passes wait for each other (virtual ranks) or a capture.
            self._accum = torch.zeros(1, dtype=torch.int32, device=device)
            self._host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            # poll() reads the word through numpy: a tensor index + int() is microseconds of
            # host time on every pass; the array shares the pinned memory.
            self._host_word = self._host.numpy()

    def submit(self, flags: torch.Tensor, where: str) -> None:
        if flags.device.type != "cuda":
            self._raise_for(int(flags.max().item()), where)
            return
        if self._accum is None:
            raise RuntimeError("ErrorMonitor got CUDA flags but was made for a CPU workspace")
        # NOTE: the schedules' flags are one int32 word: OR-ed in as they are (two ops a pass,
        # where max / reshape / to were three more of host time before the forward's kernels).
        if flags.numel() != 1 or flags.dtype != torch.int32:
            flags = flags.max().to(torch.int32)
        self._accum.bitwise_or_(flags)
        self._host.copy_(self._accum, non_blocking=True)

    def poll(self) -> None:
        """Raise if a finished copy brought back an error bit; never blocks."""
        if self._host is not None:
            bits = int(self._host_word[0])
            if bits:
                self._clear()
                self._raise_for(bits, "an earlier MoK pass")

    def check(self) -> None:
        """Wait for the device and raise if any pass so far recorded an error (a host sync)."""
        if self._accum is not None:
            torch.cuda.synchronize(self._accum.device)
        self.poll()

    def _clear(self) -> None:
        self._host.zero_()
        if not torch.cuda.is_current_stream_capturing():
            self._accum.zero_()

    def _raise_for(self, bits: int, where: str) -> None:
        if bits & MOK_ERR_EXPERT_ID:
            raise ValueError(
                f"{where}: topk_experts holds an expert id outside [-1, {self.num_experts}) "
                "(-1 marks an empty slot); check the router's output"
            )
        if bits & MOK_ERR_ROW_OVERFLOW:
            raise MoKCapacityError(
                f"{where}: more routed rows reached a rank than the schedule holds, so some were "
                "not computed; raise MoKConfig.schedule_capacity_multiplier (--mok-schedule-"
                "capacity-multiplier); a value >= the expert-parallel size never overflows"
            )


_LIVE: weakref.WeakSet = weakref.WeakSet()


def poll_errors() -> None:
    """``ErrorMonitor.poll()`` on every live workspace: raise for any error the device recorded
    that has reached the host. Never blocks; call it where the host syncs anyway (after a
    training step's loss reaches the host), so nothing a CUDA-graph replay records goes unseen."""
    for ws in list(_LIVE):
        ws.monitor.poll()


def check_all_errors() -> None:
    """``ErrorMonitor.check()`` on every live workspace (waits for the device)."""
    for ws in list(_LIVE):
        ws.monitor.check()


@dataclass(eq=False)
class MoKWorkspace:
    """State shared by every pass of one MoK layer shape on one expert-parallel group."""

    config: MoKConfig
    group: dist.ProcessGroup | None
    rank: int
    num_ranks: int
    device: torch.device
    num_local_tokens: int
    hidden_size: int
    topk: int
    num_experts: int
    num_local_experts: int
    intermediate_size: int
    shared_intermediate_size: int
    dtype: torch.dtype
    row_capacity: int
    token_capacity: int
    backend: Any
    monitor: ErrorMonitor
    buffers: Any = field(default=None, repr=False)
    #: The config as given, "auto" knobs unresolved (``config`` is the resolved one).
    given_config: MoKConfig | None = field(default=None, repr=False)

    def check_errors(self) -> None:
        """Wait for the device-side error flags of earlier passes and raise if any is set."""
        self.monitor.check()


def row_capacity(config: MoKConfig, num_ranks: int, num_local_tokens: int, topk: int) -> int:
    """Routed rows one rank's schedule holds: the balanced load times the multiplier, rounded up
    to the GEMM tile height and capped at every row of every rank (which can never overflow)."""
    balanced = num_local_tokens * topk
    wanted = math.ceil(config.schedule_capacity_multiplier * balanced)
    most = num_ranks * num_local_tokens * topk
    return _align(min(wanted, most), MOK_ROW_ALIGN)


def _align(value: int, multiple: int) -> int:
    return max(multiple, (value + multiple - 1) // multiple * multiple)


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _validate_shape(num_ranks, num_local_tokens, hidden_size, topk, num_experts, inter) -> None:
    if num_local_tokens < 0 or hidden_size <= 0 or inter <= 0:
        raise ValueError(
            f"num_local_tokens={num_local_tokens}, hidden_size={hidden_size}, "
            f"intermediate_size={inter}: tokens must be >= 0 and sizes > 0"
        )
    if not 1 <= topk <= num_experts:
        raise ValueError(
            f"topk={topk} must be in [1, num_experts={num_experts}]: a token cannot pick more "
            "experts than exist; lower --moe-router-topk"
        )
    if num_experts % num_ranks:
        raise ValueError(
            f"num_experts={num_experts} must be divisible by the expert-parallel size "
            f"{num_ranks} (each rank owns num_experts / EP experts)"
        )


def create_workspace(
    config: MoKConfig,
    group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | str,
    num_local_tokens: int,
    hidden_size: int,
    topk: int,
    num_experts: int,
    intermediate_size: int,
    shared_intermediate_size: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
) -> MoKWorkspace:
    """Make a workspace (uncached; a collective over ``group``).

    num_local_tokens is the most tokens any call on this rank will pass (T_max); fewer are fine.
    """
    from .backends import resolve_backend

    if not isinstance(config, MoKConfig):
        raise TypeError(f"config must be a MoKConfig, got {type(config).__name__}")
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend={backend!r} must be one of {BACKEND_CHOICES}")
    device = _resolve_device(device)
    rank, num_ranks = _group_info(group)
    _validate_shape(num_ranks, num_local_tokens, hidden_size, topk, num_experts, intermediate_size)
    resolved = config.resolve(device, num_ranks,
                              LayerDims(hidden_size, intermediate_size, num_experts, topk))  # fmt: skip
    resolved.check_same_across_ranks(group, _collective_device(group, device))
    ws = _new_workspace(
        resolved,
        group,
        rank,
        num_ranks,
        device,
        num_local_tokens,
        hidden_size,
        topk,
        num_experts,
        intermediate_size,
        shared_intermediate_size,
        dtype,
        given=config,
    )
    ws.backend = resolve_backend(backend, ws)
    ws.buffers = ws.backend.allocate(ws)
    warn_ignored_knobs(config, backend_path(ws))
    _LIVE.add(ws)
    return ws


def _resolve_device(device: torch.device | str) -> torch.device:
    """A torch.device; an index-less CUDA device becomes the current one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _new_workspace(config, group, rank, num_ranks, device, num_local_tokens, hidden_size, topk,
                   num_experts, inter, shared_inter, dtype, *, given) -> MoKWorkspace:  # fmt: skip
    """The workspace record with its capacities and monitor; no backend or buffers yet.
    ``config`` is resolved, ``given`` as the caller gave it ("auto" knobs unresolved)."""
    cap = row_capacity(config, num_ranks, num_local_tokens, topk)
    return MoKWorkspace(
        config=config, group=group, rank=rank, num_ranks=num_ranks, device=device,
        num_local_tokens=num_local_tokens, hidden_size=hidden_size, topk=topk,
        num_experts=num_experts, num_local_experts=num_experts // num_ranks,
        intermediate_size=inter, shared_intermediate_size=shared_inter, dtype=dtype,
        row_capacity=cap, token_capacity=min(cap, num_ranks * num_local_tokens), backend=None,
        monitor=ErrorMonitor(num_experts, device), given_config=given,
    )  # fmt: skip


def backend_path(ws: MoKWorkspace) -> str:
    """What runs a workspace's passes: "reference", or "cuda/<path>" (config.KNOB_USERS)."""
    path = getattr(ws.backend, "path", None)
    return f"{ws.backend.name}/{path(ws)}" if path is not None else ws.backend.name


def create_virtual_workspaces(
    config: MoKConfig,
    num_ranks: int,
    *,
    device: torch.device | str,
    num_local_tokens: int,
    hidden_size: int,
    topk: int,
    num_experts: int,
    intermediate_size: int,
    shared_intermediate_size: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> list[MoKWorkspace]:
    """``num_ranks`` workspaces of one process on one GPU that act as the ranks of one
    expert-parallel group ("virtual ranks", MEGAKERNEL.md): each rank's peer tables point at
    the others' buffers, so the CUDA backend's cross-rank protocol (pulls, pushes, barriers,
    timeouts) runs unchanged. CUDA backend only, no process group. Rank r's calls must be issued
    on a stream of its own, every rank's before anything waits on the host
    (``mok_megatron.testing.virtual.run_ranks``); they are for tests of the protocol, not speed.

    Needs ``CUDA_MODULE_LOADING=EAGER`` (set before CUDA starts): the ranks share one CUDA
    context, and a lazily loaded kernel's first launch waits for the device, where another rank's
    kernel may be waiting for this one (it would time out, not hang; see VIRTUAL_RANKS_RULE).
    """
    from .backends import resolve_backend

    if not isinstance(config, MoKConfig):
        raise TypeError(f"config must be a MoKConfig, got {type(config).__name__}")
    device = _resolve_device(device)
    if device.type == "cuda" and os.environ.get("CUDA_MODULE_LOADING", "").upper() != "EAGER":
        raise RuntimeError(VIRTUAL_RANKS_RULE)
    _validate_shape(num_ranks, num_local_tokens, hidden_size, topk, num_experts, intermediate_size)
    # NOTE: "auto" knobs take AUTO_FALLBACKS here: a tuned table is for real ranks on GPUs of
    # their own, not for virtual ranks sharing one GPU's SMs.
    resolved = config.resolve(None, num_ranks)
    workspaces = [
        _new_workspace(resolved, None, r, num_ranks, device, num_local_tokens, hidden_size, topk,
                       num_experts, intermediate_size, shared_intermediate_size, dtype,
                       given=config)
        for r in range(num_ranks)
    ]  # fmt: skip
    for ws in workspaces:
        ws.backend = resolve_backend("cuda", ws)
    for ws, buffers in zip(workspaces, workspaces[0].backend.allocate_virtual(workspaces)):
        ws.buffers = buffers
        _LIVE.add(ws)
    warn_ignored_knobs(config, backend_path(workspaces[0]))
    return workspaces


def _collective_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """The device collectives on ``group`` run on (CPU for gloo, the GPU for NCCL)."""
    if not dist.is_available() or not dist.is_initialized():
        return device
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


#: Why virtual ranks need eager module loading, and the fix.
VIRTUAL_RANKS_RULE = (
    "virtual ranks need CUDA_MODULE_LOADING=EAGER in the environment before CUDA starts: they "
    "share one CUDA context, where loading a kernel on its first launch (CUDA's default lazy "
    "loading) waits for the device, and so for a rank whose kernel waits for the loading one "
    "(its device wait times out); export CUDA_MODULE_LOADING=EAGER (the test suite's conftest "
    "sets it)"
)

_CACHE: dict[tuple, MoKWorkspace] = {}
#: How many times ``clear_workspace_cache`` ran (``workspace_cache_generation``).
_cache_generation = 0


def get_workspace(config: MoKConfig, group: dist.ProcessGroup | None = None, **kwargs: Any):
    """Cached ``create_workspace``: equal arguments on the same group return the same workspace."""
    key = (config, id(group), tuple(sorted((k, str(v)) for k, v in kwargs.items())))
    ws = _CACHE.get(key)
    if ws is None:
        ws = _CACHE[key] = create_workspace(config, group, **kwargs)
    return ws


def clear_workspace_cache() -> None:
    """Forget cached workspaces (their buffers are freed once no layer holds them)."""
    global _cache_generation
    _CACHE.clear()
    _cache_generation += 1


def workspace_cache_generation() -> int:
    """Changes whenever ``clear_workspace_cache`` runs: a caller that keeps a workspace
    ``get_workspace`` gave it may reuse it for the same arguments while this stays the same."""
    return _cache_generation


def workspace_bytes(
    config: MoKConfig,
    *,
    num_ranks: int,
    num_local_tokens: int,
    hidden_size: int,
    topk: int,
    num_experts: int,
    intermediate_size: int,
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "reference",
) -> int:
    """Device bytes a workspace of this shape holds between passes, before allocating it.

    The reference backend holds no buffers between passes (0); the CUDA backend reports the size
    of its symmetric-memory layout, which the shared C++ layout header defines.
    """
    from .backends import backend_class

    _validate_shape(num_ranks, num_local_tokens, hidden_size, topk, num_experts, intermediate_size)
    # "auto" knobs as a workspace on the current GPU would resolve them.
    config = config.resolve("cuda" if backend != "reference" else None, num_ranks,
                            LayerDims(hidden_size, intermediate_size, num_experts, topk))  # fmt: skip
    cap = row_capacity(config, num_ranks, num_local_tokens, topk)
    return backend_class(backend).workspace_bytes(
        config=config, num_ranks=num_ranks, num_local_tokens=num_local_tokens,
        hidden_size=hidden_size, topk=topk, num_experts=num_experts,
        intermediate_size=intermediate_size, dtype=dtype, row_capacity=cap,
        token_capacity=min(cap, num_ranks * num_local_tokens),
    )  # fmt: skip
