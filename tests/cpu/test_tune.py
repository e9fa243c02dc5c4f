"""scripts/tune.py's table: the knobs it writes are the sweep's best on the geometric mean over
the shapes (forward pair and backward comm SMs apart), per shape its own best, and MoKConfig's
"auto" knobs read them back."""

from __future__ import annotations

import dataclasses
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


def _fp8_case(shape, forward_ms):
    return {"shape": shape, "tokens_per_rank": 8192, "precision": "fp8_blockwise",
            "forward_ms": forward_ms, "best": min(forward_ms, key=forward_ms.get)}  # fmt: skip


def test_an_fp8_sweep_adds_its_forward_knobs_and_keeps_the_bf16_ones(tmp_path, monkeypatch):
    """tune.py --fp8 on the BF16 table: FP8 layers of a swept shape read its FP8 forward pair
    (the backward's comm SMs stay BF16's: FP8's backward is stage 1's), other shapes the FP8
    section's; BF16 layers read what they read before, and a later BF16 sweep keeps the FP8
    entries."""
    from mok_megatron.functional import config as config_module
    from mok_megatron.functional.config import LayerDims

    path = _sweep_table(tmp_path)
    bf16_before = path.read_text()
    qwen3, deepseek = LayerDims(2048, 768, 128, 8), LayerDims(7168, 2048, 256, 8)
    other = LayerDims(1024, 512, 64, 4)
    record = {"cases": [_fp8_case("qwen3-30b-a3b", {"8,128": 1.0, "32,256": 0.5})],
              "path": str(tmp_path / "tune_fp8_x.json"),
              "environment": {"gpu": "NVIDIA H200", "world_size": 1, "commit": "def",
                              "utc": "later"}}  # fmt: skip
    tune.write_fp8_entries(str(path), record, [(8, 128), (32, 256)])
    fp8 = "fp8_blockwise"
    assert _tuned_knobs(path, qwen3, fp8) == {"fwd_num_comm_sms": 32, "minibatch_size": 256,
                                              "bwd_num_comm_sms": 8}  # fmt: skip
    # deepseek-v3 was not swept in FP8: its own (BF16) entry
    assert _tuned_knobs(path, deepseek, fp8) == _tuned_knobs(path, deepseek)
    # an untuned shape: the FP8 section's pair over mok:
    assert _tuned_knobs(path, other, fp8) == {"fwd_num_comm_sms": 32, "minibatch_size": 256,
                                              "bwd_num_comm_sms": 8}  # fmt: skip
    # BF16 layers: unchanged
    assert _tuned_knobs(path, qwen3) == {"fwd_num_comm_sms": 8, "minibatch_size": 128,
                                         "bwd_num_comm_sms": 8}  # fmt: skip
    assert path.read_text().startswith(bf16_before.split("mok:")[0])  # the header comment kept
    # MoKConfig resolves by its own precision
    monkeypatch.setattr(config_module, "tuned_table_path", lambda device, num_ranks: path)
    resolved = MoKConfig(expert_precision=fp8).resolve("cuda", 1, qwen3)
    assert (resolved.fwd_num_comm_sms, resolved.minibatch_size) == (32, 256)
    assert MoKConfig().resolve("cuda", 1, qwen3).fwd_num_comm_sms == 8
    # A BF16 sweep rewrites its own entries and keeps the FP8 ones
    cases = [_case("qwen3-30b-a3b", {"8,128": 2.0, "16,256": 1.0}, {"8": 3.0, "32": 2.0})]
    tune.write_table(str(path), {**record, "cases": cases}, [(8, 128), (16, 256)])
    assert _tuned_knobs(path, qwen3) == {"fwd_num_comm_sms": 16, "minibatch_size": 256,
                                         "bwd_num_comm_sms": 32}  # fmt: skip
    assert _tuned_knobs(path, qwen3, fp8)["fwd_num_comm_sms"] == 32
    assert _tuned_knobs(path, other, fp8)["minibatch_size"] == 256


