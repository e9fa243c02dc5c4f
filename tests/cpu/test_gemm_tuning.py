"""GemmTuning (the grouped-GEMM engine's tile order): validation, and the trailing op arguments
every ``mok::grouped_gemm_*_out`` schema ends with, where the extension is built."""

from __future__ import annotations

import pytest
import torch

from mok_megatron import ops
from mok_megatron.ops import grouped_gemm as gg

OPS = ("l1_swiglu", "nt", "nn", "dswiglu", "tn", "nt_wait", "l1_swiglu_wait")


def test_defaults_and_op_args():
    assert gg.GemmTuning().op_args() == ("cooperative", "m", 1)
    assert gg.GemmTuning("pingpong", "n", 8).op_args() == ("pingpong", "n", 8)
    assert gg.GemmTuning("cooperative_cluster2").op_args() == ("cooperative_cluster2", "m", 1)


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (
            {"schedule": "ping"},
            ["schedule='ping'", "'cooperative'", "'pingpong'", "'cooperative_cluster2'"],
        ),
        ({"raster": "k"}, ["raster='k'", "'m'", "'n'"]),
        ({"swizzle": 3}, ["swizzle=3", "(1, 2, 4, 8)"]),
        ({"swizzle": "4"}, ["swizzle='4'"]),
        ({"swizzle": True}, ["swizzle=True"]),
    ],
)
def test_bad_values_name_the_allowed_ones(kwargs, words):
    with pytest.raises(ValueError) as info:
        gg.GemmTuning(**kwargs)
    for word in words:
        assert word in str(info.value)


@pytest.mark.skipif(not ops.grouped_gemm_available(), reason="mok::grouped_gemm_* not built")
@pytest.mark.parametrize("name", OPS)
def test_every_op_schema_ends_with_the_tuning_arguments(name):
    if not ops.has_op(f"grouped_gemm_{name}_out"):
        pytest.skip(f"mok::grouped_gemm_{name}_out not built")
    schema = getattr(torch.ops.mok, f"grouped_gemm_{name}_out").default._schema
    tail = [(a.name, str(a.type), a.default_value) for a in schema.arguments[-3:]]
    assert tail == [("schedule", "str", "cooperative"), ("raster", "str", "m"),
                    ("swizzle", "int", 1)]  # fmt: skip


@pytest.mark.skipif(not ops.grouped_gemm_available(), reason="mok::grouped_gemm_* not built")
def test_accumulate_schema_ends_with_the_tuning_arguments_then_the_store():
    if not ops.has_op("grouped_gemm_tn_accumulate_out"):
        pytest.skip("mok::grouped_gemm_tn_accumulate_out not built")
    schema = torch.ops.mok.grouped_gemm_tn_accumulate_out.default._schema
    tail = [(a.name, str(a.type), a.default_value) for a in schema.arguments[-4:]]
    assert tail == [("schedule", "str", "cooperative"), ("raster", "str", "m"),
                    ("swizzle", "int", 1), ("store", "str", gg.ACCUMULATE_STORES[0])]  # fmt: skip


def test_accumulate_store_is_checked_before_the_op():
    """A bad ``store`` names the allowed ones, and no op runs (the tensors are CPU ones)."""
    assert gg.ACCUMULATE_STORES == ("auto", "load", "reduce")
    x = torch.zeros(8, 8)
    with pytest.raises(ValueError) as info:
        gg.grouped_gemm_tn_accumulate(x, x, torch.zeros(1, dtype=torch.int32), x[None], store="sum")
    for word in ("store='sum'", "'auto'", "'load'", "'reduce'"):
        assert word in str(info.value)
