"""Megatron's own FP8 flags and MoK's expert precision (honour_megatron_fp8): e4m3 + blockwise
is MoK's fp8_blockwise, anything else leaves the experts BF16 with a warning, an explicit MoK
precision is kept; --mok-expert-precision parses with its choices."""

from __future__ import annotations

import argparse
import types

import pytest

from mok_megatron.functional import MoKConfig
from mok_megatron.megatron import add_mok_args, mok_config_from_args
from mok_megatron.megatron.arguments import honour_megatron_fp8
from mok_megatron.megatron.megatron_lm_flags import megatron_lm_parser


def test_e4m3_blockwise_flags_give_fp8_blockwise_experts():
    args = megatron_lm_parser().parse_args(
        ["--moe-token-dispatcher-type", "mok", "--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]
    )
    config = honour_megatron_fp8(mok_config_from_args(args), args)
    assert config == MoKConfig(expert_precision="fp8_blockwise")


def test_no_fp8_flags_leave_the_config_as_it_is():
    args = megatron_lm_parser().parse_args(["--moe-token-dispatcher-type", "mok"])
    config = MoKConfig(minibatch_size=512)
    assert honour_megatron_fp8(config, args) is config


@pytest.mark.parametrize("fmt,recipe", [("hybrid", "blockwise"), ("e4m3", "delayed"),
                                        ("e4m3", "mxfp8")])  # fmt: skip
def test_other_fp8_recipes_warn_and_stay_bf16(fmt, recipe):
    with pytest.warns(UserWarning, match="stay BF16"):
        config = honour_megatron_fp8(MoKConfig(), types.SimpleNamespace(fp8=fmt, fp8_recipe=recipe))
    assert config.expert_precision == "bf16"


def test_an_explicit_mok_precision_wins():
    given = MoKConfig(expert_precision="fp8_blockwise")
    other = types.SimpleNamespace(fp8="hybrid", fp8_recipe="delayed")
    assert honour_megatron_fp8(given, other) is given


def test_mok_expert_precision_flag():
    parser = add_mok_args(argparse.ArgumentParser())
    args = parser.parse_args(["--mok-expert-precision", "fp8_blockwise"])
    assert mok_config_from_args(args).expert_precision == "fp8_blockwise"
    with pytest.raises(SystemExit):
        parser.parse_args(["--mok-expert-precision", "fp8"])


def test_mok_fp8_backward_with_megatrons_fp8_flags(tmp_path):
    """--mok-fp8-backward dgrad needs fp8_blockwise: Megatron's e4m3 + blockwise flags give it
    (a flag or a --mok-config file, too); without them the config rule names the fix."""
    fp8 = ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]
    args = megatron_lm_parser().parse_args(["--mok-fp8-backward", "dgrad", *fp8])
    assert mok_config_from_args(args) == MoKConfig(expert_precision="fp8_blockwise",
                                                   fp8_backward="dgrad")  # fmt: skip
    path = tmp_path / "knobs.yaml"
    path.write_text("mok:\n  fp8_backward: dgrad\n")
    args = megatron_lm_parser().parse_args(["--mok-config", str(path), *fp8])
    assert mok_config_from_args(args).fp8_backward == "dgrad"
    args = megatron_lm_parser().parse_args(["--mok-fp8-backward", "dgrad"])
    with pytest.raises(ValueError, match="needs expert_precision='fp8_blockwise'"):
        mok_config_from_args(args)
    args = megatron_lm_parser().parse_args(["--mok-expert-precision", "bf16", *fp8])
    assert mok_config_from_args(args).expert_precision == "bf16"  # named: it wins here