def test_an_fp8_sweep_of_a_shape_the_bf16_table_lacks(tmp_path):
    """tune.py --fp8 of a shape the BF16 sweep did not cover: the shape's entry holds only its
    dimensions and FP8 pair; an FP8 layer of it reads that pair, a BF16 one the mean's knobs."""
    from mok_megatron.functional.config import LayerDims

    path = _sweep_table(tmp_path)  # qwen3-30b-a3b and deepseek-v3
    record = {"cases": [_fp8_case("mixtral-8x7b", {"8,128": 2.0, "4,256": 1.0})],
              "path": str(tmp_path / "tune_fp8_y.json"),
              "environment": {"commit": "c", "utc": "u"}}  # fmt: skip
    tune.write_fp8_entries(str(path), record, [(8, 128), (4, 256)])
    mixtral = LayerDims(4096, 14336, 8, 2)  # scripts/bench_moe.py's mixtral-8x7b
    mean = {"fwd_num_comm_sms": 16, "minibatch_size": 256, "bwd_num_comm_sms": 8}
    assert _tuned_knobs(path, mixtral) == mean
    assert _tuned_knobs(path, mixtral, "fp8_blockwise") == {**mean, "fwd_num_comm_sms": 4,
                                                            "minibatch_size": 256}  # fmt: skip


def test_an_fp8_sweep_needs_the_bf16_table_first(tmp_path):
    import pytest

    record = {"cases": [_fp8_case("qwen3-30b-a3b", {"8,128": 1.0})], "path": "x.json",
              "environment": {"commit": "c", "utc": "u"}}  # fmt: skip
    with pytest.raises(SystemExit, match="run the BF16 sweep first"):
        tune.write_fp8_entries(str(tmp_path / "missing.yaml"), record, [(8, 128)])


def _rows_case(shape, pull, in_place, precision="bf16"):
    times = {"pull": pull, "in_place": in_place}
    return {"shape": shape, "tokens_per_rank": 8192, "precision": precision, "knobs": {},
            "fwd_rows_ms": times, "best": min(times, key=times.get)}  # fmt: skip


def _rows_record(tmp_path, cases):
    return {"cases": cases, "path": str(tmp_path / "tune_rows_x.json"),
            "environment": {"commit": "r0", "utc": "then"}}  # fmt: skip


