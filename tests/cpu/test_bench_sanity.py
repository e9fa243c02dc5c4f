"""The benchmark and report scripts run end to end on CPU at a tiny size, so they cannot rot."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = [os.path.join(ROOT, "scripts", "bench_moe.py"), "--tiny", "--device", "cpu",
         "--iters", "2", "--warmup", "1", "--rotate", "2", "--live-ceiling"]  # fmt: skip


def _script(name):
    """scripts/<name>.py as a module (scripts/ on the import path only while it loads)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def _entry(ms, frac):
    """A bench_moe.py contender entry: ms median (+-0.1 spread), fraction of the floor, 1 GiB."""
    return {"median_ms_all_ranks_max": ms, "p10_ms": ms - 0.1, "p90_ms": ms + 0.1,
            "fraction_of_floor": frac, "peak_mem_bytes": 2**30}  # fmt: skip


def _env():
    return {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("ep", [1, 2])
def test_bench_runs_on_cpu_and_the_report_renders(tmp_path, ep):
    out = tmp_path / "bench.json"
    launcher = [sys.executable]
    if ep > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ep}"]
    subprocess.run(launcher + BENCH + ["--out", str(out)], check=True, env=_env(), cwd=ROOT,
                   timeout=600)  # fmt: skip
    record = json.loads(out.read_text())
    assert record["environment"]["world_size"] == ep
    assert len(record["cases"]) == 2  # uniform and skewed
    for case in record["cases"]:
        assert case["mok_backend"] == "reference"
        assert case["output_rel_diff"] < 1e-5  # float32 on CPU: same layer, same answer
        for label in ("fwd", "fwd_bwd"):
            r = case[label]
            assert r["cost"]["flops"] > 0 and r["speedup"] > 0
            assert r["mok"]["median_ms"] > 0 and r["baseline"]["median_ms"] > 0
            assert r["mok"]["gpu_during"] is None  # no GPU, no clock samples
            dense = r["dense_ceiling"]  # --live-ceiling: a dense GEMM of (about) the pass's FLOPs
            assert dense["matmuls"] >= 1 and dense["tflops"] > 0
            assert r["mok"]["of_dense_ceiling"] == pytest.approx(
                r["mok"]["tflops"] / dense["tflops"]
            )
        assert case["routed_rows_rank"] > 0
        assert (case["remote_pairs_rank"] > 0) == (ep > 1)
    md, png = tmp_path / "PERF.md", tmp_path / "perf.png"
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "perf_report.py"),
            str(out),
            "--md",
            str(md),
            "--png",
            str(png),
        ],
        check=True,
        env=_env(),
        timeout=300,
    )
    text = md.read_text()
    assert f"| tiny | {ep} | 64 | uniform | fwd |" in text
    assert png.stat().st_size > 1000


def test_bench_with_main_grad_runs_on_cpu(tmp_path):
    """--main-grad: MoK's backward adds into the fp32 main_grads (the record says so)."""
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, *BENCH, "--main-grad", "--routing", "uniform", "--out",
                    str(out)], check=True, env=_env(), cwd=ROOT, timeout=600)  # fmt: skip
    record = json.loads(out.read_text())
    assert record["args"]["main_grad"] is True
    (case,) = record["cases"]
    assert case["mok_into_main_grad"] is True
    assert case["fwd_bwd"]["mok"]["median_ms"] > 0 and case["fwd_bwd"]["baseline"]["median_ms"] > 0


def test_bench_wgrad_schedule_contenders_time_the_backward_only(tmp_path):
    """--mok-wgrad-pingpong / --mok-wgrad-cluster2: forward + backward contenders (the forward has
    no weight gradients) with their ratios to the default; the engine's tile order is restored
    after each."""
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, *BENCH, "--main-grad", "--mok-wgrad-pingpong",
                    "--mok-wgrad-cluster2", "--routing", "uniform", "--out", str(out)],
                   check=True, env=_env(), cwd=ROOT, timeout=600)  # fmt: skip
    (case,) = json.loads(out.read_text())["cases"]
    r = case["fwd_bwd"]
    for name in ("pingpong", "cluster2"):
        assert f"mok_wgrad_{name}" not in case["fwd"]
        assert r[f"mok_wgrad_{name}"]["median_ms"] > 0
        assert r[f"wgrad_{name}_speedup"] == pytest.approx(
            r["mok"]["median_ms_all_ranks_max"] / r[f"mok_wgrad_{name}"]["median_ms_all_ranks_max"]
        )


def test_bench_rounds_contenders_and_their_backward_ratio(tmp_path):
    """--mok-macrobatch ROWS: MoK with macrobatch_size=ROWS in both passes, and in the forward +
    backward with stage 1's backward too, with the ratio of the two backwards."""
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, *BENCH, "--mok-macrobatch", "256", "--routing", "uniform",
                    "--out", str(out)], check=True, env=_env(), cwd=ROOT, timeout=600)  # fmt: skip
    (case,) = json.loads(out.read_text())["cases"]
    assert case["fwd"]["mok_rounds"]["median_ms"] > 0
    assert "mok_rounds_stage1_bwd" not in case["fwd"]
    r = case["fwd_bwd"]
    assert r["mok_rounds"]["median_ms"] > 0 and r["mok_rounds_stage1_bwd"]["median_ms"] > 0
    assert r["rounds_bwd_speedup"] == pytest.approx(
        r["mok_rounds_stage1_bwd"]["median_ms_all_ranks_max"]
        / r["mok_rounds"]["median_ms_all_ranks_max"]
    )


def test_bench_chained_ab_times_both_settings_in_both_passes_and_back_to_back(tmp_path):
    """--mok-chained-ab: MoK with chained_launches=True and False beside the default in both
    passes (and back to back with --back-to-back), with the ratios of the two; perf_report's
    chained table renders them."""
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, *BENCH, "--mok-chained-ab", "--back-to-back", "2",
                    "--routing", "uniform", "--out", str(out)], check=True, env=_env(), cwd=ROOT,
                   timeout=600)  # fmt: skip
    record = json.loads(out.read_text())
    (case,) = record["cases"]
    for label in ("fwd", "fwd_bwd"):
        r = case[label]
        for suffix, ratio in (("", "chained_speedup"),
                              ("_back_to_back", "chained_back_to_back_speedup")):  # fmt: skip
            slow, fast = r[f"mok_unchained{suffix}"], r[f"mok_chained{suffix}"]
            assert slow["median_ms"] > 0 and fast["median_ms"] > 0
            assert r[ratio] == pytest.approx(
                slow["median_ms_all_ranks_max"] / fast["median_ms_all_ranks_max"]
            )
    rows = list(_script("perf_report").chained_rows([(str(out), record)]))
    assert [row.split(" | ")[4] for row in rows] == [
        "fwd",
        "fwd (back to back)",
        "fwd+bwd",
        "fwd+bwd (back to back)",
    ]


def test_bench_chained_ab_value_names_the_contender_timed_first():
    """--mok-chained-ab's value orders the pair (two processes can swap it); bare is chained."""
    bench = _script("bench_moe")
    for argv, first in (([], "mok_chained"), (["chained"], "mok_chained"),
                        (["unchained"], "mok_unchained")):  # fmt: skip
        args = bench.parse_args(["--mok-chained-ab", *argv])
        assert [name for name, _ in bench.chain_ab(args)][0] == first
        assert {name for name, _ in bench.chain_ab(args)} == {"mok_chained", "mok_unchained"}


def test_chained_rows_add_the_replayed_forward_where_the_record_has_it():
    perf_report = _script("perf_report")

    fwd = {"mok_chained": _entry(2.0, 0.5), "mok_unchained": _entry(2.1, 0.48),
           "chained_speedup": 1.05, "mok_chained_graph": _entry(1.5, 0.6),
           "mok_unchained_graph": _entry(1.6, 0.55), "chained_graph_speedup": 1.07}  # fmt: skip
    case = {"shape": "s", "ep": 1, "tokens_per_rank": 64, "routing": "uniform",
            "mok_backend": "cuda/megakernel", "fwd": fwd, "fwd_bwd": {}}  # fmt: skip
    assert list(perf_report.chained_rows([("r.json", {"cases": [case]})])) == [
        "| s | 1 | 64 | uniform | fwd | cuda/megakernel | 2.000 (1.900-2.100) "
        "| 2.100 (2.000-2.200) | **1.05x** | 0.50 | 0.48 | 1.00 | 1.00 |",
        "| s | 1 | 64 | uniform | fwd (graph) | cuda/megakernel | 1.500 (1.400-1.600) "
        "| 1.600 (1.500-1.700) | **1.07x** | 0.60 | 0.55 | 1.00 | 1.00 |",
    ]


def test_mok_knobs_set_and_restore_the_wgrad_tuning():
    from mok_megatron.functional import MoKConfig
    from mok_megatron.functional.cuda import experts
    from mok_megatron.ops.grouped_gemm import GemmTuning

    bench = _script("bench_moe")
    runtime = argparse.Namespace(mok_config=MoKConfig())
    layer = argparse.Namespace(experts=argparse.Namespace(_layer_runtime=runtime))
    default = experts.WGRAD_TUNING
    with bench._mok_knobs(layer, **bench.WGRAD_PINGPONG_KNOBS):
        assert experts.WGRAD_TUNING == GemmTuning(schedule="pingpong")
        assert runtime.mok_config.expert_gemm == "l1,l2,wgrad"
    assert experts.WGRAD_TUNING is default and runtime.mok_config == MoKConfig()
    with bench._mok_knobs(layer, **bench.WGRAD_CLUSTER2_KNOBS):
        assert experts.WGRAD_TUNING == GemmTuning(schedule="cooperative_cluster2")
        assert runtime.mok_config.expert_gemm == "l1,l2,wgrad"
    assert experts.WGRAD_TUNING is default and runtime.mok_config == MoKConfig()


