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


def test_table_holds_the_geometric_mean_best_of_each_sweep(tmp_path):
    points = [(8, 128), (16, 256)]
    # Shape a prefers (8, 128) by a little, b (16, 256) by a lot: the geometric mean picks b's.
    # Backward: a prefers 8 comm SMs by a lot, b 32 by a little: the mean picks 8.
    cases = [
        _case("a", {"8,128": 1.0, "16,256": 1.1}, {"8": 3.0, "32": 6.0}),
        _case("b", {"8,128": 20.0, "16,256": 10.0}, {"8": 31.0, "32": 30.0}),
    ]
    record = {"cases": cases, "path": str(tmp_path / "tune_x.json"),
              "environment": {"gpu": "NVIDIA H200", "world_size": 1, "commit": "abc",
                              "utc": "now"}}  # fmt: skip
    path = tmp_path / "h200_ep1.yaml"
    tune.write_table(str(path), record, points)
    knobs = _tuned_knobs(path)
    assert knobs == {"fwd_num_comm_sms": 16, "minibatch_size": 256, "bwd_num_comm_sms": 8}
    assert set(knobs) == set(AUTO_FALLBACKS)
    import yaml

    table = yaml.safe_load(path.read_text())
    assert table["shapes"]["a"]["bwd_num_comm_sms"] == 8
    assert table["shapes"]["b"]["bwd_num_comm_sms"] == 32
    assert table["shapes"]["a"]["fwd_num_comm_sms"] == 8
    assert table["shapes"]["b"]["fwd_bwd_ms"] == 30.0
    assert table["tuned_on"]["record"] == "tune_x.json"
    assert MoKConfig.from_yaml(path).bwd_num_comm_sms == 8  # usable as --mok-config


def test_sweep_arguments_cover_the_backward_knob():
    args = tune.parse_args(["--out", "x.json"])
    assert [int(v) for v in args.bwd_comm_sms.split(",")] == [8, 16, 20, 32]
