"""Output poisoning that reaches every output: what a GPU test uses to catch an unwritten element.

Freeing one big NaN block before a call does not do it: PyTorch's caching allocator serves
allocations of 1 MiB or less from a separate small pool, blocks are reused per stream, and a
float32 NaN pattern read as bfloat16 is +0.0 half of the time. Instead, ``poisoned_memory()``
routes every allocation of the calling thread into a private ``torch.cuda.MemPool`` whose large
and small segments were filled with ``POISON_WORD`` on each stream that will allocate, and
``assert_poisoned_storage`` then checks that an output's storage came from those segments (a miss
fails loudly instead of passing silently).

``POISON_WORD`` (8 bytes, repeated) is NaN in every float dtype the kernels write and an
impossible value in every integer one:
  bfloat16 / float16  0xFFC1, 0xFFF1 (NaN)        float32  0xFFC1FFC1, 0xFFF1FFC1 (NaN)
  float64             0xFFF1FFC1FFC1FFC1 (NaN)    int32    -4063295, -917567 (< -1)
  int64               -3940924458122303 (< -1)    bool / uint8  0xC1, 0xFF (neither 0 nor 1)
so ``poisoned_elements(t)`` can count, in t's own dtype, the elements a kernel left unwritten.
(fp8 and uint8 data outputs, where 0xFF may be valid, need a poison of their own.)
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence

import torch

__all__ = [
    "POISON_WORD",
    "PoisonedMemory",
    "poisoned_memory",
    "poison_",
    "poisoned_elements",
    "assert_fully_written",
]

#: The repeated 8-byte pattern (little-endian), as a signed int64.
POISON_WORD = int.from_bytes(bytes.fromhex("c1ffc1ffc1fff1ff"), "little", signed=True)
#: Allocations up to this size come from the caching allocator's small pool (2 MiB segments).
SMALL_ALLOC = 1 << 20


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t``'s bytes with POISON_WORD in place (t contiguous, nbytes a multiple of 8)."""
    flat = t.view(torch.uint8).view(-1)
    if flat.numel() % 8:
        raise ValueError(f"poison_: {flat.numel()} bytes is not a multiple of 8")
    flat.view(torch.int64).fill_(POISON_WORD)
    return t


def poisoned_elements(t: torch.Tensor) -> int:
    """How many elements of ``t`` still hold the poison, judged in ``t``'s own dtype (a host
    sync): NaN for floats, the pattern's values for integers, a byte other than 0 / 1 for bool."""
    if t.numel() == 0:
        return 0
    if t.is_floating_point():
        return int(t.isnan().sum())
    if t.dtype == torch.bool:
        return int((t.view(torch.uint8) > 1).sum())
    word = torch.tensor([POISON_WORD], dtype=torch.int64).view(t.dtype)  # the word's values
    values = word.to(t.device)
    return int(torch.isin(t, values).sum())


def assert_fully_written(name: str, t: torch.Tensor) -> None:
    """Fail if any element of ``t`` still holds the poison (an output a kernel never wrote)."""
    left = poisoned_elements(t)
    assert left == 0, f"{name}: {left} of {t.numel()} elements were never written (poison left)"


class PoisonedMemory:
    """The poisoned pool of one ``poisoned_memory()`` block and the address ranges it filled."""

    def __init__(self, pool: torch.cuda.MemPool, ranges: list[tuple[int, int]]) -> None:
        self.pool = pool
        self.ranges = _merge(ranges)

    def covers(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s bytes all lie in memory that was poisoned before the block ran."""
        if t.numel() == 0:
            return True
        storage = t.untyped_storage()
        begin, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        return any(lo <= begin and end <= hi for lo, hi in self.ranges)

    def assert_covers(self, **tensors: torch.Tensor | None) -> None:
        """Fail naming every given tensor whose storage was not poisoned before the call."""
        missed = [n for n, t in tensors.items() if t is not None and not self.covers(t)]
        assert not missed, (
            f"outputs {missed} were allocated outside the poisoned pool, so an unwritten element "
            "would not show; raise large_bytes / small_segments or add the allocating stream"
        )


#: Pools of earlier blocks whose tensors may still be alive. NOTE: a MemPool must outlive every
#: tensor allocated in it (PyTorch aborts otherwise), so a pool is dropped only once a memory
#: snapshot shows none of its blocks in use.
_KEPT: list[torch.cuda.MemPool] = []


def _drop_unused_pools() -> None:
    if not _KEPT:
        return
    gc.collect()  # outputs in reference cycles
    busy = {
        tuple(seg["segment_pool_id"])
        for seg in torch.cuda.memory_snapshot()
        if any(block["state"] != "inactive" for block in seg["blocks"])
    }
    _KEPT[:] = [pool for pool in _KEPT if tuple(pool.id) in busy]


def release_unused_pools() -> None:
    """Drop the kept pools none of whose blocks is in use, and return the freed memory to the
    device (a test module's teardown, after its cached workspaces were let go: each pool holds a
    ``large_bytes`` segment per stream, and a workspace made inside ``poisoned_memory`` keeps its
    pool alive for as long as the workspace cache keeps it)."""
    _drop_unused_pools()
    gc.collect()
    torch.cuda.empty_cache()


@contextlib.contextmanager
def poisoned_memory(
    large_bytes: int = 4 << 30,
    small_segments: int = 64,
    streams: Sequence[torch.cuda.Stream] | None = None,
    device: torch.device | None = None,
) -> Iterator[PoisonedMemory]:
    """Route this thread's CUDA allocations into a fresh pool pre-filled with POISON_WORD.

    For each stream that will allocate (default: the current one), one ``large_bytes`` segment
    and ``small_segments`` 2 MiB small-pool segments are allocated, filled and freed, so later
    allocations of any size class on that stream reuse poisoned memory. Yields the
    ``PoisonedMemory`` whose ``assert_covers`` checks that outputs came from it.
    """
    device = device or torch.device("cuda", torch.cuda.current_device())
    streams = list(streams) if streams else [torch.cuda.current_stream(device)]
    _drop_unused_pools()
    pool = torch.cuda.MemPool()
    _KEPT.append(pool)
    ranges: list[tuple[int, int]] = []
    with torch.cuda.use_mem_pool(pool, device):
        for stream in streams:
            with torch.cuda.stream(stream):
                junk = [torch.empty(large_bytes, dtype=torch.uint8, device=device)]
                junk += [
                    torch.empty(SMALL_ALLOC, dtype=torch.uint8, device=device)
                    for _ in range(2 * small_segments)
                ]
                for t in junk:
                    poison_(t)
                    ranges.append((t.data_ptr(), t.data_ptr() + t.numel()))
                stream.synchronize()
                del junk, t
        yield PoisonedMemory(pool, ranges)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Touching or overlapping [lo, hi) ranges joined (freed neighbours coalesce)."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
