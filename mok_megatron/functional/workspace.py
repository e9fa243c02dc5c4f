"""The workspace: per-(group, shape, config) state that every pass of the MoK layer reuses.

It fixes the capacities (so shapes never depend on routing), picks the backend, checks that all
ranks hold the same config, owns backend buffers (symmetric memory on the CUDA backend) and the
error monitor that turns device-side error flags into host exceptions without a host sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .config import MOK_ROW_ALIGN, MoKConfig
from .schedule import MOK_ERR_EXPERT_ID, MOK_ERR_ROW_OVERFLOW

__all__ = [
    "MoKWorkspace",
    "ErrorMonitor",
    "MoKCapacityError",
    "create_workspace",
    "get_workspace",
    "workspace_bytes",
    "row_capacity",
    "clear_workspace_cache",
]

BACKEND_CHOICES = ("auto", "reference", "cuda")


class MoKCapacityError(RuntimeError):
    """Routing exceeded a capacity fixed when the workspace was made."""


class ErrorMonitor:
    """Turns device-side ``error_flags`` into exceptions at the next host-visible point.

    CPU flags are checked at once. CUDA flags are OR-ed into a device word and, outside CUDA-graph
    capture, also copied into pinned memory behind an event: a later ``poll()`` (each new
    schedule) reads the copies whose event has completed, never waiting; ``check()`` waits for
    everything, the device word included (call it where the host syncs anyway, e.g. logging).
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self._pending: list[tuple[torch.Tensor, Any, str]] = []
        self._accum: torch.Tensor | None = None

    def submit(self, flags: torch.Tensor, where: str) -> None:
        if flags.device.type != "cuda":
            self._raise_for(int(flags.max().item()), where)
            return
        if self._accum is None:
            self._accum = torch.zeros(1, dtype=torch.int32, device=flags.device)
        self._accum.bitwise_or_(flags.max().reshape(1).to(torch.int32))
        if torch.cuda.is_current_stream_capturing():
            return  # a graph replays later: check() reads the device word then
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((host, event, where))

    def poll(self) -> None:
        """Raise for every finished flag copy that recorded an error; never blocks."""
        if self._pending and torch.cuda.is_current_stream_capturing():
            return  # querying events is not allowed while a graph is being captured
        still = []
        for host, event, where in self._pending:
            if event.query():
                self._raise_for(int(host.max()), where)
            else:
                still.append((host, event, where))
        self._pending = still

    def check(self) -> None:
        """Wait for every pending flag and raise if any recorded an error (a host sync)."""
        pending, self._pending = self._pending, []
        for host, event, where in pending:
            event.synchronize()
            self._raise_for(int(host.max()), where)
        if self._accum is not None:
            bits = int(self._accum.item())
            self._accum.zero_()
            self._raise_for(bits, "an earlier MoK pass")

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
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    rank, num_ranks = _group_info(group)
    _validate_shape(num_ranks, num_local_tokens, hidden_size, topk, num_experts, intermediate_size)
    config.check_same_across_ranks(group, _collective_device(group, device))
    cap = row_capacity(config, num_ranks, num_local_tokens, topk)
    ws = MoKWorkspace(
        config=config, group=group, rank=rank, num_ranks=num_ranks, device=device,
        num_local_tokens=num_local_tokens, hidden_size=hidden_size, topk=topk,
        num_experts=num_experts, num_local_experts=num_experts // num_ranks,
        intermediate_size=intermediate_size, shared_intermediate_size=shared_intermediate_size,
        dtype=dtype, row_capacity=cap, token_capacity=min(cap, num_ranks * num_local_tokens),
        backend=None, monitor=ErrorMonitor(num_experts),
    )  # fmt: skip
    ws.backend = resolve_backend(backend, ws)
    ws.buffers = ws.backend.allocate(ws)
    return ws


def _collective_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """The device collectives on ``group`` run on (CPU for gloo, the GPU for NCCL)."""
    if not dist.is_available() or not dist.is_initialized():
        return device
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


_CACHE: dict[tuple, MoKWorkspace] = {}


def get_workspace(config: MoKConfig, group: dist.ProcessGroup | None = None, **kwargs: Any):
    """Cached ``create_workspace``: equal arguments on the same group return the same workspace."""
    key = (config, id(group), tuple(sorted((k, str(v)) for k, v in kwargs.items())))
    ws = _CACHE.get(key)
    if ws is None:
        ws = _CACHE[key] = create_workspace(config, group, **kwargs)
    return ws


def clear_workspace_cache() -> None:
    """Forget cached workspaces (their buffers are freed once no layer holds them)."""
    _CACHE.clear()


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
    cap = row_capacity(config, num_ranks, num_local_tokens, topk)
    return backend_class(backend).workspace_bytes(
        config=config, num_ranks=num_ranks, num_local_tokens=num_local_tokens,
        hidden_size=hidden_size, topk=topk, num_experts=num_experts,
        intermediate_size=intermediate_size, dtype=dtype, row_capacity=cap,
        token_capacity=min(cap, num_ranks * num_local_tokens),
    )  # fmt: skip
