"""MoKConfig for the FP8 forward megakernel (expert_precision="fp8_blockwise" with
cuda_forward="megakernel"): accepted with either fp8_backward, refused in clusters of two CTAs
naming the rule; and the backward after it is stage 1's (mega.runs_backward on stand-in
contexts, as test_mega_backward_choice.py): the backward megakernel's router-weight gradient is
<d_rows @ W_down, a>, not <d_rows, y> of the FP8 GEMM's y. No kernel runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_mega_backward_choice import FUSED, _ctx

from mok_megatron.functional import MoKConfig
from mok_megatron.functional.cuda import mega


def _fp8_megakernel(**knobs) -> MoKConfig:
    return MoKConfig(expert_precision="fp8_blockwise", cuda_forward="megakernel", **knobs)


@pytest.mark.parametrize("fp8_backward", ["bf16", "dgrad"])
def test_fp8_megakernel_is_accepted(fp8_backward):
    config = _fp8_megakernel(fp8_backward=fp8_backward, fwd_num_comm_sms=8)
    assert (config.expert_precision, config.cuda_forward) == ("fp8_blockwise", "megakernel")
    assert config.megakernel_cluster == 1


def test_fp8_megakernel_in_clusters_is_refused_naming_the_rule():
    with pytest.raises(ValueError) as info:
        _fp8_megakernel(megakernel_cluster=2, fwd_num_comm_sms=8, bwd_num_comm_sms=8)
    message = str(info.value)
    assert "megakernel_cluster" in message and "fp8" in message, message
    MoKConfig(cuda_forward="megakernel", megakernel_cluster=2)  # BF16: clusters stay allowed


def test_backward_after_the_fp8_megakernel_is_stage1s():
    ws = SimpleNamespace(config=_fp8_megakernel())  # cuda_backward="auto"
    assert not mega.runs_backward(ws, _ctx(), FUSED)
    ws = SimpleNamespace(config=_fp8_megakernel(cuda_backward="stage1"))
    assert not mega.runs_backward(ws, _ctx(), FUSED)
