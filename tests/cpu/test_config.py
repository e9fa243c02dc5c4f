"""MoKConfig: defaults, validation messages, YAML round trip."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from mok_megatron.functional import MoKConfig, workspace_bytes
from mok_megatron.functional.workspace import row_capacity


def test_every_knob_is_documented_and_defaults_validate():
    config = MoKConfig()
    names = [f.name for f in dataclasses.fields(MoKConfig)]
    assert names == ["fwd_num_comm_sms", "bwd_num_comm_sms", "minibatch_size", "macrobatch_size",
                     "schedule_capacity_multiplier", "cuda_forward", "cuda_backward",
                     "bwd_wgrad", "expert_gemm",
                     "expert_precision", "fp8_backward", "wait_timeout_ms",
                     "bwd_schedule", "megakernel_cluster", "fwd_rows",
                     "megakernel_order_block", "chained_launches"]  # fmt: skip
    for f in dataclasses.fields(MoKConfig):
        assert len(f.metadata["help"]) > 20, f.name
    assert config.bwd_schedule == "macrobatch"


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"minibatch_size": 1000}, ["minibatch_size=1000", "multiple of 128", "try 1024"]),
        (
            {"minibatch_size": 256, "macrobatch_size": 300},
            ["macrobatch_size=300", "minibatch_size", "try 512"],
        ),
        ({"macrobatch_size": 300}, ["macrobatch_size=300", "tile height", "try 384"]),
        ({"fwd_num_comm_sms": 0}, ["fwd_num_comm_sms=0", "[1, 128]"]),
        ({"schedule_capacity_multiplier": 0.5}, ["schedule_capacity_multiplier=0.5", ">= 1.0"]),
        ({"bwd_schedule": "fast"}, ["bwd_schedule='fast'", "macrobatch"]),
        ({"cuda_forward": "mega"}, ["cuda_forward='mega'", "'auto'"]),
        ({"cuda_backward": "mega"}, ["cuda_backward='mega'", "'auto'"]),
        (
            {"cuda_backward": "megakernel", "cuda_forward": "stage1"},
            ["cuda_backward='megakernel'", "cuda_forward='megakernel'"],
        ),
        ({"bwd_wgrad": "all"}, ["bwd_wgrad='all'", "'off'", "'down'"]),
        (
            {"bwd_wgrad": "down", "cuda_forward": "megakernel", "megakernel_cluster": 2},
            ["bwd_wgrad='down'", "megakernel_cluster=2", "megakernel_cluster=1", "bwd_wgrad='off'"],
        ),
        (
            {"bwd_wgrad": "down", "cuda_forward": "megakernel", "cuda_backward": "stage1"},
            ["bwd_wgrad='down'", "cuda_backward='stage1'", "cuda_backward='auto'"],
        ),
        ({"bwd_wgrad": "down"}, ["bwd_wgrad='down'", "cuda_forward='stage1'"]),
        (
            {
                "bwd_wgrad": "down",
                "cuda_forward": "megakernel",
                "expert_precision": "fp8_blockwise",
            },  # fmt: skip
            ["bwd_wgrad='down'", "expert_precision='fp8_blockwise'", "expert_precision='bf16'"],
        ),
        ({"expert_gemm": "fast"}, ["expert_gemm='fast'", "'auto'", "'l1'", "joined by"]),
        ({"expert_gemm": "l1,fp8"}, ["expert_gemm='l1,fp8'", "'wgrad'"]),
        ({"expert_precision": "fp8"}, ["expert_precision='fp8'", "'fp8_blockwise'", "'bf16'"]),
        ({"fp8_backward": "dgrad"}, ["fp8_backward='dgrad'", "expert_precision='fp8_blockwise'"]),
        (
            {
                "expert_precision": "fp8_blockwise",
                "cuda_forward": "megakernel",
                "cuda_backward": "megakernel",
            },  # fmt: skip
            ["cuda_backward='megakernel'", "stage 1", "cuda_backward='auto'"],
        ),
        (
            {
                "expert_precision": "fp8_blockwise",
                "cuda_forward": "megakernel",
                "megakernel_cluster": 2,
            },  # fmt: skip
            ["megakernel_cluster=2", "FP8 megakernel", "megakernel_cluster=1"],
        ),
        ({"expert_gemm": ""}, ["expert_gemm=''"]),
        ({"expert_gemm": 2}, ["expert_gemm=2"]),
        ({"wait_timeout_ms": 0}, ["wait_timeout_ms=0", "positive", "try 10000"]),
        ({"wait_timeout_ms": -5}, ["wait_timeout_ms=-5", "positive"]),
        ({"wait_timeout_ms": 2**31}, ["wait_timeout_ms=2147483648", "below 2**31"]),
        ({"fwd_rows": "gather"}, ["fwd_rows='gather'", "'in_place'", "'pull'"]),
        (
            {"fwd_rows": "in_place", "megakernel_cluster": 2},
            ["fwd_rows='in_place'", "megakernel_cluster=2", "fwd_rows='auto' or 'pull'"],
        ),
        ({"megakernel_cluster": 4}, ["megakernel_cluster=4", "(1, 2)"]),
        ({"megakernel_cluster": True}, ["megakernel_cluster=True", "(1, 2)"]),
        ({"megakernel_cluster": 2.0}, ["megakernel_cluster=2.0", "(1, 2)"]),
        (
            {"megakernel_cluster": 2, "fwd_num_comm_sms": 7},
            ["fwd_num_comm_sms=7", "multiple of megakernel_cluster=2", "try 8"],
        ),
        (
            {"megakernel_cluster": 2, "bwd_num_comm_sms": 21},
            ["bwd_num_comm_sms=21", "multiple of megakernel_cluster=2", "try 22"],
        ),
    ],
)
def test_invalid_knobs_name_rule_value_and_fix(kwargs, words):
    with pytest.raises(ValueError) as info:
        MoKConfig(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_auto_knobs_resolve_from_the_tuned_table_or_the_fallbacks(tmp_path, monkeypatch):
    from mok_megatron.functional import config as config_module

    config = MoKConfig()
    assert config.fwd_num_comm_sms == config.minibatch_size == config.bwd_num_comm_sms == "auto"
    # No table (a CPU device): the documented fallbacks.
    resolved = config.resolve("cpu", 1)
    assert (resolved.fwd_num_comm_sms, resolved.minibatch_size) == (16, 256)
    assert resolved.bwd_num_comm_sms == 20
    assert resolved.resolve("cpu", 1) is resolved  # nothing left to resolve
    # A table: its values; knobs given explicitly stay as given.
    table = tmp_path / "gpu_ep2.yaml"
    table.write_text("mok:\n  cuda_forward: megakernel\n  fwd_num_comm_sms: 8\n"
                     "  minibatch_size: 1024\n  bwd_num_comm_sms: 12\n")  # fmt: skip
    monkeypatch.setattr(config_module, "tuned_table_path", lambda device, num_ranks: table)
    resolved = MoKConfig(macrobatch_size=4096).resolve("cuda", 2)
    assert (resolved.fwd_num_comm_sms, resolved.minibatch_size) == (8, 1024)
    assert resolved.bwd_num_comm_sms == 12
    assert MoKConfig(bwd_num_comm_sms=5).resolve("cuda", 2).bwd_num_comm_sms == 5
    assert resolved.cuda_forward == "stage1"  # only the "auto" knobs come from the table
    assert MoKConfig(fwd_num_comm_sms=4).resolve("cuda", 2).fwd_num_comm_sms == 4
    # A resolved minibatch that the macrobatch is no multiple of breaks the rule, loudly.
    with pytest.raises(ValueError, match="macrobatch_size=640 must be a positive multiple of 1024"):
        MoKConfig(macrobatch_size=640).resolve("cuda", 2)
    table.write_text("mok:\n  minibatch_size: big\n")
    with pytest.raises(ValueError, match="must be an int; rerun scripts/tune.py"):
        MoKConfig().resolve("cuda", 2)


def test_the_shipped_tuned_tables_hold_valid_knobs():
    from mok_megatron.functional.config import (
        AUTO_FALLBACKS,
        FORWARD_TUNED_KNOBS,
        TUNED_DIR,
        _tuned_knobs,
        tuned_fwd_rows,
    )

    tables = sorted(TUNED_DIR.glob("*_ep*.yaml"))
    assert tables, f"no tuned tables under {TUNED_DIR}"
    import yaml

    from mok_megatron.functional.config import LayerDims

    for path in tables:
        knobs = _tuned_knobs(path)
        assert set(knobs) == set(AUTO_FALLBACKS), path
        MoKConfig(**knobs)  # validates
        for name, entry in yaml.safe_load(path.read_text())["shapes"].items():
            layer = LayerDims(*(entry[d] for d in LayerDims._fields))
            assert _tuned_knobs(path, layer) == {k: entry[k] for k in AUTO_FALLBACKS}, name
            # FP8 experts: the shape's FP8 forward pair where the table has one (tune.py --fp8)
            fp8 = {
                **{k: entry[k] for k in AUTO_FALLBACKS},
                **{k: v for k, v in entry.get("fp8_blockwise", {}).items()
                   if k in FORWARD_TUNED_KNOBS},
            }  # fmt: skip
            assert _tuned_knobs(path, layer, "fp8_blockwise") == fp8, name
            MoKConfig(**fp8)  # validates
            # its rows (tune.py --rows), where the table names them: valid knob values
            for precision in ("bf16", "fp8_blockwise"):
                rows = tuned_fwd_rows(path, layer, precision)
                MoKConfig(fwd_rows=rows or "auto")


def test_a_workspace_holds_its_resolved_config():
    ws = _tiny_workspace(MoKConfig())
    assert ws.config.fwd_num_comm_sms == 16 and ws.config.minibatch_size == 256
    assert ws.config.bwd_num_comm_sms == 20


@pytest.mark.parametrize("choice", ["auto", "torch", "engine", "l1", "l1,l2", "l1+wgrad",
                                    "l1, dswiglu, l2, dgrad, wgrad"])  # fmt: skip
def test_expert_gemm_accepts_the_named_choices_and_step_lists(choice):
    assert MoKConfig(expert_gemm=choice).expert_gemm == choice


def test_non_integer_knob_is_a_type_error():
    with pytest.raises(TypeError, match="minibatch_size"):
        MoKConfig(minibatch_size=256.0)
    with pytest.raises(TypeError, match="fwd_num_comm_sms='many' must be an int or 'auto'"):
        MoKConfig(fwd_num_comm_sms="many")
    with pytest.raises(TypeError, match="wait_timeout_ms=1.5 must be an int"):
        MoKConfig(wait_timeout_ms=1.5)
    with pytest.raises(TypeError, match="wait_timeout_ms=True must be an int"):
        MoKConfig(wait_timeout_ms=True)
    with pytest.raises(TypeError, match="chained_launches=1 must be True or False"):
        MoKConfig(chained_launches=1)


def test_wait_timeout_default_is_the_one_constant():
    from mok_megatron.functional.config import DEFAULT_WAIT_TIMEOUT_MS

    assert MoKConfig().wait_timeout_ms == DEFAULT_WAIT_TIMEOUT_MS == 10_000


def test_yaml_round_trip_and_unknown_keys(tmp_path):
    config = MoKConfig(fwd_num_comm_sms=24, minibatch_size=512, macrobatch_size=4096,
                       schedule_capacity_multiplier=3, expert_gemm="l1+wgrad",
                       wait_timeout_ms=60_000)  # fmt: skip
    path = tmp_path / "mok.yaml"
    config.to_yaml(path)
    assert "mok:" in path.read_text()
    assert MoKConfig.from_yaml(path) == config
    path.write_text("mok:\n  minibatch_sise: 256\n")
    with pytest.raises(ValueError, match="unknown MoKConfig key.*minibatch_sise"):
        MoKConfig.from_yaml(path)


def test_fingerprint_tracks_every_knob():
    base = MoKConfig()
    assert base.fingerprint() == MoKConfig().fingerprint()
    assert base.fingerprint() != MoKConfig(bwd_num_comm_sms=21).fingerprint()
    assert base.fingerprint() != MoKConfig(chained_launches=True).fingerprint()


def test_capacity_is_tile_aligned_and_capped_at_every_row():
    config = MoKConfig(schedule_capacity_multiplier=1.5)
    assert row_capacity(config, num_ranks=2, num_local_tokens=1000, topk=8) == 12032  # 1.5*8000
    assert row_capacity(MoKConfig(schedule_capacity_multiplier=16), 2, 100, 2) == 512  # 2*100*2
    shape = dict(num_ranks=2, num_local_tokens=64, hidden_size=8, topk=2, num_experts=4,
                 intermediate_size=8)  # fmt: skip
    assert workspace_bytes(config, **shape, backend="reference") == 0


# ------------------------------------------------------ knobs that a backend does not use
def test_minibatch_backward_is_rejected_naming_what_is_implemented():
    with pytest.raises(ValueError, match="bwd_schedule='minibatch' is not implemented.*"
                                         "'macrobatch'"):  # fmt: skip
        MoKConfig(bwd_schedule="minibatch")


def test_minibatch_backward_flag_reaches_the_same_error():
    import argparse

    from mok_megatron.megatron.arguments import add_mok_args, mok_config_from_args

    parser = add_mok_args(argparse.ArgumentParser())
    args = parser.parse_args(["--mok-bwd-schedule", "minibatch"])  # a known name: it parses
    with pytest.raises(ValueError, match="not implemented"):
        mok_config_from_args(args)


def _tiny_workspace(config):
    from mok_megatron import functional as F

    return F.create_workspace(config, device="cpu", num_local_tokens=8, hidden_size=16, topk=2,
                              num_experts=4, intermediate_size=8)  # fmt: skip


@pytest.mark.parametrize("knob,value", [("fwd_num_comm_sms", 24), ("bwd_num_comm_sms", 7),
                                        ("minibatch_size", 512), ("expert_gemm", "torch"),
                                        ("macrobatch_size", 1024),
                                        ("chained_launches", True)])  # fmt: skip
def test_a_knob_the_backend_ignores_warns_once_naming_knob_and_backend(knob, value):
    from mok_megatron.functional import config as config_module

    config_module._WARNED.clear()
    config = MoKConfig(**{knob: value})
    with pytest.warns(UserWarning, match=f"MoKConfig.{knob}={value} has no effect on the "
                                         "reference backend"):  # fmt: skip
        _tiny_workspace(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: a second workspace says nothing
        _tiny_workspace(config)


def test_default_knobs_and_used_knobs_do_not_warn():
    from mok_megatron.functional.config import warn_ignored_knobs

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _tiny_workspace(MoKConfig())
        assert warn_ignored_knobs(MoKConfig(macrobatch_size=1024), "cuda/stage1") == []
        # the reference's collectives on gloo wait at most wait_timeout_ms (rank_wait.py)
        assert warn_ignored_knobs(MoKConfig(wait_timeout_ms=500), "reference") == []
        for path in ("cuda/stage1", "cuda/megakernel"):  # the megakernel's backward is stage 1's
            assert warn_ignored_knobs(MoKConfig(expert_gemm="engine"), path) == []
            assert warn_ignored_knobs(MoKConfig(wait_timeout_ms=500), path) == []
            assert warn_ignored_knobs(MoKConfig(chained_launches=True), path) == []
    with pytest.warns(UserWarning, match="fwd_num_comm_sms=30 has no effect on the cuda/stage1"):
        assert warn_ignored_knobs(MoKConfig(fwd_num_comm_sms=30), "cuda/stage1") == [
            "fwd_num_comm_sms"
        ]


def test_megakernel_clusters_of_two_take_even_or_auto_comm_sms():
    """megakernel_cluster=2 with the "auto" comm SMs (the tuned tables and the fallbacks are
    even) or even ones is valid, and resolves as any other config."""
    config = MoKConfig(megakernel_cluster=2)
    resolved = config.resolve("cpu", 1)
    assert resolved.megakernel_cluster == 2
    assert resolved.fwd_num_comm_sms % 2 == resolved.bwd_num_comm_sms % 2 == 0
    assert MoKConfig(megakernel_cluster=2, fwd_num_comm_sms=8, bwd_num_comm_sms=20)


def test_megakernel_cluster_is_a_megakernel_knob():
    from mok_megatron.functional.config import warn_ignored_knobs

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_ignored_knobs(MoKConfig(megakernel_cluster=2), "cuda/megakernel") == []
    with pytest.warns(UserWarning, match="megakernel_cluster=2 has no effect on the cuda/stage1"):
        assert warn_ignored_knobs(MoKConfig(megakernel_cluster=2), "cuda/stage1") == [
            "megakernel_cluster"
        ]


def test_fwd_rows_is_a_megakernel_knob_and_picks_in_place_only_where_it_runs():
    """fwd_rows: 'auto' reads the rows in place at one rank without clusters (with FP8 experts
    not in a forward of several rounds that keeps its tokens: those are staged), pulls them
    otherwise; 'in_place' where it cannot run names why; 'pull' always pulls. Only the megakernel
    uses it."""
    from types import SimpleNamespace

    from mok_megatron.functional.config import warn_ignored_knobs
    from mok_megatron.functional.cuda.mega import rows_in_place

    def ws(config, num_ranks, rounds=1, tokens=8192, hidden=2048):
        mega = SimpleNamespace(num_rounds=rounds)
        return SimpleNamespace(config=config, num_ranks=num_ranks, num_local_tokens=tokens,
                               hidden_size=hidden, buffers=SimpleNamespace(mega=mega))  # fmt: skip

    fp8 = {"expert_precision": "fp8_blockwise"}
    assert MoKConfig().fwd_rows == "auto"
    assert rows_in_place(ws(MoKConfig(), 1))
    assert rows_in_place(ws(MoKConfig(), 1, rounds=3), save=True)  # bf16: staged rows in place
    assert not rows_in_place(ws(MoKConfig(), 2))
    assert not rows_in_place(ws(MoKConfig(megakernel_cluster=2), 1))
    assert rows_in_place(ws(MoKConfig(**fp8), 1))
    assert rows_in_place(ws(MoKConfig(**fp8), 1, rounds=3), save=False)
    assert not rows_in_place(ws(MoKConfig(**fp8), 1, rounds=3), save=True)
    assert not rows_in_place(ws(MoKConfig(fwd_rows="pull"), 1))
    assert rows_in_place(ws(MoKConfig(fwd_rows="in_place"), 1))
    with pytest.raises(ValueError, match=r"fwd_rows='in_place' cannot run: rows in place need one "
                       r"rank \(this workspace has 2\).*fwd_rows='auto' or 'pull'"):  # fmt: skip
        rows_in_place(ws(MoKConfig(fwd_rows="in_place"), 2))
    with pytest.raises(ValueError, match=r"FP8 rows in place read x quantised in place.*raise "
                       r"macrobatch_size"):  # fmt: skip
        rows_in_place(ws(MoKConfig(fwd_rows="in_place", **fp8), 1, rounds=2), save=True)
    # The loaders hold each row's offset (token * hidden elements) in 32 bits: a workspace whose
    # token rows reach past it pulls under 'auto', and 'in_place' says why it cannot run.
    limit = 2**32 - 1
    assert rows_in_place(ws(MoKConfig(), 1, tokens=limit // 7168, hidden=7168))
    assert not rows_in_place(ws(MoKConfig(), 1, tokens=limit // 7168 + 1, hidden=7168))
    assert not rows_in_place(ws(MoKConfig(**fp8), 1, tokens=2**20, hidden=8192))
    with pytest.raises(ValueError, match=r"fwd_rows='in_place' cannot run: the workspace's "
                       r"1048576 token rows of hidden=4096 are 4294967296 elements, more than "
                       r"the loaders' 32-bit row offsets reach \(4294967295\).*'auto' or "
                       r"'pull'"):  # fmt: skip
        rows_in_place(ws(MoKConfig(fwd_rows="in_place"), 1, tokens=2**20, hidden=4096))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_ignored_knobs(MoKConfig(fwd_rows="pull"), "cuda/megakernel") == []
    with pytest.warns(UserWarning, match="fwd_rows=pull has no effect on the cuda/stage1"):
        assert warn_ignored_knobs(MoKConfig(fwd_rows="pull"), "cuda/stage1") == ["fwd_rows"]


@pytest.mark.parametrize("value", ["auto", 8, 16])
def test_megakernel_order_block_takes_auto_8_or_16(value):
    assert MoKConfig(megakernel_order_block=value).megakernel_order_block == value


@pytest.mark.parametrize("value", [4, 32, "8", True, 16.0])
def test_megakernel_order_block_refuses_other_values(value):
    with pytest.raises(ValueError) as info:
        MoKConfig(megakernel_order_block=value)
    for word in (f"megakernel_order_block={value!r}", "'auto'", "(8, 16)"):
        assert word in str(info.value)