def test_graph_rows_render_and_need_a_gpu(tmp_path):
    """--mok-graph refuses a CPU run by name; perf_report renders a case's 'mok' and 'mok_graph'
    timings (a synthetic record) into the graph table's row, and skips a case without them."""
    run = subprocess.run([sys.executable, *BENCH, "--mok-graph"], env=_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode != 0 and "--mok-graph captures CUDA graphs" in run.stderr
    perf_report = _script("perf_report")
    mok = {"median_ms_all_ranks_max": 2.0, "p10_ms": 1.9, "p90_ms": 2.1, "fraction_of_floor": 0.4}
    graphed = {**mok, "median_ms_all_ranks_max": 1.0, "p10_ms": 0.95, "p90_ms": 1.05,
               "fraction_of_floor": 0.8}  # fmt: skip
    case = {"shape": "s", "ep": 1, "tokens_per_rank": 64, "routing": "uniform",
            "mok_backend": "cuda/megakernel",
            "fwd": {"cost": {"floor_ms": 0.8}, "mok": mok, "mok_graph": graphed}}  # fmt: skip
    (row,) = perf_report.graph_rows([("r.json", {"cases": [case, {**case, "fwd": {}}]})])
    assert row == ("| s | 1 | 64 | uniform | cuda/megakernel | 2.000 (1.900-2.100) "
                   "| 1.000 (0.950-1.050) | 0.800 | 0.40 | 0.80 |")  # fmt: skip


def test_pull_rows_render_timed_and_replayed_rows_in_place_against_pulled():
    """perf_report's rows-in-place table (bench_moe --mok-pull, with --mok-graph): per case a
    forward and a forward + backward row (in place = 'mok' against 'mok_pull') and a replayed
    forward row ('mok_graph' against 'mok_pull_graph'); nothing for a case without them."""
    perf_report = _script("perf_report")

    fwd = {"mok": _entry(2.0, 0.5), "mok_pull": _entry(2.2, 0.45), "pull_speedup": 1.1,
           "mok_graph": _entry(1.5, 0.6), "mok_pull_graph": _entry(1.8, 0.5),
           "pull_graph_speedup": 1.2}  # fmt: skip
    fwd_bwd = {"mok": _entry(6.0, 0.4), "mok_pull": _entry(6.3, 0.38), "pull_speedup": 1.05}
    case = {"shape": "s", "ep": 1, "tokens_per_rank": 64, "routing": "uniform",
            "mok_backend": "cuda/megakernel", "fwd": fwd, "fwd_bwd": fwd_bwd}  # fmt: skip
    rows = list(perf_report.pull_rows([("r.json", {"cases": [case, {**case, "fwd": {},
                                                                    "fwd_bwd": {}}]})]))  # fmt: skip
    assert rows == [
        "| s | 1 | 64 | uniform | fwd | cuda/megakernel | 2.000 (1.900-2.100) "
        "| 2.200 (2.100-2.300) | **1.10x** | 0.50 | 0.45 | 1.00 | 1.00 |",
        "| s | 1 | 64 | uniform | fwd (graph) | cuda/megakernel | 1.500 (1.400-1.600) "
        "| 1.800 (1.700-1.900) | **1.20x** | 0.60 | 0.50 | 1.00 | 1.00 |",
        "| s | 1 | 64 | uniform | fwd+bwd | cuda/megakernel | 6.000 (5.900-6.100) "
        "| 6.300 (6.200-6.400) | **1.05x** | 0.40 | 0.38 | 1.00 | 1.00 |",
    ]


def test_clock_rows_render_each_contender_timed_with_clock_samples():
    """perf_report's clock table: one row per pass and contender with ``gpu_during`` (bench_moe's
    NVML samples while it was timed; a synthetic record), none for those without."""
    perf_report = _script("perf_report")
    during = {"samples": 40, "sm_mhz_median": 1530.0, "sm_mhz_min": 1410.0,
              "sm_mhz_max": 1980.0, "power_w_median": 689.6}  # fmt: skip
    case = {"shape": "s", "ep": 1, "tokens_per_rank": 64, "routing": "uniform",
            "fwd": {"cost": {"floor_ms": 1.0}, "speedup": 1.2,
                    "mok": {"fraction_of_floor": 0.56, "gpu_during": during},
                    "baseline": {"fraction_of_floor": 0.43, "gpu_during": None}}}  # fmt: skip
    (row,) = perf_report.clock_rows([("/x/r.json", {"cases": [case]})])
    assert (
        row == "| r.json | s | 1 | 64 | uniform | fwd | mok | 1530 (1410-1980) | 690 | 0.56 | - |"
    )
    # --live-ceiling: the contender's rate over the dense GEMM's, and the dense GEMM's own row
    case["fwd"]["mok"]["of_dense_ceiling"] = 0.7
    case["fwd"]["dense_ceiling"] = {"tflops": 612.4, "gpu_during": during}
    rows = list(perf_report.clock_rows([("/x/r.json", {"cases": [case]})]))
    assert rows == [
        "| r.json | s | 1 | 64 | uniform | fwd | mok | 1530 (1410-1980) | 690 | 0.56 | 0.70 |",
        "| r.json | s | 1 | 64 | uniform | fwd | dense_ceiling | 1530 (1410-1980) | 690 "
        "| (612 TFLOP/s) | 1.00 |",
    ]


def test_gpu_state_rows_render_each_case_that_has_one():
    """perf_report's GPU-state table: one row per case with ``gpu_state_after`` (a synthetic
    record), a missing field shown as such, a case without a state skipped."""
    perf_report = _script("perf_report")
    state = {"clocks.sm": "1590", "clocks.max.sm": "1980", "power.draw": "687.42",
             "temperature.gpu": "53"}  # fmt: skip
    case = {"shape": "s", "ep": 1, "tokens_per_rank": 64, "routing": "skewed",
            "gpu_state_after": state}  # fmt: skip
    record = {"cases": [case, {**case, "gpu_state_after": None}]}
    (row,) = perf_report.gpu_state_rows([("/x/r.json", record)])
    assert row == "| r.json | s | 1 | 64 | skewed | 1590 / 1980 | 687.42 | 53 | n/a |"


def test_compare_rows_pair_the_same_cases_of_two_records(tmp_path):
    """perf_report --compare: one row per pass of each case the two records share (synthetic
    records), MoK's medians and peaks before and after beside the baseline's; a case only in
    one record, or skipped, or a pass one record lacks, gives no row; a --main-grad record
    against a plain one is refused."""
    perf_report = _script("perf_report")

    def timing(ms, peak_gib):
        return {"median_ms_all_ranks_max": ms, "p10_ms": ms - 0.1, "p90_ms": ms + 0.1,
                "peak_mem_bytes": int(peak_gib * 2**30)}  # fmt: skip

    def case(tokens, mok_ms, peak, base_ms, ep=1):
        passes = {"mok": timing(mok_ms, peak), "baseline": timing(base_ms, 2.0)}
        return {"shape": "s", "ep": ep, "tokens_per_rank": tokens, "routing": "uniform",
                "mok_backend": "cuda/megakernel", "fwd": passes, "fwd_bwd": passes}  # fmt: skip

    fwd_only = {k: v for k, v in case(32, 1.0, 1.0, 1.0).items() if k != "fwd_bwd"}
    before, after = tmp_path / "a.json", tmp_path / "b.json"
    before.write_text(json.dumps({"cases": [case(64, 2.0, 1.5, 3.0), case(128, 1.0, 1.0, 1.0),
                                            case(32, 1.0, 1.0, 1.0)]}))  # fmt: skip
    after.write_text(json.dumps({"cases": [case(64, 1.0, 0.5, 3.5), case(256, 1.0, 1.0, 1.0),
                                           case(64, 1.0, 1.0, 1.0, ep=2), fwd_only,
                                           {"shape": "s", "tokens_per_rank": 128,
                                            "routing": "uniform", "skipped": "why"}]}))  # fmt: skip
    rows = list(perf_report.compare_rows(before, after))
    assert rows == [
        f"| s | 1 | 64 | uniform | {p} | 2.000 (1.900-2.100) | 1.000 (0.900-1.100) | 1.50 "
        "| 0.50 | 3.000 (2.900-3.100) | 3.500 (3.400-3.600) |"
        for p in ("fwd", "fwd+bwd")
    ] + ["| s | 1 | 32 | uniform | fwd | 1.000 (0.900-1.100) | 1.000 (0.900-1.100) | 1.00 "
         "| 1.00 | 1.000 (0.900-1.100) | 1.000 (0.900-1.100) |"]  # fmt: skip
    main_grad = tmp_path / "c.json"
    main_grad.write_text(json.dumps({"args": {"main_grad": True}, "cases": []}))
    with pytest.raises(SystemExit, match="--main-grad record"):
        list(perf_report.compare_rows(before, main_grad))


def test_fp8_layer_table_has_a_dgrad_row_where_the_record_has_one():
    """bench_fp8_gemm's layer table from a synthetic ``bench_moe.py --mok-fp8`` record: one row
    per pass, a "(FP8 dgrads)" row for the forward + backward's ``mok_fp8_dgrad`` and a "(FP8
    megakernel)" row for the forward's ``mok_fp8_mega``."""
    bench_fp8_gemm = _script("bench_fp8_gemm")

    def ms(value):
        return {"median_ms_all_ranks_max": value}

    fwd = {"baseline": ms(4.0), "mok": ms(2.0), "mok_fp8": ms(1.0), "fp8_speedup": 2.0}
    bwd = {**fwd, "mok_fp8_dgrad": ms(0.5), "fp8_dgrad_speedup": 4.0,
           "mok_fp8_mega_dgrad": ms(0.4), "fp8_mega_dgrad_speedup": 5.0}  # fmt: skip
    fwd = {**fwd, "mok_fp8_mega": ms(0.8), "fp8_mega_speedup": 2.5}
    record = {"environment": {"gpu": "G", "torch": "t", "commit": "abcdef0123", "world_size": 1},
              "cases": [{"shape": "deepseek-v3", "tokens_per_rank": 64, "fwd": fwd,
                         "fwd_bwd": bwd, "mok_backend": "cuda/megakernel"}]}  # fmt: skip
    rows = bench_fp8_gemm.render_layer(record).splitlines()[4:]
    assert rows == [
        "| deepseek-v3 | 64 | fwd | 4.00 | 2.00 | megakernel | 1.00 | 2.00x | 1.5x |",
        "| deepseek-v3 | 64 | fwd (FP8 megakernel) | 4.00 | 2.00 | megakernel | 0.80 | 2.50x | 1.5x |",
        "| deepseek-v3 | 64 | fwd_bwd | 4.00 | 2.00 | megakernel | 1.00 | 2.00x | 1.3x |",
        "| deepseek-v3 | 64 | fwd_bwd (FP8 dgrads) | 4.00 | 2.00 | megakernel | 0.50 | 4.00x | 1.3x |",
        "| deepseek-v3 | 64 | fwd_bwd (FP8 megakernel, FP8 dgrads) | 4.00 | 2.00 | megakernel | "
        "0.40 | 5.00x | 1.3x |",
    ]
    # Both forwards replayed from CUDA graphs (--mok-graph with --mok-fp8-mega): a row of their own
    fwd.update(mok_graph=ms(1.5), mok_fp8_mega_graph=ms(0.5), fp8_mega_graph_speedup=3.0)
    assert bench_fp8_gemm.render_layer(record).splitlines()[6] == (
        "| deepseek-v3 | 64 | fwd replayed (FP8 megakernel) | - | 1.50 | megakernel, replayed | "
        "0.50 | 3.00x | 1.5x |"
    )
    # The record line names the flags that chose the contenders
    record["args"] = {"mok_fp8": True, "mok_cuda_forward": "megakernel", "mok_stage1": True,
                      "mok_graph": True}  # fmt: skip
    assert ("(`scripts/bench_moe.py --mok-fp8 --mok-cuda-forward megakernel --mok-stage1 "
            "--mok-fp8-mega --mok-graph`)") in bench_fp8_gemm.render_layer(record)  # fmt: skip
    # ... and not --mok-fp8 where the bench ran without it (the FP8 megakernel alone)
    record["args"] = {"mok_fp8": False, "mok_cuda_forward": "megakernel"}
    assert ("(`scripts/bench_moe.py --mok-cuda-forward megakernel --mok-fp8-mega`)"
            in bench_fp8_gemm.render_layer(record))  # fmt: skip
    # The BF16 layer's path as the record names it (stage 1 where cuda_forward was "auto")
    record["cases"][0]["mok_backend"] = "cuda/stage1"
    assert "| 2.00 | stage1 | 1.00 |" in bench_fp8_gemm.render_layer(record)


def test_fp8_gemm_table_gives_each_rows_clock_and_the_dense_ceilings():
    """bench_fp8_gemm's GEMM table from a synthetic record: each row's SM clock where it was
    sampled ('-' for older records without ``gpu_during``), the --dense-ceiling rows beside the
    grouped ones with their speed over our BF16 op."""
    bench_fp8_gemm = _script("bench_fp8_gemm")

    def row(impl, ms, tflops, mhz=None):
        during = None if mhz is None else {"sm_mhz_median": mhz}
        return {"model": "deepseek-v3", "op": "l1", "impl": impl, "rows": 64, "groups": 2,
                "median_ms": ms, "p10_ms": ms, "p90_ms": ms, "tflops": tflops,
                "gpu_during": during}  # fmt: skip

    rows = [row("bf16_mok", 2.0, 500.0), row("fp8_mok", 1.0, 1000.0, 1395.0),
            row("dense_fp8_torch", 0.8, 1250.0, 1410.0)]  # fmt: skip
    del rows[0]["gpu_during"]  # a record from before the clock was sampled
    record = {
        "gpu": "G",
        "torch": "t",
        "commit": "abcdef0123",
        "config": {"ep": 1, "tokens": 8, "iters": 2, "routing": "uniform"},
        "rows": rows,
    }
    table = bench_fp8_gemm.render(record).splitlines()[4:]
    assert table == [
        "| deepseek-v3 | l1 | bf16_mok | 64 / 2 | 2.000 [2.000, 2.000] | 500 | 1.00x | - |",
        "| deepseek-v3 | l1 | fp8_mok | 64 / 2 | 1.000 [1.000, 1.000] | 1000 | 2.00x | 1395 |",
        "| deepseek-v3 | l1 | dense_fp8_torch | 64 / dense | 0.800 [0.800, 0.800] | 1250 | 2.50x "
        "| 1410 |",
    ]


def test_gpu_state_reads_nvidia_smi_and_falls_back_without_the_reasons_field(tmp_path, monkeypatch):
    """bench_moe's per-case GPU state: nvidia-smi's fields by name; a driver that refuses the
    clock-event field gives the other four; no nvidia-smi gives None."""
    bench_moe = _script("bench_moe")
    monkeypatch.setattr(bench_moe.torch.cuda, "current_device", lambda: 0)
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$*" in *clocks_event_reasons*) [ -n "$OLD_DRIVER" ] && exit 2;'
        ' echo "1755, 1980, 612.40, 57, 0x0000000000000004";; *) echo "1755, 1980, 612.40, 57";;'
        " esac\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    state = bench_moe._gpu_state()
    assert state == dict(zip(bench_moe.GPU_STATE_FIELDS,
                             ["1755", "1980", "612.40", "57", "0x0000000000000004"]))  # fmt: skip
    monkeypatch.setenv("OLD_DRIVER", "1")
    assert bench_moe._gpu_state() == dict(zip(bench_moe.GPU_STATE_FIELDS[:-1],
                                              ["1755", "1980", "612.40", "57"]))  # fmt: skip
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert bench_moe._gpu_state() is None


def test_stage1_backward_rows_render_the_fwd_bwd_pass_of_cases_that_have_them():
    """perf_report's backward-paths table (bench_moe.py --mok-stage1-backward): a row per
    forward + backward pass with 'mok_stage1_bwd' (synthetic record); forward passes and cases
    without the contender are skipped."""
    perf_report = _script("perf_report")
    mok = {"median_ms_all_ranks_max": 2.0, "p10_ms": 1.9, "p90_ms": 2.1, "fraction_of_floor": 0.5,
           "peak_mem_bytes": 2**30}  # fmt: skip
    stage1 = {**mok, "median_ms_all_ranks_max": 2.5, "p10_ms": 2.4, "p90_ms": 2.6,
              "fraction_of_floor": 0.4, "peak_mem_bytes": 2**31}  # fmt: skip
    both = {"mok": mok, "mok_stage1_bwd": stage1, "stage1_bwd_speedup": 1.25}
    case = {"shape": "s", "ep": 1, "tokens_per_rank": 64, "routing": "uniform",
            "mok_backend": "cuda/megakernel", "fwd": both, "fwd_bwd": both}  # fmt: skip
    record = {"cases": [case, {**case, "fwd_bwd": {"mok": mok}}]}
    rows = list(perf_report.stage1_rows([("r.json", record)], "mok_stage1_bwd",
                                        "stage1_bwd_speedup", ("fwd_bwd",)))  # fmt: skip
    assert rows == ["| s | 1 | 64 | uniform | fwd+bwd | cuda/megakernel | 2.000 (1.900-2.100) "
                    "| 2.500 (2.400-2.600) | **1.25x** | 0.50 | 0.40 | 1.00 | 2.00 |"]  # fmt: skip


def test_bench_back_to_back_runs_on_cpu_and_the_report_renders(tmp_path):
    """--back-to-back: the baseline and MoK get a back-to-back entry per pass beside their call by
    call ones (on CPU the same way of timing, testing.timing.time_back_to_back) and perf_report
    renders them in the back-to-back table."""
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, *BENCH, "--back-to-back", "2", "--routing", "uniform",
                    "--out", str(out)], check=True, env=_env(), cwd=ROOT, timeout=600)  # fmt: skip
    record = json.loads(out.read_text())
    (case,) = record["cases"]
    for label in ("fwd", "fwd_bwd"):
        r = case[label]
        for who in ("baseline_back_to_back", "mok_back_to_back"):
            assert r[who]["median_ms"] > 0 and r[who]["samples"] == 2
        assert r["back_to_back_speedup"] == pytest.approx(
            r["baseline_back_to_back"]["median_ms_all_ranks_max"]
            / r["mok_back_to_back"]["median_ms_all_ranks_max"]
        )
    perf_report = _script("perf_report")
    rows = list(perf_report.back_to_back_rows([(str(out), record)]))
    assert [row.split(" | ")[4] for row in rows] == ["fwd", "fwd+bwd"]
    assert rows[0].startswith("| tiny | 1 | 64 | uniform | fwd | reference | ")
    plain = {**record, "cases": [{**case, "fwd": {k: v for k, v in case["fwd"].items()
                                                  if "back_to_back" not in k}}]}  # fmt: skip
    assert [row.split(" | ")[4] for row in perf_report.back_to_back_rows([("p", plain)])] == [
        "fwd+bwd"
    ]


