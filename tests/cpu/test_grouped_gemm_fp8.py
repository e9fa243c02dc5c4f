"""ops.grouped_gemm_fp8 on CPU: the weight wrapper's per-row scales, the pure-PyTorch reference
against the unquantised float64 product within the quantisation error bound, and the wrappers'
argument rules (the CUDA kernels themselves: tests/gpu/test_grouped_gemm_fp8_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from mok_megatron.ops import fp8_blockwise as fb
from mok_megatron.ops import grouped_gemm_fp8 as gf


def test_weight_is_the_128_block_quantisation():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(3, 256, 384, generator=g) * torch.rand(3, 256, 1, generator=g)).bfloat16()
    q = gf.fp8_gemm_weight(w)
    want = fb.fp8_blockwise_quantize_reference(w, (128, 128))
    assert q.data.dtype == torch.float8_e4m3fn and q.scales.shape == (3, 2, 3)
    assert torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(q.scales, want.scales)
    assert gf.fp8_gemm_weight(q) is q  # an already-quantised weight is taken as it is


def test_weight_rejects_other_blocks_and_ranks():
    with pytest.raises(ValueError, match=r"\(128, 128\) blocks"):
        gf.fp8_gemm_weight(fb.fp8_blockwise_quantize(torch.randn(2, 128, 256), (1, 128)))
    with pytest.raises(ValueError, match=r"\[G, N, K\]"):
        gf.fp8_gemm_weight(torch.randn(128, 256))


def test_reference_is_the_product_within_the_quantisation_bound():
    g = torch.Generator().manual_seed(1)
    rows_per_group = [70, 0, 130, 3]
    offs = torch.tensor(rows_per_group).cumsum(0).int()
    x = torch.randn(sum(rows_per_group) + 4, 256, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(-5, 6, (x.shape[0], 1), generator=g)).double()
    w = torch.randn(len(rows_per_group), 384, 256, generator=g, dtype=torch.float64) / 16
    xq = fb.fp8_blockwise_quantize(x.float(), (1, 128))
    wq = gf.fp8_gemm_weight(w.float())
    got = gf.grouped_gemm_fp8_reference(xq, wq, offs)
    assert got.dtype == torch.float64
    # |x - dequant(x)| <= 2^-4 |x| + 2^-10 s per element (ops.fp8_blockwise), so the product
    # moves by at most sum(|dx| |w| + |x| |dw| + |dx| |dw|)
    dx = x.abs() * 2.0**-4 + 2.0**-10 * xq.scales.double().repeat_interleave(128, 1)
    w_scales = wq.scales.double().repeat_interleave(128, 1).repeat_interleave(128, 2)
    dw = w.abs() * 2.0**-4 + 2.0**-10 * w_scales
    begin = 0
    for grp, end in enumerate(offs.tolist()):
        exact = x[begin:end] @ w[grp].T
        bound = dx[begin:end] @ w[grp].abs().T + x[begin:end].abs() @ dw[grp].T
        bound += dx[begin:end] @ dw[grp].T
        assert ((got[begin:end] - exact).abs() <= bound * 1.0001).all(), f"group {grp}"
        begin = end
    assert (got[begin:] == 0).all()  # rows past offs[-1]
    # and quantisation did change it: the bound is not vacuous
    assert not torch.equal(got[: offs[0]], x[: offs[0]] @ w[0].T)


def test_wrappers_check_the_activation_blocks_first():
    a = fb.fp8_blockwise_quantize(torch.randn(128, 256), (128, 128))
    w = gf.fp8_gemm_weight(torch.randn(2, 256, 256))
    offs = torch.tensor([64, 128], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\(1, 128\) blocks"):
        gf.grouped_gemm_fp8_nt(a, w, offs)
    with pytest.raises(ValueError, match=r"\(1, 128\) blocks"):
        gf.grouped_gemm_fp8_l1_swiglu(a, w, offs)
