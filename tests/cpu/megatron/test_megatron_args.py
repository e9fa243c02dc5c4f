"""``add_mok_args``: the --mok-* flags come from MoKConfig's fields, 'mok' joins Megatron-LM's
dispatcher choices, and args resolve as defaults < --mok-config file < flags."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from mok_megatron.functional import MoKConfig
from mok_megatron.megatron import add_mok_args, mok_config_from_args, resolve_mok_config
from mok_megatron.megatron.arguments import mok_flag_name
from mok_megatron.megatron.megatron_lm_flags import megatron_lm_parser


def _plain_parser() -> argparse.ArgumentParser:
    return add_mok_args(argparse.ArgumentParser())


def test_one_flag_per_config_field_with_its_help():
    parser = _plain_parser()
    by_dest = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(MoKConfig):
        action = by_dest[f"mok_{f.name}"]
        flag = mok_flag_name(f.name)
        negative = [flag.replace("--", "--no-", 1)] if f.type in (bool, "bool") else []
        assert action.option_strings == [flag, *negative]  # a bool knob: --x and --no-x
        assert f.metadata["help"] in action.help
        assert action.default is None  # "not given": the file or the dataclass decides


def test_megatron_lm_parser_accepts_mok():
    args = megatron_lm_parser().parse_args(
        ["--moe-token-dispatcher-type", "mok", "--mok-minibatch-size", "512"]
    )
    assert args.moe_token_dispatcher_type == "mok"
    assert mok_config_from_args(args) == MoKConfig(minibatch_size=512)


def test_stock_choices_still_parse_and_unknown_ones_fail():
    parser = megatron_lm_parser()
    assert parser.parse_args(["--moe-token-dispatcher-type", "alltoall"]).mok_config is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-token-dispatcher-type", "mokk"])


def test_plain_parser_gets_the_dispatcher_flag():
    args = _plain_parser().parse_args(["--moe-token-dispatcher-type", "mok"])
    assert args.moe_token_dispatcher_type == "mok"


def test_defaults_then_file_then_flags(tmp_path):
    path = tmp_path / "knobs.yaml"
    MoKConfig(minibatch_size=512, macrobatch_size=8192).to_yaml(path)
    args = _plain_parser().parse_args(
        ["--mok-config", str(path), "--mok-macrobatch-size", "4096", "--mok-fwd-num-comm-sms", "8"]
    )
    config = mok_config_from_args(args)
    assert config == MoKConfig(minibatch_size=512, macrobatch_size=4096, fwd_num_comm_sms=8)
    assert mok_config_from_args(_plain_parser().parse_args([])) == MoKConfig()


def test_cuda_knobs_parse_from_flags():
    args = _plain_parser().parse_args(
        ["--mok-expert-gemm", "l1+l2", "--mok-wait-timeout-ms", "500"]
    )
    assert mok_config_from_args(args) == MoKConfig(expert_gemm="l1+l2", wait_timeout_ms=500)
    args = _plain_parser().parse_args(["--mok-chained-launches"])  # a bool knob: --x / --no-x
    assert mok_config_from_args(args) == MoKConfig(chained_launches=True)
    args = _plain_parser().parse_args(["--mok-chained-launches", "--no-mok-chained-launches"])
    assert mok_config_from_args(args) == MoKConfig(chained_launches=False)
    args = _plain_parser().parse_args(["--mok-expert-gemm", "l1+fp8"])
    with pytest.raises(ValueError, match="expert_gemm='l1\\+fp8' must be one of"):
        mok_config_from_args(args)


def test_bad_values_fail_with_the_config_rule():
    args = _plain_parser().parse_args(["--mok-minibatch-size", "1000"])
    with pytest.raises(ValueError, match="minibatch_size=1000 must be a positive multiple of 128"):
        mok_config_from_args(args)
    with pytest.raises(SystemExit):  # not a choice
        _plain_parser().parse_args(["--mok-bwd-schedule", "fastest"])
    with pytest.raises(SystemExit):  # not an int
        _plain_parser().parse_args(["--mok-minibatch-size", "big"])


def test_auto_knob_flags_take_an_int_or_auto():
    args = _plain_parser().parse_args(["--mok-fwd-num-comm-sms", "auto", "--mok-minibatch-size",
                                       "1024"])  # fmt: skip
    assert mok_config_from_args(args) == MoKConfig(fwd_num_comm_sms="auto", minibatch_size=1024)


def test_resolve_mok_config_forms():
    config = MoKConfig(minibatch_size=256)
    assert resolve_mok_config(config) is config
    assert resolve_mok_config({"minibatch_size": 512}) == MoKConfig(minibatch_size=512)
    assert resolve_mok_config(None) == MoKConfig()
    with pytest.raises(ValueError, match="unknown MoKConfig key"):
        resolve_mok_config({"mini_batch": 1})
    with pytest.raises(TypeError, match="mok_config must be"):
        resolve_mok_config(3)


def test_resolve_from_megatron_lm_global_args(monkeypatch):
    from megatron.training import global_vars

    args = megatron_lm_parser().parse_args(["--mok-schedule-capacity-multiplier", "4"])
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    assert resolve_mok_config(None) == MoKConfig(schedule_capacity_multiplier=4.0)
