"""The CUDA backend's workspace buffers: one rank's symmetric copy of the C++ layout, the device
tables its kernels read peers through, and ``comm`` (the ints every collective op takes).

Real ranks get their copies from torch's symmetric memory (a collective over the EP group).
*Virtual ranks* (``allocate_virtual``) are W workspaces of one process on one GPU whose peer
tables point at each other: the cross-rank protocol (pulls, pushes, barriers, timeouts) then runs
on one GPU when each rank's work is issued on its own stream (``mok_megatron.testing.virtual``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CudaBuffers", "allocate", "allocate_virtual", "MAX_RANKS"]

#: Ranks one barrier kernel serves (one thread per peer in a warp: csrc/launch/moe.cu).
MAX_RANKS = 32
#: The byte every guard holds (workspace.cuh: no kernel writes a guard).
GUARD_BYTE = 0xA5


@dataclass
class CudaBuffers:
    """One rank's symmetric workspace and the device tables the kernels read peers through."""

    buffer: torch.Tensor  # [total_bytes] uint8: this rank's copy of the layout
    handle: Any  # the symmetric-memory handle (None for one rank and for virtual ranks)
    peer_table: torch.Tensor  # [W] int64: base address of each rank's copy
    signal_table: torch.Tensor | None  # [W] int64: each rank's signal pad (None for one rank)
    comm: list[int]  # what every moe_* op takes (ops.moe.make_comm)
    layout: Any  # ops.moe.MoeWorkspaceLayout
    mega: Any = None  # ops.moe.MegaShape when the layout holds the megakernel's regions
    error_record: torch.Tensor | None = None  # pinned int32: the megakernel's timeout record
    keep: list[Any] = field(default_factory=list)  # storage the tables point into
    num_sms: int = 0  # SMs the megakernel may take: 0 = all; a virtual rank's share of the GPU
    stall_minibatch: int = -1  # fault injection (tests): a minibatch the comm role never releases
    stall_l2_cta: int = -1  # fault injection (tests): a CTA whose consumers stop at an L2 task
    # diagnostics (scripts/megakernel_trace.py): record each megakernel pass's timeline into
    # last_trace = (trace_ctas, trace_tasks), ops.moe.moe_mega_forward's trace outputs, and the
    # backward megakernel's into last_backward_trace (ops.moe.moe_mega_backward's; a backward in
    # macrobatch rounds, one launch per round: each launch's CTAs and tasks stacked by round,
    # [R, CTAs, words] and [R, tasks, words])
    trace: bool = False
    last_trace: Any = None
    last_backward_trace: Any = None
    # and the traced forward's m-tiles (its plan's ``tiles``: [R, max_tiles, 4] int32, each
    # expert, row_begin, row_end, reserved; layout/mega.cuh MegaTile), which the task records
    # name by index; a backward runs on its forward's
    last_tiles: Any = None

    def region(self, name: str, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A flat typed view of one layout region of this rank's copy."""
        begin = self.layout.offsets[name]
        end = begin + self._region_bytes(name)
        return self.buffer[begin:end].view(dtype)

    def guards(self) -> dict[str, torch.Tensor]:
        """Each region's guard bytes (uint8 views)."""
        size = self.layout.guard_bytes
        return {n: self.buffer[g : g + size] for n, g in self.layout.guards.items()}

    def fill_guards(self) -> None:
        for guard in self.guards().values():
            guard.fill_(GUARD_BYTE)

    def damaged_guards(self) -> list[str]:
        """Regions whose guard no longer holds GUARD_BYTE everywhere (a write past their end)."""
        return [n for n, g in self.guards().items() if not bool((g == GUARD_BYTE).all())]

    def _region_bytes(self, name: str) -> int:
        return self.layout.guards[name] - self.layout.offsets[name]


def _layout(ws, mega_shape):
    from mok_megatron.ops.moe import moe_workspace_layout

    words = mega_shape.counter_words if mega_shape is not None else 0
    return moe_workspace_layout(
        ws.num_ranks, ws.num_local_tokens, ws.topk, ws.hidden_size, mega_shape is not None, words
    )


def _finish(ws, buffer, handle, peers, signal_table, layout, mega_shape, keep=()) -> CudaBuffers:
    from mok_megatron.ops.moe import MEGA_ERROR_FIELDS, make_comm

    peer_table = torch.tensor(peers, dtype=torch.int64, device=ws.device)
    error = torch.zeros(len(MEGA_ERROR_FIELDS), dtype=torch.int32, pin_memory=True)
    comm = make_comm(
        peer_bases=peer_table.data_ptr(),
        signal_pads=signal_table.data_ptr() if signal_table is not None else 0,
        my_base=buffer.data_ptr(), rank=ws.rank, num_ranks=ws.num_ranks,
        max_tokens=ws.num_local_tokens, topk=ws.topk, hidden=ws.hidden_size,
        slot_rows=int(mega_shape is not None),
        counter_words=mega_shape.counter_words if mega_shape is not None else 0,
        timeout_ms=ws.config.wait_timeout_ms, error_record=error.data_ptr(),
        chained=int(ws.config.chained_launches),
    )  # fmt: skip
    bufs = CudaBuffers(buffer, handle, peer_table, signal_table, comm, layout, mega_shape, error,
                       list(keep))  # fmt: skip
    bufs.fill_guards()
    return bufs


def allocate(ws, mega_shape=None) -> CudaBuffers:
    """This rank's workspace: device memory for one rank, symmetric memory (a collective) for
    more. ``mega_shape``: the megakernel's sizes, when its regions are wanted."""
    layout = _layout(ws, mega_shape)
    if ws.num_ranks == 1:
        buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=ws.device)
        return _finish(ws, buffer, None, [buffer.data_ptr()], None, layout, mega_shape)
    buffer, handle, peers, signals = _rendezvous(ws, layout.total_bytes)
    signal_table = torch.tensor(signals, dtype=torch.int64, device=ws.device)
    return _finish(ws, buffer, handle, peers, signal_table, layout, mega_shape)


