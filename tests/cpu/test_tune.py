"""scripts/tune.py's table: the knobs it writes are the sweep's best on the geometric mean over
the shapes (forward pair and backward comm SMs apart), per shape its own best, and MoKConfig's
"auto" knobs read them back."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import tune  # noqa: E402

from mok_megatron.functional.config import AUTO_FALLBACKS, MoKConfig, _tuned_knobs  # noqa: E402


def _case(shape, forward_ms, fwd_bwd_ms):
    return {"shape": shape, "tokens_per_rank": 8192, "forward_ms": forward_ms,
            "best": min(forward_ms, key=forward_ms.get), "fwd_bwd_ms": fwd_bwd_ms,
            "bwd_best": min(fwd_bwd_ms, key=fwd_bwd_ms.get)}  # fmt: skip


def _sweep_table(tmp_path):
    """The table tune.write_table makes of a synthetic two-shape sweep. qwen3 prefers (8, 128) by
    a little, deepseek (16, 256) by a lot: the geometric mean picks deepseek's. Backward: qwen3
    prefers 8 comm SMs by a lot, deepseek 32 by a little: the mean picks 8."""
    cases = [
        _case("qwen3-30b-a3b", {"8,128": 1.0, "16,256": 1.1}, {"8": 3.0, "32": 6.0}),
        _case("deepseek-v3", {"8,128": 20.0, "16,256": 10.0}, {"8": 31.0, "32": 30.0}),
    ]
    record = {"cases": cases, "path": str(tmp_path / "tune_x.json"),
              "environment": {"gpu": "NVIDIA H200", "world_size": 1, "commit": "abc",
                              "utc": "now"}}  # fmt: skip
    path = tmp_path / "h200_ep1.yaml"
    tune.write_table(str(path), record, [(8, 128), (16, 256)])
    return path


def test_table_holds_the_geometric_mean_best_of_each_sweep(tmp_path):
    path = _sweep_table(tmp_path)
    knobs = _tuned_knobs(path)
    assert knobs == {"fwd_num_comm_sms": 16, "minibatch_size": 256, "bwd_num_comm_sms": 8}
    assert set(knobs) == set(AUTO_FALLBACKS)
    import yaml

    table = yaml.safe_load(path.read_text())
    assert table["shapes"]["qwen3-30b-a3b"]["bwd_num_comm_sms"] == 8
    assert table["shapes"]["deepseek-v3"]["bwd_num_comm_sms"] == 32
    assert table["shapes"]["qwen3-30b-a3b"]["fwd_num_comm_sms"] == 8
    assert table["shapes"]["deepseek-v3"]["fwd_bwd_ms"] == 30.0
    assert table["tuned_on"]["record"] == "tune_x.json"
    assert table["shapes"]["deepseek-v3"]["hidden_size"] == 7168  # the shape's dimensions
    assert MoKConfig.from_yaml(path).bwd_num_comm_sms == 8  # usable as --mok-config


def test_a_layer_of_a_tuned_shape_resolves_its_own_knobs(tmp_path, monkeypatch):
    from mok_megatron.functional import config as config_module
    from mok_megatron.functional.config import LayerDims

    path = _sweep_table(tmp_path)
    monkeypatch.setattr(config_module, "tuned_table_path", lambda device, num_ranks: path)
    qwen3 = LayerDims(2048, 768, 128, 8)  # scripts/bench_moe.py's qwen3-30b-a3b
    assert _tuned_knobs(path, qwen3) == {"fwd_num_comm_sms": 8, "minibatch_size": 128,
                                         "bwd_num_comm_sms": 8}  # fmt: skip
    resolved = MoKConfig(bwd_num_comm_sms=5).resolve("cuda", 1, LayerDims(7168, 2048, 256, 8))
    assert (resolved.fwd_num_comm_sms, resolved.minibatch_size) == (16, 256)
    assert resolved.bwd_num_comm_sms == 5  # given: stays
    assert MoKConfig().resolve("cuda", 1, LayerDims(7168, 2048, 256, 8)).bwd_num_comm_sms == 32
    # Another shape (or none given): the mean's knobs.
    other = MoKConfig().resolve("cuda", 1, LayerDims(1024, 512, 64, 4))
    assert (other.fwd_num_comm_sms, other.minibatch_size, other.bwd_num_comm_sms) == (16, 256, 8)
    assert MoKConfig().resolve("cuda", 1).fwd_num_comm_sms == 16


def test_sweep_arguments_cover_the_backward_knob():
    args = tune.parse_args(["--out", "x.json"])
    assert [int(v) for v in args.bwd_comm_sms.split(",")] == [8, 16, 20, 32]