def test_compare_rows_add_the_graph_replayed_forward_where_both_records_have_it(tmp_path):
    """perf_report --compare: a "fwd (graph)" row, MoK's forward replayed from a CUDA graph before
    and after, where both records' forward has one (bench_moe.py --mok-graph)."""
    perf_report = _script("perf_report")

    def timing(ms):
        return {"median_ms_all_ranks_max": ms, "p10_ms": ms, "p90_ms": ms, "peak_mem_bytes": 0}

    def record(graph_ms):
        fwd = {"mok": timing(2.0), "baseline": timing(3.0)}
        if graph_ms is not None:
            fwd["mok_graph"] = timing(graph_ms)
        return {"cases": [{"shape": "s", "ep": 1, "tokens_per_rank": 64, "routing": "uniform",
                           "mok_backend": "cuda/megakernel", "fwd": fwd}]}  # fmt: skip

    paths = {}
    for name, graph_ms in (("a", 1.0), ("b", 1.5), ("c", None)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(record(graph_ms)))
    rows = list(perf_report.compare_rows(paths["a"], paths["b"]))
    assert [row.split(" | ")[4] for row in rows] == ["fwd", "fwd (graph)"]
    assert "| fwd (graph) | 1.000 (1.000-1.000) | 1.500 (1.500-1.500) |" in rows[1]
    rows = list(perf_report.compare_rows(paths["a"], paths["c"]))
    assert [row.split(" | ")[4] for row in rows] == ["fwd"]


