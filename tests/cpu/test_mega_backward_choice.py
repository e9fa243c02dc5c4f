"""MoKConfig.cuda_backward's choice between the backward megakernel and stage 1's backward
(functional/cuda/mega.py: backward_unavailable, runs_backward), on stand-in contexts: what the
choice reads is the forward's context and the weights' form, no kernel runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mok_megatron.functional import MoKConfig
from mok_megatron.functional.cuda import mega
from mok_megatron.functional.types import ExpertWeights, FusedExpertWeights

BF16 = torch.bfloat16


def _ws(choice: str):
    return SimpleNamespace(config=MoKConfig(cuda_forward="megakernel", cuda_backward=choice))


def _ctx(plan=True, saved=True, h=True, a=True, kept=False):
    """A forward's context: one round (``saved``), or rounds (``saved`` False) that kept the act
    and h rings (``kept``) or only the received tokens."""
    rows = SimpleNamespace(h=torch.zeros(8, 16, dtype=BF16) if h else None,
                           a=torch.zeros(8, 8, dtype=BF16) if a else None)  # fmt: skip
    return SimpleNamespace(mega_plan={"row_tok": torch.zeros(8)} if plan else None,
                           saved=rows if saved else None,
                           kept=rows if kept and not saved else None)  # fmt: skip


FUSED = FusedExpertWeights(torch.zeros(1, 16, 8, dtype=BF16), torch.zeros(1, 8, 8, dtype=BF16))

#: (context, weights) the backward megakernel cannot take, and the words of the reason.
CANNOT = {
    "stage1_forward": (_ctx(plan=False), FUSED, "the forward was stage 1's"),
    "rounds_tokens_only": (_ctx(saved=False), FUSED, "macrobatch rounds"),
    "no_rings": (_ctx(h=False), FUSED, "activation rings"),
    "rounds_no_rings": (_ctx(saved=False, kept=True, h=False), FUSED, "activation rings"),
    "split_weights": (
        _ctx(),
        ExpertWeights(*(torch.zeros(1, 8, 8, dtype=BF16) for _ in range(3))),
        "fused gate/up",
    ),
    "float32_weights": (
        _ctx(),
        FusedExpertWeights(torch.zeros(1, 16, 8), torch.zeros(1, 8, 8)),
        "bf16 fused gate/up",
    ),
}


def test_auto_and_megakernel_run_it_where_the_forward_kept_one_round():
    assert mega.backward_unavailable(_ws("auto"), _ctx(), FUSED) is None
    assert mega.runs_backward(_ws("auto"), _ctx(), FUSED)
    assert mega.runs_backward(_ws("megakernel"), _ctx(), FUSED)


def test_auto_runs_it_after_rounds_that_kept_their_rings():
    """A forward of several macrobatch rounds that kept its act and h rings (the megakernel's,
    bf16, cuda_backward not 'stage1') takes the backward megakernel in rounds."""
    ctx = _ctx(saved=False, kept=True)
    assert mega.backward_unavailable(_ws("auto"), ctx, FUSED) is None
    assert mega.runs_backward(_ws("megakernel"), ctx, FUSED)


def test_stage1_never_runs_it():
    assert not mega.runs_backward(_ws("stage1"), _ctx(), FUSED)


@pytest.mark.parametrize("case", list(CANNOT))
def test_where_it_cannot_run_auto_takes_stage1_and_megakernel_says_why(case):
    ctx, routed, words = CANNOT[case]
    reason = mega.backward_unavailable(_ws("auto"), ctx, routed)
    assert reason is not None and words in reason, reason
    assert not mega.runs_backward(_ws("auto"), ctx, routed)
    with pytest.raises(ValueError, match=r"cuda_backward='megakernel' cannot run: .*" + words):
        mega.runs_backward(_ws("megakernel"), ctx, routed)