def test_a_rows_sweep_sets_fwd_rows_auto_per_shape(tmp_path, monkeypatch):
    """tune.py --rows: each swept shape's faster rows in its entry, the geometric mean's in
    mok:; fwd_rows='auto' resolves to 'pull' where the table says 'pull' and stays 'auto' (in
    place where that can run) where it says 'in_place'; a knob given stays; the pair knobs are
    untouched."""
    from mok_megatron.functional import config as config_module
    from mok_megatron.functional.config import LayerDims, tuned_fwd_rows

    path = _sweep_table(tmp_path)
    qwen3, deepseek = LayerDims(2048, 768, 128, 8), LayerDims(7168, 2048, 256, 8)
    other = LayerDims(1024, 512, 64, 4)
    assert tuned_fwd_rows(path, qwen3) is None  # no rows sweep yet
    pairs_before = {layer: _tuned_knobs(path, layer) for layer in (qwen3, deepseek, other)}
    # qwen3 a little faster in place, deepseek much faster pulled: the mean pulls
    cases = [_rows_case("qwen3-30b-a3b", 1.1, 1.0), _rows_case("deepseek-v3", 10.0, 12.0)]
    tune.write_rows(str(path), _rows_record(tmp_path, cases))
    assert tuned_fwd_rows(path, qwen3) == "in_place"
    assert tuned_fwd_rows(path, deepseek) == "pull"
    assert tuned_fwd_rows(path, other) == "pull"  # mok:'s
    assert tuned_fwd_rows(path, qwen3, "fp8_blockwise") is None  # FP8's rows are FP8's own
    assert {layer: _tuned_knobs(path, layer) for layer in pairs_before} == pairs_before
    import yaml

    table = yaml.safe_load(path.read_text())
    assert table["shapes"]["deepseek-v3"]["fwd_rows_ms"] == {"pull": 10.0, "in_place": 12.0}
    assert table["rows_tuned_on"]["record"] == "tune_rows_x.json"
    monkeypatch.setattr(config_module, "tuned_table_path", lambda device, num_ranks: path)
    assert MoKConfig().resolve("cuda", 1, deepseek).fwd_rows == "pull"
    assert MoKConfig().resolve("cuda", 1, qwen3).fwd_rows == "auto"
    assert MoKConfig().resolve("cuda", 1, other).fwd_rows == "pull"
    assert MoKConfig(fwd_rows="in_place").resolve("cuda", 1, deepseek).fwd_rows == "in_place"
    # the pair knobs given too: only fwd_rows is left to resolve
    given = MoKConfig(fwd_num_comm_sms=4, minibatch_size=128, bwd_num_comm_sms=8)
    assert given.resolve("cuda", 1, deepseek) == dataclasses.replace(given, fwd_rows="pull")
    assert given.resolve("cuda", 1, qwen3) is given
    # A later pair sweep keeps the rows entries
    cases = [_case("qwen3-30b-a3b", {"8,128": 2.0, "16,256": 1.0}, {"8": 3.0, "32": 2.0})]
    tune.write_table(str(path), {**_rows_record(tmp_path, cases), "environment": {
        "gpu": "NVIDIA H200", "world_size": 1, "commit": "abc", "utc": "now"}},
        [(8, 128), (16, 256)])  # fmt: skip
    assert (tuned_fwd_rows(path, qwen3), tuned_fwd_rows(path, deepseek)) == ("in_place", "pull")
    assert tuned_fwd_rows(path, other) == "pull"
    assert _tuned_knobs(path, qwen3)["fwd_num_comm_sms"] == 16  # the new sweep's


def test_an_fp8_rows_sweep_sets_only_the_fp8_choice(tmp_path):
    from mok_megatron.functional.config import LayerDims, tuned_fwd_rows

    path = _sweep_table(tmp_path)
    qwen3, deepseek = LayerDims(2048, 768, 128, 8), LayerDims(7168, 2048, 256, 8)
    cases = [_rows_case("qwen3-30b-a3b", 2.0, 1.0, "fp8_blockwise")]
    tune.write_rows(str(path), _rows_record(tmp_path, cases))
    fp8 = "fp8_blockwise"
    assert tuned_fwd_rows(path, qwen3, fp8) == "in_place"
    assert tuned_fwd_rows(path, deepseek, fp8) == "in_place"  # the FP8 section's
    assert tuned_fwd_rows(path, qwen3) is None and tuned_fwd_rows(path, deepseek) is None
    # the FP8 pair of qwen3 (none swept: its BF16 entry's) is not changed by the rows entry
    assert _tuned_knobs(path, qwen3, fp8) == _tuned_knobs(path, qwen3)


def test_a_rows_sweep_needs_the_table_and_the_shape(tmp_path):
    import pytest

    record = _rows_record(tmp_path, [_rows_case("mixtral-8x7b", 1.0, 2.0)])
    with pytest.raises(SystemExit, match="run the pair sweep first"):
        tune.write_rows(str(tmp_path / "missing.yaml"), record)
    path = _sweep_table(tmp_path)  # qwen3-30b-a3b and deepseek-v3
    with pytest.raises(SystemExit, match="no entry for mixtral-8x7b; run the pair sweep"):
        tune.write_rows(str(path), record)


def test_a_table_with_unknown_rows_is_an_error(tmp_path):
    import pytest

    from mok_megatron.functional.config import tuned_fwd_rows

    path = _sweep_table(tmp_path)
    path.write_text(path.read_text().replace("mok:\n", "mok:\n  fwd_rows: gather\n", 1))
    with pytest.raises(ValueError, match=r"fwd_rows='gather' must be 'in_place' or 'pull'; rerun"):
        tuned_fwd_rows(path)