def test_time_back_to_back_needs_a_call_per_sample():
    from mok_megatron.testing.timing import time_back_to_back

    with pytest.raises(ValueError, match="calls=0 must be >= 1"):
        time_back_to_back(lambda i: None, warmup=0, iters=1, calls=0, device="cpu")
    seen = []
    timing = time_back_to_back(seen.append, warmup=1, iters=3, calls=2, device="cpu")
    assert timing.samples == 3 and seen == [0, 1, 2, 3]  # CPU: time_fn's one call per sample


def test_ncu_table_renders_a_row_per_record(tmp_path):
    """perf_report --ncu: one row per scripts/ncu_megakernel.py record (synthetic), its
    throughputs as ncu wrote them, a metric the record lacks shown as n/a."""
    perf_report = _script("perf_report")
    metrics = [{"section": "GPU Speed Of Light Throughput", "name": name, "unit": "", "value": v}
               for name, v in (("SM Frequency", "1.43"), ("Duration", "10.67"),
                               ("Compute (SM) Throughput", "77.77"),
                               ("L2 Cache Throughput", "96.70"),
                               ("DRAM Throughput", "63.10"))]  # fmt: skip
    path = tmp_path / "ncu_x.json"
    path.write_text(json.dumps({
        "environment": {"commit": "abc", "gpu": "NVIDIA H200"},
        "args": {"shape": "deepseek-v3", "tokens": 8192, "routing": "uniform", "backward": True},
        "metrics": metrics + [{"section": "SpeedOfLight", "name": "", "unit": "", "value": ""}],
    }))  # fmt: skip
    head, row = perf_report.ncu_table([str(path)])
    assert "| SM GHz | ms | SM % | L2 % | DRAM % | L2 hit % |" in head
    assert row == ("| `ncu_x.json` | `abc` | NVIDIA H200 | deepseek-v3 | 8192 | uniform | backward "
                   "| 1.43 | 10.67 | 77.77 | 96.70 | 63.10 | n/a |")  # fmt: skip


def test_trace_tables_name_fp8_records_and_timing_experiments():
    """An FP8 timeline gets its own heading, and a timing experiment's record (commit
    <sha>-exp-<name>) names the patch it was built from, so its times are not read as a
    commit's."""
    perf_report = _script("perf_report")

    results = os.path.join(ROOT, "docs", "results")
    head = "\n".join(
        perf_report.trace_tables(os.path.join(results, "megakernel_trace_h200_f4b7c9a_fp8.json"))
    )
    assert "## The FP8 megakernel's forward, from its timeline (`f4b7c9a`)" in head
    assert "FP8 experts" in head and "timing experiment" not in head
    name = "megakernel_trace_h200_f4b7c9a_fp8_exp_nopromotion"
    exp = "\n".join(perf_report.trace_tables(os.path.join(results, name + ".json")))
    assert "(`f4b7c9a-exp-nopromotion`)" in exp
    assert f"`{name}.patch`" in exp and os.path.exists(os.path.join(results, name + ".patch"))
    bf16 = "\n".join(
        perf_report.trace_tables(os.path.join(results, "megakernel_trace_h200_53dea2a.json"))
    )
    assert "FP8" not in bf16 and "## The megakernel's forward, from its timeline" in bf16


def test_trace_gaps_split_by_the_next_task_and_count_tickets_taken_late():
    """megakernel_trace's gaps: per CTA, from a task's epilogue end to the next task's start,
    filed under the next task's GEMM, and counted as taken late where the producer took that
    ticket after the epilogue ended."""
    megakernel_trace = _script("megakernel_trace")

    def task(cta, l2, take, got, epi_end):
        return {"cta": cta, "l2": l2, "take": take, "ready": got, "got": got,
                "mma_end": epi_end - 1, "epi_end": epi_end}  # fmt: skip

    tasks = [task(0, False, 0, 1, 12), task(0, True, 13, 15, 22), task(0, False, 20, 25, 31),
             task(0, True, 26, 34, 40), task(1, True, 0, 2, 9)]  # fmt: skip
    gaps = megakernel_trace.gap_stats(tasks)
    assert gaps["l2"] == {"gaps": 2, "sum_ns": 3 + 3, "median_ns": 3, "p90_ns": 3,
                          "taken_late": 1}  # fmt: skip
    assert gaps["l1"] == {"gaps": 1, "sum_ns": 3, "median_ns": 3, "p90_ns": 3, "taken_late": 0}


def test_trace_decodes_down_weight_gradient_tasks_apart():
    """megakernel_trace: a task id with bit 41 set (the backward's down-weight gradient task,
    layout/mega.cuh) decodes as 'wgrad' with l2 None and its expert as the tile; its gaps and
    epilogue times are filed apart from the data gradients'; ids without it as before."""
    megakernel_trace = _script("megakernel_trace")
    from mok_megatron.ops.moe import MEGA_TRACE_CTA_FIELDS, MEGA_TRACE_TASK_FIELDS

    def record(cta, task_id, take, got, mma_end, epi_end, stored=0):
        words = {"cta": cta + 1, "task": task_id, "take": take, "ready": got, "got": got,
                 "mma_end": mma_end, "epi_end": epi_end, "stored": stored}  # fmt: skip
        return [words.get(k, 0) if k else 0 for k in MEGA_TRACE_TASK_FIELDS]

    tasks = torch.tensor([[record(0, (1 << 40) | (3 << 20) | 2, 0, 1, 8, 10),
                           record(0, (1 << 41) | (5 << 20) | 7, 9, 12, 20, 26),
                           record(1, 4, 0, 2, 9, 11, stored=10)]])  # fmt: skip
    ctas = torch.tensor([[0, 0, 0, 30, 0, 0], [0, 0, 0, 30, 0, 0]])
    assert len(MEGA_TRACE_CTA_FIELDS) == ctas.shape[1]
    _, decoded = megakernel_trace.decode(ctas, tasks)
    l2, wgrad, l1 = decoded
    assert (l2["l2"], l2["wgrad"], l2["tile"], l2["n"]) == (True, False, 3, 2)
    assert (wgrad["l2"], wgrad["wgrad"], wgrad["tile"], wgrad["n"]) == (None, True, 5, 7)
    assert (l1["l2"], l1["wgrad"]) == (False, False)
    assert megakernel_trace.gap_stats(decoded)["wgrad"]["sum_ns"] == 12 - 10
    summary = megakernel_trace.summarise(megakernel_trace.decode(ctas, tasks)[0], decoded, 64, 64)
    assert summary["tasks"] == {"l1": 1, "l2": 1, "wgrad": 1}
    assert summary["epilogue_median_ns"] == {"l1": 2, "l2": 2, "wgrad": 6}
    # the L1 epilogue split at its consumers' barrier (kTraceStored): 9 -> 10 -> 11
    assert summary["l1_epilogue_split_ns"] == {"stores": 1, "release": 1}
    tasks[0, 2, MEGA_TRACE_TASK_FIELDS.index("stored")] = 0  # a record without the stamp
    cta_records, decoded = megakernel_trace.decode(ctas, tasks)
    summary = megakernel_trace.summarise(cta_records, decoded, 64, 64)
    assert summary["l1_epilogue_split_ns"] is None
    assert summary["sm_ghz"] is None  # no cycle stamps in these records


def test_trace_sm_clock_is_the_median_of_each_ctas_cycles_over_its_nanoseconds():
    """megakernel_trace.sm_clock_ghz: cycles / ns per CTA (kTraceStartCycles / kTraceEndCycles),
    the median over CTAs; a CTA without the stamps is left out."""
    megakernel_trace = _script("megakernel_trace")
    ctas = [{"start": 100, "end": 1100, "start_cycles": 5000, "end_cycles": 6500},  # 1.5 GHz
            {"start": 200, "end": 2200, "start_cycles": 10, "end_cycles": 3610},  # 1.8 GHz
            {"start": 0, "end": 1000, "start_cycles": 1, "end_cycles": 1701},  # 1.7 GHz
            {"start": 0, "end": 1000, "start_cycles": 0, "end_cycles": 0}]  # fmt: skip
    assert megakernel_trace.sm_clock_ghz(ctas) == pytest.approx(1.7)
    assert megakernel_trace.sm_clock_ghz(ctas[3:]) is None


def test_trace_table_has_a_gap_column_only_where_the_record_has_gaps():
    perf_report = _script("perf_report")

    results = os.path.join(ROOT, "docs", "results")
    with_gaps = list(
        perf_report.trace_tables(os.path.join(results, "megakernel_trace_h200_788a417_fp8.json"))
    )
    head = next(line for line in with_gaps if line.startswith("| shape"))
    assert head.endswith("| L1 / L2 gap before (us) |")
    row = next(line for line in with_gaps if line.startswith("| deepseek-v3"))
    assert row.endswith("| 1.8 / 1.8 |")
    without = list(
        perf_report.trace_tables(os.path.join(results, "megakernel_trace_h200_53dea2a.json"))
    )
    assert not any("gap before" in line for line in without)
    assert not any("epilogue split" in line for line in with_gaps + without)


