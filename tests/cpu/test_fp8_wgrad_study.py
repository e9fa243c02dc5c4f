"""scripts/fp8_wgrad_study.py: its FP8 weight-gradient emulation and its time model."""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest
import torch

from mok_megatron.functional import reference
from mok_megatron.ops.fp8_blockwise import (
    fp8_blockwise_dequantize_exact,
    fp8_blockwise_quantize_reference,
)
from mok_megatron.testing.timing import H200_CEILINGS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def study():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        return importlib.import_module("fp8_wgrad_study")
    finally:
        sys.path.pop(0)


def _round_trip(t):
    return fp8_blockwise_dequantize_exact(fp8_blockwise_quantize_reference(t, (128, 1))).float()


def test_k_blocks_start_at_the_experts_first_row(study):
    """An expert of 200 rows: blocks of rows 0-127 and 128-199, each with its own scale. A large
    value in the short block leaves the first block's rounding alone."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(200, 3, generator=gen).to(torch.bfloat16).float()
    rows[150, 1] = 1000.0
    got = study.fp8_k_blocks(rows)
    first = _round_trip(rows[:128])
    second = _round_trip(torch.cat([rows[128:], rows.new_zeros(56, 3)]))
    assert torch.equal(got, torch.cat([first, second[:72]]))
    # the round trip is not the identity, so the check above can tell blocks apart
    assert not torch.equal(got, rows)
    # blocks on a grid that starts 64 rows before the expert (as if one spanned two experts):
    # rows 64-127 share the large value's block, and round coarser
    shifted = _round_trip(torch.cat([rows.new_zeros(64, 3), rows, rows.new_zeros(120, 3)]))
    assert not torch.equal(got[64:128, 1], shifted[128:192, 1])


def test_k_blocks_round_to_bf16_first(study):
    rows = torch.full((4, 2), 1.0 + 2.0**-12)  # not a bf16 value; bf16 rounds it to 1.0
    assert torch.equal(study.fp8_k_blocks(rows), torch.ones(4, 2))


def test_fp8_grouped_wgrad_equals_the_plain_one_on_exact_operands(study):
    """Operands whose every (128, 1) block within an expert holds 448 and small integers go
    through e4m3 exactly (scale 1): the FP8 weight gradient equals reference._grouped_wgrad's,
    experts in any row order, an expert without rows zero."""
    gen = torch.Generator().manual_seed(5)
    row_expert = torch.tensor([2] * 130 + [0] * 40 + [2] * 10 + [3] * 5)  # expert 1: no rows
    d_rows = torch.randint(-4, 5, (len(row_expert), 6), generator=gen).float()
    in_rows = torch.randint(-4, 5, (len(row_expert), 7), generator=gen).float()
    for e in (0, 2, 3):  # 448 in each column of each block: expert 2's rows 0-127, 128-139
        idx = (row_expert == e).nonzero().squeeze(1)
        for start in range(0, len(idx), 128):
            d_rows[idx[start]] = 448.0
            in_rows[idx[start]] = 448.0
    got = study.fp8_grouped_wgrad(d_rows, in_rows, row_expert, 4)
    want = reference._grouped_wgrad(d_rows, in_rows, row_expert, 4)
    assert torch.equal(got, want)
    assert torch.equal(got[1], torch.zeros(6, 7))
    # and where the operands are not exact, the FP8 gradient differs from the plain one
    noisy = d_rows + torch.rand(d_rows.shape, generator=gen) * 0.3
    assert not torch.equal(study.fp8_grouped_wgrad(noisy, in_rows, row_expert, 4),
                           reference._grouped_wgrad(noisy, in_rows, row_expert, 4))  # fmt: skip


def test_the_patch_reaches_the_reference_backward_and_is_undone(study):
    original = reference._grouped_wgrad
    with study.fp8_weight_gradients(True):
        assert reference._grouped_wgrad is study.fp8_grouped_wgrad
    assert reference._grouped_wgrad is original
    with study.fp8_weight_gradients(False):
        assert reference._grouped_wgrad is original


def test_time_model_by_hand(study):
    """mixtral-8x7b at 8192 tokens: 2048 rows per expert, both GEMMs compute-bound, so FP8
    takes half the BF16 time, whichever output; deepseek-v3 with main_grad: bound by the fp32
    traffic, which FP8 does not shrink."""
    h, i, e, k = 4096, 14336, 8, 2
    rows = 8192 * k
    flops = 2 * rows * 2 * i * h + 2 * rows * h * i
    c = study.wgrad_case("mixtral-8x7b", 8192)
    bf16_ms = flops / (H200_CEILINGS.bf16_tflops * 1e12) * 1e3
    assert c["grad"]["bf16_ms"] == pytest.approx(bf16_ms)
    assert c["grad"]["fp8_ms"] == pytest.approx(bf16_ms / 2)
    assert c["main_grad"]["fp8_ms"] == pytest.approx(bf16_ms / 2)
    quant = rows * (2 * h + 3 * i) * (2 + 1 + 4 / 128) / (H200_CEILINGS.hbm_tbps * 1e12) * 1e3
    assert c["fp8_quantise_ms"] == pytest.approx(quant)
    assert c["grad"]["saved_ms"] == pytest.approx(bf16_ms / 2 - quant)
    d = study.wgrad_case("deepseek-v3", 8192)
    h, i, e = 7168, 2048, 256
    fp32_traffic_ms = 3 * e * h * i * 8 / (H200_CEILINGS.hbm_tbps * 1e12) * 1e3
    assert d["main_grad"]["fp8_ms"] > fp32_traffic_ms
    assert d["main_grad"]["saved_fused_ms"] < 0.05 * d["main_grad"]["bf16_ms"]


def test_render_writes_both_tables(study, tmp_path):
    case = study.wgrad_case("qwen3-30b-a3b", 8192)
    row = {"shape": "s", "tokens": 8, "rows_per_expert": 4, "comparison": "bf16_vs_float64",
           **dict.fromkeys(study.GRADS, 1e-3)}  # fmt: skip
    record = {"environment": {"commit": "abcdef0"}, "accuracy": [row], "cases": [case]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    md = tmp_path / "x.md"
    md.write_text(f"a\n{study.TABLE_BEGIN}\nold\n{study.TABLE_END}\nb\n")
    study.main(["--render", str(path), "--md", str(md)])
    text = md.read_text()
    assert "old" not in text and text.startswith("a\n") and text.endswith("b\n")
    assert "| s | 8 | 4 | bf16_vs_float64 | 1.0e-03 | 1.0e-03 | 1.0e-03 |" in text
    assert "| qwen3-30b-a3b | 8192 | 512 |" in text and "| main_grad |" in text
