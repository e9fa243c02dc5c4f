"""The FP8 token rows' host op and fakes (the dispatch of (1, 128)-quantised tokens, stage 1):
``moe_fp8_packed_row_width`` (the row format of csrc/include/mok/common/fp8_blockwise.cuh) and
the meta shapes of ``moe_fp8_pack_rows`` / ``moe_gather_rows_fp8``, without a GPU. Skipped
unless the locally built extension provides the ops."""

from __future__ import annotations

import pytest
import torch

from mok_megatron import ops
from mok_megatron.ops.moe import moe_fp8_pack_rows, moe_fp8_packed_row_width, moe_gather_rows_fp8

pytestmark = pytest.mark.skipif(
    not (ops.extension_available() and hasattr(torch.ops.mok, "moe_gather_rows_fp8")),
    reason=f"mok FP8 token-row ops not built: {ops.extension_error() or 'op missing'}",
)


@pytest.mark.parametrize("hidden", [128, 2048, 4096, 7168])
def test_packed_width_holds_data_and_scales_in_whole_vectors(hidden):
    width = moe_fp8_packed_row_width(hidden)
    data_and_scales = hidden + 4 * (hidden // 128)  # bytes: e4m3 data, float32 scales
    assert 2 * width >= data_and_scales  # all of it fits
    assert (2 * width) % 16 == 0 and 2 * width - data_and_scales < 16  # padded to a vector only
    assert width % 8 == 0 and width < hidden  # what moe_dispatch takes: narrower than the token


def test_deepseek_width_is_about_half_the_bf16_row():
    assert moe_fp8_packed_row_width(7168) == 3696  # 7168 + 224 bytes, 16-byte aligned


@pytest.mark.parametrize("hidden", [0, 64, 200])
def test_packed_width_rejects_hidden_not_a_multiple_of_128(hidden):
    with pytest.raises(RuntimeError, match="multiple of 128"):
        moe_fp8_packed_row_width(hidden)


@pytest.mark.parametrize("rows,hidden", [(0, 2048), (37, 128), (4096, 7168)])
def test_meta_shapes(rows, hidden):
    data = torch.empty(rows, hidden, dtype=torch.float8_e4m3fn, device="meta")
    scales = torch.empty(rows, hidden // 128, dtype=torch.float32, device="meta")
    packed = moe_fp8_pack_rows(data, scales)
    assert packed.device.type == "meta" and packed.dtype == torch.bfloat16
    assert packed.shape == (rows, moe_fp8_packed_row_width(hidden))
    row_tok = torch.empty(5 * rows + 1, dtype=torch.int64, device="meta")
    got_data, got_scales = moe_gather_rows_fp8(packed, row_tok, hidden)
    assert got_data.shape == (5 * rows + 1, hidden) and got_data.dtype == torch.float8_e4m3fn
    assert got_scales.shape == (5 * rows + 1, hidden // 128)
    assert got_scales.dtype == torch.float32