def test_trace_table_splits_the_l1_epilogue_where_the_record_has_the_stamp():
    """A record with megakernel_trace's l1_epilogue_split_ns (kTraceStored) gets a column of its
    two medians in us (the backward's first GEMM named as such); a missing L2 k-tile median
    (no task qualified) prints '-'."""
    perf_report = _script("perf_report")
    results = os.path.join(ROOT, "docs", "results")
    fwd = list(perf_report.trace_tables(
        os.path.join(results, "megakernel_trace_h100_16d8959_split_keep.json")))  # fmt: skip
    head = next(line for line in fwd if line.startswith("| shape"))
    assert head.endswith("| L1 epilogue split: stores / release (us) |")
    record = json.load(open(os.path.join(results, "megakernel_trace_h100_16d8959_split_keep.json")))
    case = record["cases"][0]
    parts = case["l1_epilogue_split_ns"]
    row = next(line for line in fwd if line.startswith(f"| {case['shape']}"))
    assert row.endswith(f"| {parts['stores'] / 1e3:.1f} / {parts['release'] / 1e3:.1f} |")
    bwd = list(perf_report.trace_tables(
        os.path.join(results, "megakernel_trace_bwd_h100_16d8959_split.json")))  # fmt: skip
    assert any(line.endswith("| L2-dgrad epilogue split: stores / release (us) |") for line in bwd)
    assert perf_report._ns(None) == "-" and perf_report._ns(652.6) == "653"
    assert not any("SM GHz" in line for line in fwd + bwd)  # recorded before the cycle stamps


def test_trace_table_has_the_sm_clock_where_the_record_has_it(tmp_path):
    """A record whose cases carry megakernel_trace's sm_ghz gets an 'SM GHz' column ('-' for a
    case without it)."""
    perf_report = _script("perf_report")
    src = os.path.join(ROOT, "docs", "results", "megakernel_trace_h100_16d8959_split_keep.json")
    record = json.load(open(src))
    record["cases"][0]["sm_ghz"] = 1.7349
    path = tmp_path / "megakernel_trace_clock.json"
    path.write_text(json.dumps(record))
    lines = list(perf_report.trace_tables(str(path)))
    assert next(line for line in lines if line.startswith("| shape")).endswith(" SM GHz |")
    rows = {line.split(" | ")[0][2:]: line for line in lines if line.startswith("| ")}
    first, second = (rows[case["shape"]] for case in record["cases"][:2])
    assert first.endswith("| 1.73 |") and second.endswith("| - |")


def _curves(seed, fp8_shift, noise_shift, steps=40):
    """Three made-up loss curves: BF16, FP8 and the noise floor off it by the given amounts from
    step 25 on (before it, equal)."""
    rng = random.Random(seed)
    bf16 = [4.0 - 0.05 * s + rng.uniform(0, 0.01) for s in range(steps)]
    return (
        bf16,
        [x + (fp8_shift if s >= 25 else 0.0) for s, x in enumerate(bf16)],
        [x + (noise_shift if s >= 25 else 0.0) for s, x in enumerate(bf16)],
    )


def test_fp8_training_band_is_fp8s_gap_against_the_noise_floors_on_every_unseen_seed():
    ft = _script("fp8_training_run")
    assert ft.BAND_FROM_STEP < 25 and ft.BAND_NOISE_FACTOR == 2.0
    judged = {}
    for seed, fp8_shift in zip(ft.BAND_SEEDS, (0.01, -0.019, 0.015)):
        judged[seed] = ft.judge(seed, *_curves(seed, fp8_shift, noise_shift=0.01))
    assert [round(j["ratio"], 6) for j in judged.values()] == [1.0, 1.9, 1.5]
    assert all(j["within"] and j["judges_band"] for j in judged.values())
    assert ft.band_verdict(list(judged.values())) is True
    assert ft.band_verdict(list(judged.values())[:2]) is None  # a seed not run: no verdict
    # One seed past 2x the noise floor: the band does not hold.
    over = ft.judge(ft.BAND_SEEDS[1], *_curves(1, 0.021, noise_shift=0.01))
    assert not over["within"]
    assert ft.band_verdict([judged[ft.BAND_SEEDS[0]], over, judged[ft.BAND_SEEDS[2]]]) is False
    # A seed seen before the band was stated is reported, never a judge.
    seen = ft.judge(1234, *_curves(5, 0.001, noise_shift=0.01))
    assert seen["within"] and not seen["judges_band"]
    assert ft.band_verdict([seen]) is None
    # The gap counts only from BAND_FROM_STEP on; the first (2% relative) band is kept beside.
    bf16, fp8, noise = _curves(6, 0.0, noise_shift=0.01)
    fp8[ft.BAND_FROM_STEP - 1] += 1.0
    early = ft.judge(1235, bf16, fp8, noise)
    assert early["fp8_largest_gap"] == 0.0 and early["relative_2pct"]["within"]
    with pytest.raises(ValueError, match="noise-floor run repeated the BF16 run"):
        ft.judge(1235, bf16, fp8, list(bf16))
    with pytest.raises(ValueError, match="needs more than"):
        ft.judge(1235, bf16[:10], fp8[:10], noise[:10])


def test_fp8_training_table_renders_old_and_new_records(tmp_path):
    ft = _script("fp8_training_run")
    head = {"gpu": "G", "torch": "t", "config": {"file": "configs/tiny_gpu_ep1_fp8.yaml",
                                                 "steps": 40}}  # fmt: skip
    bf16, fp8, noise = _curves(7, 0.005, noise_shift=0.01)
    old = {**head, "commit": "a" * 40, "losses_bf16": bf16, "losses_fp8": fp8,
           "losses_bf16_other_gemm": noise, "other_gemm": "torch"}  # fmt: skip
    runs = []
    for seed in ft.BAND_SEEDS:
        b, f, n = _curves(seed, 0.03, noise_shift=0.01)  # 3x: outside the band
        runs.append({"losses_bf16": b, "losses_fp8": f, "losses_bf16_other_gemm": n,
                     "other_gemm": "torch", **ft.judge(seed, b, f, n)})  # fmt: skip
    new = {**head, "commit": "b" * 40, "runs": runs}
    paths = []
    for name, rec in (("old.json", old), ("new.json", new)):
        paths.append(str(tmp_path / name))
        with open(paths[-1], "w") as f:
            json.dump(rec, f)
    md = tmp_path / "FP8.md"
    md.write_text(f"before\n{ft.TABLE_BEGIN}\nstale\n{ft.TABLE_END}\nafter\n")
    ft.render(argparse.Namespace(render=paths, png=str(tmp_path / "c.png"), md=str(md)))
    text = md.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "stale" not in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == 4
    assert rows[0].startswith("| `aaaaaaa` | 1234 |") and "no (seen before)" in rows[0]
    assert all("| 3.00 | no | yes |" in row for row in rows[1:])
    assert "**not held**" in text
    assert (tmp_path / "c.png").stat().st_size > 0


def test_target_rows_judge_the_unrounded_fraction():
    """perf_report's standing against issues 13 and 14: a fraction that shows as the target at
    two decimals but is below it is missed; the replayed forward is judged on its own; shapes
    without a target, skewed routings and EP > 1 give no row."""
    report = _script("perf_report")

    def case(shape, fwd, fwd_bwd, graph=None, routing="uniform", ep=1):
        fwd_r = {"mok": {"fraction_of_floor": fwd}}
        if graph is not None:
            fwd_r["mok_graph"] = {"fraction_of_floor": graph}
        return {"shape": shape, "ep": ep, "tokens_per_rank": 8192, "routing": routing,
                "fwd": fwd_r, "fwd_bwd": {"mok": {"fraction_of_floor": fwd_bwd}}}  # fmt: skip

    record = {"cases": [case("mixtral-8x7b", 0.7496, 0.65, graph=0.76),
                        case("qwen3-30b-a3b", 0.61, 0.2, routing="skewed"),
                        case("deepseek-v3", 0.1, 0.1, ep=2), case("tiny", 1.0, 1.0)]}  # fmt: skip
    rows = list(report.target_rows([("x/rec.json", record)]))
    assert len(rows) == 2
    assert (
        "| 13 | mixtral-8x7b | 8192 | fwd | 0.75 | 0.750 | missed (99.9% of it) | 0.760 | met |"
        in rows[0]
    )
    assert (
        "| 14 | mixtral-8x7b | 8192 | fwd+bwd | 0.65 | 0.650 | met | - | - | - | `rec.json` |"
        in rows[1]
    )