def allocate_virtual(workspaces: list, mega_shape=None) -> list[CudaBuffers]:
    """Buffers for W virtual ranks of one process on one GPU: each rank's peer table points at
    the others' copies, each has a signal pad (W int32 slots, zero) in one shared tensor."""
    w = len(workspaces)
    layout = _layout(workspaces[0], mega_shape)
    device = workspaces[0].device
    buffers = [torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device) for _ in range(w)]
    pads = torch.zeros(w, max(w, 8), dtype=torch.int32, device=device)
    signal_table = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64, device=device)
    peers = [b.data_ptr() for b in buffers]
    share = torch.cuda.get_device_properties(device).multi_processor_count // w
    out = [
        _finish(ws, buffers[r], None, peers, signal_table, layout, mega_shape, keep=[pads])
        for r, ws in enumerate(workspaces)
    ]
    for bufs in out:  # NOTE: the W megakernels must all be resident at once: W x share <= SMs
        bufs.num_sms = share
    return out


def _rendezvous(ws, nbytes: int):
    """Allocate this rank's symmetric copy and exchange peers' addresses (a collective)."""
    import torch.distributed._symmetric_memory as symm_mem

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    group = ws.group if ws.group is not None else dist.group.WORLD
    buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=ws.device)
    buffer.zero_()
    handle = symm_mem.rendezvous(buffer, group.group_name)
    # The tensor may sit inside a larger symmetric block: address peers at the same offset.
    delta = buffer.data_ptr() - handle.buffer_ptrs[handle.rank]
    check = torch.tensor([delta, -delta], dtype=torch.int64, device=ws.device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
    if int(check[0]) != delta or int(check[1]) != -delta:  # workspace creation: may sync
        raise RuntimeError("mok: the symmetric workspace sits at different offsets across ranks")
    peers = [base + delta for base in handle.buffer_ptrs]
    dist.barrier(group=group)
    return buffer, handle, peers, list(handle.signal_pad_ptrs)
