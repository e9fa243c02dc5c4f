"""The fake (meta) implementation of mok::moe_row_grad: output shapes, dtypes and layout without
running the kernel. Skipped unless the locally built extension provides the op."""

from __future__ import annotations

import pytest
import torch

from mok_megatron import ops
from mok_megatron.ops.moe import moe_row_grad

pytestmark = pytest.mark.skipif(
    not (ops.extension_available() and hasattr(torch.ops.mok, "moe_row_grad")),
    reason=f"mok::moe_row_grad not built: {ops.extension_error() or 'op missing'}",
)


def _inputs(num_rows: int, hidden: int, device: str):
    return (
        torch.empty(num_rows, hidden, dtype=torch.bfloat16, device=device),
        torch.empty(num_rows, hidden, dtype=torch.bfloat16, device=device),
        torch.empty(num_rows, dtype=torch.float32, device=device),
        torch.empty(num_rows, dtype=torch.int64, device=device),
    )


@pytest.mark.parametrize("num_rows,hidden", [(0, 2048), (37, 72), (4096, 7168)])
def test_meta_shapes(num_rows, hidden):
    d_row_w, dy = moe_row_grad(*_inputs(num_rows, hidden, "meta"))
    assert d_row_w.device.type == "meta" and dy.device.type == "meta"
    assert d_row_w.shape == (num_rows,) and d_row_w.dtype == torch.float32
    assert dy.shape == (num_rows, hidden) and dy.dtype == torch.bfloat16
    assert dy.is_contiguous()


def test_fake_tensor_mode_keeps_cuda_device():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        d_row_w, dy = torch.ops.mok.moe_row_grad(*_inputs(37, 2048, "cuda"))
    assert d_row_w.device.type == "cuda" and dy.device.type == "cuda"
    assert d_row_w.shape == (37,) and dy.shape == (37, 2048)
    assert d_row_w.dtype == torch.float32 and dy.dtype == torch.bfloat16