def test_target_rows_give_forward_and_backward_the_protocols_bound(tmp_path):
    """With a wgrad_traffic record, each forward + backward row names the bound of its record's
    mode ('.grad', or main_grad's with the weight gradients in the launch) and says where the
    target lies above it; forward rows and cases the model lacks show '-'."""
    report = _script("perf_report")
    model = {"cases": [{"shape": "deepseek-v3", "tokens_per_rank": 8192, "grad_bound": 0.5812,
                        "main_grad_bound": 0.62, "main_grad_fused_bound": 0.78},
                       {"shape": "mixtral-8x7b", "tokens_per_rank": 8192, "grad_bound": 0.92,
                        "main_grad_bound": 1.0}]}  # fmt: skip
    path = tmp_path / "wgrad.json"
    path.write_text(json.dumps(model))
    bounds = report.target_bounds(str(path))
    assert bounds[("deepseek-v3", 8192, True)] == 0.78 and bounds[("mixtral-8x7b", 8192, True)] == 1

    def case(shape, tokens):
        r = {"mok": {"fraction_of_floor": 0.4}}
        return {"shape": shape, "ep": 1, "tokens_per_rank": tokens, "routing": "uniform",
                "fwd": r, "fwd_bwd": r}  # fmt: skip

    cases = [case("deepseek-v3", 8192), case("mixtral-8x7b", 8192), case("qwen3-30b-a3b", 16384)]
    rows = list(report.target_rows([("r.json", {"cases": cases})], bounds))
    assert len(rows) == 6
    assert "| fwd | 0.75 | 0.400 | missed (53.3% of it) | - | - | - | `r.json` |" in rows[0]
    assert (
        "| fwd+bwd | 0.65 | 0.400 | missed (61.5% of it) | - | - | 0.58 (target above it) |"
        in rows[1]
    )
    assert "| fwd+bwd | 0.65 | 0.400 | missed (61.5% of it) | - | - | 0.92 | `r.json` |" in rows[3]
    assert rows[5].endswith("| - | - | - | `r.json` |"), "no bound for a case the model lacks"
    main_grad = {"args": {"main_grad": True}, "cases": cases[:1]}
    rows = list(report.target_rows([("m.json", main_grad)], bounds))
    assert "| 0.78 | `m.json` |" in rows[1]


def test_target_rows_take_each_case_from_the_newest_record_that_has_it():
    """Records newest first: a case (shape, tokens, pass) comes from the first record with it,
    named in the row; an older record fills only the cases the newer ones lack."""
    report = _script("perf_report")

    def case(shape, tokens, fwd, fwd_bwd=None):
        c = {"shape": shape, "ep": 1, "tokens_per_rank": tokens, "routing": "uniform",
             "fwd": {"mok": {"fraction_of_floor": fwd}}}  # fmt: skip
        if fwd_bwd is not None:
            c["fwd_bwd"] = {"mok": {"fraction_of_floor": fwd_bwd}}
        return c

    new = {"cases": [case("qwen3-30b-a3b", 8192, 0.61)]}
    old = {"cases": [case("qwen3-30b-a3b", 8192, 0.40, 0.30), case("mixtral-8x7b", 8192, 0.7, 0.6),
                     case("mixtral-8x7b", 4096, 0.9, 0.9)]}  # fmt: skip
    rows = list(report.target_rows([("r/new.json", new), ("r/old.json", old)]))
    assert len(rows) == 4
    assert "| 13 | qwen3-30b-a3b | 8192 | fwd | 0.60 | 0.610 | met |" in rows[0]
    assert rows[0].endswith("`new.json` |")
    assert "| 14 | qwen3-30b-a3b | 8192 | fwd+bwd | 0.55 | 0.300 |" in rows[1]
    assert rows[1].endswith("`old.json` |")
    assert not any("| 0.400 |" in row for row in rows), "the older record's forward was used"
    assert all(row.endswith("`old.json` |") for row in rows[2:])
    assert not any("| 4096 |" in row for row in rows), "the targets are set at 8192 and 16384"


def test_fill_markdown_table_replaces_between_its_markers_and_names_missing_ones(tmp_path):
    """The one helper the record scripts write their tables with (bench_fp8_gemm,
    fp8_accuracy, fp8_training_run, fp8_wgrad_study)."""
    from mok_megatron.testing.records import fill_markdown_table

    md = tmp_path / "page.md"
    md.write_text("a\n<!-- t begin -->\nold\n<!-- t end -->\nb\n")
    fill_markdown_table(str(md), "| new |", "<!-- t begin -->", "<!-- t end -->")
    assert md.read_text() == "a\n<!-- t begin -->\n| new |\n<!-- t end -->\nb\n"
    with pytest.raises(SystemExit, match="no '<!-- u begin -->' ... '<!-- u end -->' markers"):
        fill_markdown_table(str(md), "x", "<!-- u begin -->", "<!-- u end -->")


def test_rounds_rows_render_each_contender_and_targets_read_h200_records_only(tmp_path):
    """perf_report's rounds table (bench_moe --mok-macrobatch): per case with 'mok_rounds', each
    contender's forward + backward time and peak memory, the mode and the ratio, and '-' for a
    contender the record lacks; the targets table takes no case from a record of another GPU."""
    perf_report = _script("perf_report")

    def timing(ms, gib):
        return {"median_ms_all_ranks_max": ms, "p10_ms": ms - 0.1, "p90_ms": ms + 0.1,
                "fraction_of_floor": 0.5, "peak_mem_bytes": gib * 2**30}  # fmt: skip

    fwd_bwd = {"baseline": timing(9.0, 3), "mok": timing(6.0, 2), "mok_rounds": timing(7.0, 1),
               "rounds_bwd_speedup": 1.25}  # fmt: skip
    case = {"shape": "s", "ep": 1, "tokens_per_rank": 8192, "routing": "uniform",
            "mok_backend": "cuda/megakernel", "fwd": {"mok": timing(2.0, 1)},
            "fwd_bwd": fwd_bwd}  # fmt: skip
    env = {"gpu": "NVIDIA H100 80GB HBM3", "commit": "abc1234"}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"environment": env, "args": {"mok_macrobatch": 4096,
                                                             "main_grad": True},
                                "cases": [case, {**case, "fwd_bwd": {}}]}))  # fmt: skip
    (row,) = perf_report.rounds_rows([str(path)])
    assert row == ("| `r.json` | NVIDIA H100 80GB HBM3 | `abc1234` | s | 8192 | 4096 | main_grad "
                   "| 9.000 (8.900-9.100), 3.00 | 6.000 (5.900-6.100), 2.00 "
                   "| 7.000 (6.900-7.100), 1.00 | - | 1.25x |")  # fmt: skip
    record = {"environment": env, "cases": [{**case, "shape": "qwen3-30b-a3b"}]}
    assert list(perf_report.target_rows([("r.json", record)])) == []
    record["environment"] = {**env, "gpu": "NVIDIA H200"}
    assert len(list(perf_report.target_rows([("r.json", record)]))) == 2  # fwd and fwd+bwd


def _timing(ms, gib):
    """A bench_moe.py contender entry: ms median (+-0.1 spread), peak GiB."""
    return {"median_ms_all_ranks_max": ms, "p10_ms": ms - 0.1, "p90_ms": ms + 0.1,
            "fraction_of_floor": 0.5, "peak_mem_bytes": gib * 2**30}  # fmt: skip


def _fwd_bwd_record(path, fwd_bwd: dict) -> str:
    """A one-GPU .grad-mode bench_moe.py record of two cases: one whose forward + backward timed
    ``fwd_bwd`` (with the baseline and mok added) and one that timed MoK only."""
    fwd_bwd = {"baseline": _timing(9.0, 3), "mok": _timing(6.0, 2), **fwd_bwd}
    case = {"shape": "s", "ep": 1, "tokens_per_rank": 8192, "routing": "uniform",
            "mok_backend": "cuda/megakernel", "fwd": {"mok": _timing(2.0, 1)},
            "fwd_bwd": fwd_bwd}  # fmt: skip
    env = {"gpu": "NVIDIA H100 80GB HBM3", "commit": "abc1234"}
    path.write_text(json.dumps({"environment": env, "args": {"main_grad": False},
                                "cases": [case, {**case, "fwd_bwd": {"mok": _timing(6.0, 2)}}]}))  # fmt: skip
    return str(path)


def test_bwd_wgrad_rows_render_each_case_that_timed_it(tmp_path):
    """perf_report's table of the down weight's gradient in the backward launch (bench_moe
    --mok-bwd-wgrad): per case with 'mok_bwd_wgrad', the three contenders' forward + backward time
    and peak memory, the mode and the ratio ('-' for the interleaved contender the record lacks);
    a case without it gives no row."""
    perf_report = _script("perf_report")
    path = _fwd_bwd_record(tmp_path / "w.json",
                           {"mok_bwd_wgrad": _timing(5.0, 2.5), "bwd_wgrad_speedup": 1.2})  # fmt: skip
    (row,) = perf_report.bwd_wgrad_rows([path])
    assert row == ("| `w.json` | NVIDIA H100 80GB HBM3 | `abc1234` | s | 8192 | .grad "
                   "| 9.000 (8.900-9.100), 3.00 | 6.000 (5.900-6.100), 2.00 "
                   "| 5.000 (4.900-5.100), 2.50 | - | **1.20x** | - |")  # fmt: skip


def test_wgrad_schedule_rows_render_each_case_that_timed_it(tmp_path):
    """perf_report's table of the clustered weight gradients (bench_moe --mok-wgrad-cluster2):
    per case with 'mok_wgrad_cluster2', the baseline, the default, the engine's cooperative
    weight gradients ('-' where the record lacks them) and the clustered ones, with the ratio; a
    case without it gives no row."""
    perf_report = _script("perf_report")
    path = _fwd_bwd_record(tmp_path / "c.json",
                           {"mok_wgrad_cluster2": _timing(6.6, 2),
                            "wgrad_cluster2_speedup": 0.91})  # fmt: skip
    (row,) = perf_report.wgrad_schedule_rows([path])
    assert row == ("| `c.json` | NVIDIA H100 80GB HBM3 | `abc1234` | s | 8192 | .grad "
                   "| 9.000 (8.900-9.100), 3.00 | 6.000 (5.900-6.100), 2.00 | - "
                   "| 6.600 (6.500-6.700), 2.00 | **0.91x** |")  # fmt: skip


