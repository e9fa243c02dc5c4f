"""The output poisoning the GPU tests rely on (``mok_megatron.testing.poison``) reaches outputs of
every size class and dtype, and a kernel that skips part of an output fails the check.

Sizes: float32 [300, 8] (9.4 KB) and bf16 [300, 256] (150 KB) come from the caching allocator's
small pool, bf16 [512, 1024] (exactly 1 MiB) is its largest small allocation, bf16 [4096, 2048]
(16 MiB) a large one; int64 / int32 / bool stand for the schedule's integer outputs.
"""

from __future__ import annotations

import pytest
import torch

from mok_megatron.testing.poison import (
    POISON_WORD,
    assert_fully_written,
    poison_,
    poisoned_elements,
    poisoned_memory,
)

pytestmark = pytest.mark.gpu

SIZE_CLASSES = [
    ((300, 8), torch.float32),
    ((300, 256), torch.bfloat16),
    ((512, 1024), torch.bfloat16),
    ((4096, 2048), torch.bfloat16),
    ((333, 7), torch.float64),
    ((5000,), torch.int64),
    ((77, 3), torch.int32),
    ((300, 2), torch.bool),
]


@pytest.mark.parametrize("shape,dtype", SIZE_CLASSES, ids=lambda v: str(v))
def test_every_size_class_and_dtype_starts_poisoned(shape, dtype):
    torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0)  # zeros to reuse, if it could
    with poisoned_memory() as mem:
        out = torch.empty(shape, dtype=dtype, device="cuda")
    mem.assert_covers(out=out)
    assert poisoned_elements(out) == out.numel(), "an allocation came out unpoisoned"


@pytest.mark.parametrize("shape,dtype", SIZE_CLASSES, ids=lambda v: str(v))
def test_a_kernel_that_skips_a_row_fails_the_check(shape, dtype):
    with poisoned_memory():
        out = torch.empty(shape, dtype=dtype, device="cuda")
        src = torch.ones(shape, dtype=dtype, device="cuda")
    out[1:] = src[1:]  # a "kernel" that forgets row 0
    assert poisoned_elements(out) == out[:1].numel()
    with pytest.raises(AssertionError, match="never written"):
        assert_fully_written("out", out)
    out[:1] = src[:1]
    assert_fully_written("out", out)


def test_outputs_of_several_streams_are_poisoned_and_misses_are_named():
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    with poisoned_memory(large_bytes=64 << 20, small_segments=4, streams=streams) as mem:
        outs = []
        for stream in streams:
            with torch.cuda.stream(stream):
                outs.append(torch.empty(300, 256, dtype=torch.bfloat16, device="cuda"))
    torch.cuda.synchronize()
    mem.assert_covers(a=outs[0], b=outs[1])
    assert all(poisoned_elements(o) == o.numel() for o in outs)
    outside = torch.empty(300, 256, dtype=torch.bfloat16, device="cuda")  # the default pool
    with pytest.raises(AssertionError, match=r"\['outside'\]"):
        mem.assert_covers(a=outs[0], outside=outside)


def test_the_pattern_is_nan_or_impossible_in_every_dtype():
    word = torch.tensor([POISON_WORD], dtype=torch.int64)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        assert word.view(dtype).isnan().all(), dtype
    for dtype in (torch.int32, torch.int64):
        assert (word.view(dtype) < -1).all(), dtype
    assert ((word.view(torch.uint8) != 0) & (word.view(torch.uint8) != 1)).all()
    t = poison_(torch.empty(16, dtype=torch.bfloat16, device="cuda"))
    assert poisoned_elements(t) == 16