def test_bench_bwd_wgrad_needs_the_megakernel_forward():
    """--mok-bwd-wgrad without --mok-cuda-forward megakernel stops with the rule, before any
    layer is built (MoKConfig refuses bwd_wgrad='down' after stage 1's forward)."""
    done = subprocess.run([sys.executable, *BENCH, "--mok-bwd-wgrad", "--out", "/dev/null"],
                          env=_env(), cwd=ROOT, timeout=300, capture_output=True, text=True)  # fmt: skip
    assert done.returncode != 0
    assert "--mok-bwd-wgrad" in done.stderr and "--mok-cuda-forward megakernel" in done.stderr


def test_wgrad_traffic_bounds_order_and_the_fused_formula():
    """scripts/wgrad_traffic.py: with main_grad, the weight gradients inside the backward launch
    (their traffic beside the whole backward's FLOPs) bound a forward + backward at least as high
    as separate GEMMs at the HBM ceiling, which bound it at least as high as in serial; none
    passes 1; the fused bound is floor / (floor / 3 + max(2 floor / 3, traffic))."""
    wgrad_traffic = _script("wgrad_traffic")
    for shape in ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"):
        c = wgrad_traffic.case(shape, 8192)
        assert c["main_grad_serial_bound"] <= c["main_grad_bound"] <= c["main_grad_fused_bound"]
        assert c["main_grad_fused_bound"] <= 1.0
        floor, traffic = c["floor_ms"], c["main_grad_ms"]
        want = floor / (floor / 3 + max(2 * floor / 3, traffic))
        assert abs(c["main_grad_fused_bound"] - want) < 1e-12
    deepseek = wgrad_traffic.case("deepseek-v3", 8192)
    assert deepseek["main_grad_bound"] < 0.65 < deepseek["main_grad_fused_bound"]


def test_ncu_gemm_record_from_recorded_pages(tmp_path, monkeypatch, capsys):
    """ncu_megakernel.write_gemm_record (the ncu GEMM scripts' record): from a profile's recorded
    details and source pages (an H100's, session 38), the record holds the details' metrics,
    the stall reasons summed over the source page (shares adding up to 1, largest first) and the
    hot instructions; the chosen sections' metrics are printed."""
    import gzip
    import types

    import torch

    nm = _script("ncu_megakernel")
    base = os.path.join(ROOT, "docs", "results", "ncu_wgrad_gemm_h100_6971ba6_qwen3_wgrad_l1_acc")
    with gzip.open(base + "_details.csv.gz", "rt") as f:
        page = f.read()
    with gzip.open(base + "_source.csv.gz", "rt") as f:
        source = types.SimpleNamespace(stdout=f.read(), stderr="")
    monkeypatch.setattr(nm, "profile_pages", lambda ncu, cmd, rep: (page, source))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    out = tmp_path / "r.json"
    args = argparse.Namespace(out=str(out), top=5)
    nm.write_gemm_record("ncu_test", "echo", [], str(tmp_path / "r"), args,
                         ("GPU Speed Of Light Throughput",))  # fmt: skip
    record = json.loads(out.read_text())
    assert record["benchmark"] == "ncu_test" and record["gpu"] == "a GPU"
    names = {m["name"] for m in record["metrics"]}
    assert {"DRAM Throughput", "Duration"} <= names
    shares = [r["share"] for r in record["stall_reasons"]]
    assert abs(sum(shares) - 1) < 1e-9 and shares == sorted(shares, reverse=True)
    assert len(record["hot_instructions"]) == 5
    assert "DRAM Throughput" in capsys.readouterr().out


def test_cluster2_table_gives_the_schedules_ratio_and_torch_over_the_pairs(tmp_path):
    """grouped_gemm_report --cluster2: per weight-gradient op and rows a group, the cooperative
    schedule's time over the clustered one and torch's (its GEMM, + add for the fp32 ops) over
    the clustered one; ops without both schedules give no row."""
    report = _script("grouped_gemm_report")
    rows = []
    for op, impl, ms in (("wgrad_l1", "mok", 1.0), ("wgrad_l1", "mok_cluster2", 0.8),
                         ("wgrad_l1", "torch_gemm", 1.2), ("wgrad_l2_acc", "mok", 2.0),
                         ("wgrad_l2_acc", "mok_cluster2", 2.5), ("wgrad_l2_acc", "torch_gemm+add", 3.0),
                         ("wgrad_l2", "mok", 1.0)):  # fmt: skip
        rows.append({"model": "m", "rows": 4096, "groups": 2, "hidden": 4096, "intermediate": 2048,
                     "op": op, "impl": impl, "median_ms": ms, "p10_ms": ms, "p90_ms": ms})  # fmt: skip
    doc = {"gpu": "GPU", "torch": "t", "commit": "abcdef0123", "ep": 1, "timing": "median",
           "results": rows}  # fmt: skip
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(doc))
    body = [line for line in report.cluster2_table([str(path)]).splitlines()
            if line.startswith("| m |")]  # fmt: skip
    assert body == ["| m | 4096 | 2048 | wgrad_l1 | 1.000 (1.000-1.000) | 0.800 (0.800-0.800) "
                    "| 1.25x | 1.200 | 1.50x |",
                    "| m | 4096 | 2048 | wgrad_l2_acc | 2.000 (2.000-2.000) | 2.500 (2.500-2.500) "
                    "| 0.80x | 3.000 | 1.20x |"]  # fmt: skip


def test_store_table_gives_load_over_reduce_and_auto_over_torch_by_rows_a_group(tmp_path):
    report = _script("grouped_gemm_report")
    rows = []
    for impl, ms in (("mok", 2.0), ("mok_load", 2.5), ("mok_reduce", 2.0), ("torch_gemm+add", 3.0)):
        rows.append({"model": "m", "rows": 4096, "groups": 2, "hidden": 4096, "intermediate": 2048,
                     "op": "wgrad_l1_acc", "impl": impl, "median_ms": ms, "p10_ms": ms,
                     "p90_ms": ms})  # fmt: skip
    rows.append({"model": "m", "rows": 4096, "groups": 2, "hidden": 4096, "intermediate": 2048,
                 "op": "wgrad_l1", "impl": "mok", "median_ms": 1.0, "p10_ms": 1.0,
                 "p90_ms": 1.0})  # fmt: skip
    doc = {"gpu": "GPU", "torch": "t", "commit": "abcdef0123", "ep": 1, "timing": "median",
           "results": rows}  # fmt: skip
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(doc))
    md = tmp_path / "page.md"
    md.write_text(f"x\n{report.STORE_BEGIN}\nold\n{report.STORE_END}\ny\n")
    table = report.store_table([str(path)])
    body = [line for line in table.splitlines() if line.startswith("| m |")]
    # 8 B x 2 x 4096 x 4096 of the buffer + 2 B x 4096 rows x 8192 of operands = 335544320 B
    assert report.accumulate_bytes(rows[0]) == 335544320
    assert body == ["| m | 4096 | 2048 | wgrad_l1_acc | 2.500 (2.500-2.500) | 2.000 (2.000-2.000) "
                    "| 1.25x | 0.13, 0.17 | 2.000 | 3.000 | 1.50x |"]  # fmt: skip
    report.fill_markdown_table(str(md), table, report.STORE_BEGIN, report.STORE_END)
    assert "old" not in md.read_text() and body[0] in md.read_text()


def test_launch_gaps_split_passes_and_sum_spans_busy_and_gaps():
    """scripts/launch_gaps.py's arithmetic on a made-up kernel list: passes start at each
    routing_to_topk, the first and last are dropped, and a pass's gaps are the idle time between
    consecutive kernels (overlap counts as none)."""
    gaps = _script("launch_gaps")
    kernels = []
    for p in range(4):  # each pass: topk [0, 2], a [3, 10], b [9, 12] (overlaps a), c [15, 20]
        t = 100.0 * p
        kernels += [(t, t + 2, "routing_to_topk"), (t + 3, t + 10, "a"), (t + 9, t + 12, "b"),
                    (t + 15, t + 20, "c")]  # fmt: skip
    passes = gaps.passes(sorted(kernels))
    assert [len(p) for p in passes] == [4, 4, 4, 4]
    assert gaps.summarize(passes) == {"passes": 2, "kernels": 4, "span_us": 20.0,
                                      "busy_us": 17.0, "gaps_us": 4.0}  # fmt: skip


def test_forward_weight_stream_share(tmp_path):
    """scripts/wgrad_traffic.py's forward weight stream: each expert weight read once (2 bytes) at
    the HBM ceiling over the forward's FLOPs at the floor's rate; twice the tokens halve it, and
    deepseek-v3's 256 experts at 8192 tokens need the most of the HBM (about 0.7 of it), mixtral-
    8x7b's 8 the least. perf_report prints it as a table of its own, and none from a record
    written before the field existed."""
    from mok_megatron.testing.timing import H200_CEILINGS

    wgrad_traffic = _script("wgrad_traffic")
    shares = {}
    for shape in ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"):
        hidden, inter, experts, topk = _script("bench_moe").SHAPES[shape]
        c, c2 = wgrad_traffic.case(shape, 8192), wgrad_traffic.case(shape, 16384)
        weights_s = 3 * experts * hidden * inter * 2 / (H200_CEILINGS.hbm_tbps * 1e12)
        flops_s = 8192 * topk * 2 * hidden * 3 * inter / (H200_CEILINGS.bf16_tflops * 1e12)
        assert c["fwd_weight_read_ms"] == pytest.approx(weights_s * 1e3, rel=1e-12)
        assert c["fwd_flops_ms"] == pytest.approx(flops_s * 1e3, rel=1e-12)
        assert c2["fwd_weight_share"] == pytest.approx(c["fwd_weight_share"] / 2, rel=1e-12)
        shares[shape] = c["fwd_weight_share"]
    assert shares["mixtral-8x7b"] < shares["qwen3-30b-a3b"] < shares["deepseek-v3"]
    assert 0.6 < shares["deepseek-v3"] < 0.8
    perf_report = _script("perf_report")
    record = {"environment": {"commit": "abc"}, "ceilings": {"hbm_tbps": 4.28, "bf16_tflops": 782.0},
              "cases": [wgrad_traffic.case("deepseek-v3", 8192)]}  # fmt: skip
    path = str(tmp_path / "wgrad_traffic_abc.json")
    with open(path, "w") as f:
        json.dump(record, f)
    lines = list(perf_report.weight_stream_table(path))
    assert lines[0].startswith("## The forward's weight stream")
    assert any(line.startswith("| deepseek-v3 | 8192 | ") and line.endswith("| 0.71 |")
               for line in lines)  # fmt: skip
    del record["cases"][0]["fwd_weight_share"]
    with open(path, "w") as f:
        json.dump(record, f)
    assert list(perf_report.weight_stream_table(path)) == []


def test_tile_padding_costs_and_the_swapped_tail(tmp_path):
    """scripts/tile_padding.py: an expert's rows cost whole m-tiles of 128 and a last one of at most
    64 rows half (units); the swapped tail rounds the last partial m-tile's rows up to its step
    instead. The benchmark's routing gives deepseek-v3 at 8192 tokens the lowest tile efficiency,
    which every finer step raises; perf_report adds a column per step, and none from a record
    written before the field existed."""
    tile_padding = _script("tile_padding")
    rows = torch.tensor([0, 1, 64, 65, 128, 129, 200, 256])
    assert tile_padding.units(rows).tolist() == [0, 1, 1, 2, 2, 3, 4, 4]
    assert tile_padding.tail_rows(rows, 16).tolist() == [0, 16, 64, 80, 128, 144, 208, 256]
    assert tile_padding.tail_rows(rows, 8).tolist() == [0, 8, 64, 72, 128, 136, 200, 256]
    args = tile_padding.parse_args(["--out", str(tmp_path / "t.json")])
    deepseek = tile_padding.case("deepseek-v3", 8192, "uniform", args)
    mixtral = tile_padding.case("mixtral-8x7b", 8192, "uniform", args)
    tails = deepseek["tail_efficiency"]
    assert list(tails) == ["32", "16", "8"]
    assert deepseek["tile_efficiency"] < tails["32"] < tails["16"] < tails["8"] <= 1
    assert deepseek["tile_efficiency"] < mixtral["tile_efficiency"]
    perf_report = _script("perf_report")
    record = {"environment": {"commit": "abc"}, "args": {"rotate": 3}, "block_m": 128,
              "cases": [deepseek]}  # fmt: skip
    path = tmp_path / "tile_padding_abc.json"
    path.write_text(json.dumps(record))
    lines = list(perf_report.padding_table(str(path)))
    assert lines[2].endswith("| with a swapped tail, steps of 8 |")
    assert lines[4].startswith("| deepseek-v3 | 8192 | uniform |")
    assert lines[4].endswith(f"| {tails['16']:.3f} | {tails['8']:.3f} |")
    assert lines[2].count("|") - 1 == lines[4].count("|") - 1 == 11
    del deepseek["tail_efficiency"]
    path.write_text(json.dumps(record))
    assert list(perf_report.padding_table(str(path)))[2].endswith("| tile efficiency |")


def test_trace_ab_rows_put_each_build_against_the_first(tmp_path):
    """perf_report --trace-ab: records named megakernel_trace_<gpu>_<build>_<tag>_<round>[_fp8]
    group by GPU, call tag, shape, tokens and precision; each build's spans in file order, its
    median over the rounds against the first build's, its median k-tiles; a record named
    otherwise is refused by name."""
    perf_report = _script("perf_report")

    def record(name, span, precision="bf16"):
        case = {"shape": "s", "tokens_per_rank": 8192, "expert_precision": precision,
                "span_us": span, "mainloop": {"l1": {"median_ns_per_ktile": span / 10},
                                              "l2": {"median_ns_per_ktile": span / 20}}}  # fmt: skip
        path = tmp_path / name
        path.write_text(json.dumps({"cases": [case]}))
        return str(path)

    paths = [record("megakernel_trace_h100_abc_ab_1.json", 100.0),
             record("megakernel_trace_h100_abc_ab_2.json", 102.0),
             record("megakernel_trace_h100_abc-exp-x_ab_1.json", 90.0),
             record("megakernel_trace_h100_abc-exp-x_ab_2.json", 91.0),
             record("megakernel_trace_h100_abc-exp-x_ab_1_fp8.json", 50.0, "fp8_blockwise")]  # fmt: skip
    rows = list(perf_report.trace_ab_rows(paths))
    assert rows == [
        "| h100 | ab | s | 8192 | bf16 | `abc` | 100, 102 | 1.000 | 10 / 5 |",
        "| h100 | ab | s | 8192 | bf16 | `abc-exp-x` | 90, 91 | 0.896 | 9 / 5 |",
        "| h100 | ab | s | 8192 | fp8_blockwise | `abc-exp-x` | 50 | 1.000 | 5 / 2 |",
    ]
    with pytest.raises(SystemExit, match="not named as a trace A/B record"):
        list(perf_report.trace_ab_rows([record("megakernel_trace_h100_abc_block_auto.json", 1.0)]))


def test_tile_class_rows_take_medians_over_rounds_and_skip_records_without_classes(tmp_path):
    """perf_report --trace-ab's second table: records with megakernel_trace's tile_classes give
    one row per build, GEMM and class (tasks, share of the GEMM's tile rows, mainloop share,
    k-tile), medians over the rounds; records without them give none."""
    perf_report = _script("perf_report")

    def record(name, half_ns, classes=True):
        def gemm(ns):
            return {"full": {"tasks": 4, "rows": 512, "mainloop_share": 0.8,
                             "median_ns_per_ktile": 700.0},
                    "half": {"tasks": 2, "rows": 64, "mainloop_share": 0.2,
                             "median_ns_per_ktile": ns}}  # fmt: skip

        case = {"shape": "s", "tokens_per_rank": 8192, "expert_precision": "bf16",
                "tile_classes": {"l1": gemm(half_ns), "l2": gemm(None)} if classes else None}  # fmt: skip
        path = tmp_path / name
        path.write_text(json.dumps({"cases": [case]}))
        return str(path)

    paths = [record("megakernel_trace_h100_abc_tiles_1.json", 600.0),
             record("megakernel_trace_h100_abc_tiles_2.json", 640.0),
             record("megakernel_trace_h100_abc_ab_1.json", 1.0, classes=False)]  # fmt: skip
    rows = list(perf_report.tile_class_rows(paths))
    assert rows == [
        "| h100 | tiles | s | 8192 | bf16 | `abc` | l1 | full | 4 | 0.889 | 0.800 | 700 |",
        "| h100 | tiles | s | 8192 | bf16 | `abc` | l1 | half | 2 | 0.111 | 0.200 | 620 |",
        "| h100 | tiles | s | 8192 | bf16 | `abc` | l2 | full | 4 | 0.889 | 0.800 | 700 |",
        "| h100 | tiles | s | 8192 | bf16 | `abc` | l2 | half | 2 | 0.111 | 0.200 | - |",
    ]


def test_trace_tile_classes_split_tasks_by_their_m_tiles_rows():
    """megakernel_trace: each task's rows come from the plan's tiles by (round, tile), and the
    tile classes split each GEMM's tasks into full (128 rows), over half (65-127) and half (at
    most 64): counts, rows, mainloop time from ready (or got, if later) and its share, and the
    median per k-tile of the tasks whose inputs were ready when taken; no tiles, no classes."""
    megakernel_trace = _script("megakernel_trace")

    def task(rnd, tile, l2, got, ready, mma_end):
        return {"round": rnd, "tile": tile, "l2": l2, "wgrad": False, "cta": 0, "take": 0,
                "got": got, "ready": ready, "mma_end": mma_end, "epi_end": mma_end + 1}  # fmt: skip

    # two rounds of three m-tiles each: (expert, row_begin, row_end, reserved)
    tiles = torch.tensor([[[0, 0, 128, 0], [0, 128, 228, 0], [1, 232, 272, 0]],
                          [[0, 0, 128, 0], [1, 128, 192, 0], [2, 192, 200, 0]]],
                         dtype=torch.int32)  # fmt: skip
    tasks = [task(0, 0, False, 0, 0, 40), task(0, 1, False, 0, 0, 36), task(0, 2, False, 0, 5, 25),
             task(1, 1, False, 10, 0, 30), task(1, 2, True, 0, 0, 8), task(1, 0, True, 0, 0, 16)]  # fmt: skip
    megakernel_trace.annotate_rows(tasks, tiles)
    assert [t["rows"] for t in tasks] == [128, 100, 40, 64, 8, 128]
    classes = megakernel_trace.tile_classes(tasks, {"l1": 4, "l2": 2})
    l1, l2 = classes["l1"], classes["l2"]
    assert l1["full"] == {"tasks": 1, "rows": 128, "mainloop_ns": 40,
                          "mainloop_share": 40 / 116, "median_ns_per_ktile": 10.0}  # fmt: skip
    assert l1["over_half"]["tasks"] == 1 and l1["over_half"]["median_ns_per_ktile"] == 9.0
    # the half tiles: ready 5 after got 0 (20 ns of mainloop, no k-tile median) and one taken
    # when ready (20 ns, 5 per k-tile)
    assert l1["half"] == {"tasks": 2, "rows": 104, "mainloop_ns": 40,
                          "mainloop_share": 40 / 116, "median_ns_per_ktile": 5.0}  # fmt: skip
    assert l2["half"]["mainloop_share"] == 8 / 24 and l2["over_half"]["tasks"] == 0
    assert l2["over_half"]["median_ns_per_ktile"] is None
    bare = [{k: v for k, v in t.items() if k != "rows"} for t in tasks]
    assert megakernel_trace.tile_classes(bare, {"l1": 4, "l2": 2}) is None
