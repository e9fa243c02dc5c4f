"""Long runs on CPU, the short version CI can afford (issue 17, item 4): repeated forward +
backward passes of the reference backend bitwise equal to the first with RSS bounded, and the
CPU demo (configs/tiny_cpu.yaml, EP 2 over gloo) trained with finite, falling losses and RSS
bounded. ``scripts/long_runs.py`` runs the long versions (500 demo steps; 1000 GPU passes).

RSS is noisy (glibc arenas fill, then wander): the bound is on the growth over the second half
of a run, ``long_runs.CPU_RSS_TAIL_DRIFT_BOUND`` (32 MiB; its comment gives the measurements).
"""

from __future__ import annotations

from pathlib import Path

from mok_megatron.testing import long_runs

ROOT = Path(__file__).resolve().parents[2]
#: The reference backend multiplies every row by every expert: PASS_SHAPE takes 0.3-0.5 s a
#: pass on 2 CPUs (scripts/long_runs.py runs it), this one ~0.035 s. A demo step takes ~0.17 s,
#: plus ~15-20 s to start the ranks.
CPU_SHAPE = {"tokens": 256, "hidden": 128, "inter": 64, "experts": 8, "topk": 4, "shared": 64}
PASSES, DEMO_STEPS = 100, 40


def test_reference_passes_repeat_bitwise_with_bounded_rss():
    record = long_runs.repeat_passes(PASSES, device="cpu", backend="reference", warmup=20,
                                     shape=CPU_SHAPE)  # fmt: skip
    assert record["path"] == "reference" and record["memory_kind"] == "rss"
    assert record["first_pass_finite"]
    assert record["mismatching_passes"] == 0, record
    assert record["memory_tail_drift_bytes"] <= long_runs.CPU_RSS_TAIL_DRIFT_BOUND, record
    assert long_runs.failures(record) == []


def test_cpu_demo_trains_with_finite_falling_loss_and_bounded_rss():
    record = long_runs.train_steps(str(ROOT / "configs" / "tiny_cpu.yaml"), DEMO_STEPS, warmup=10)
    assert record["world"] == 2 and record["device"] == "cpu"
    assert len(record["losses"]) == DEMO_STEPS and len(record["memory_bytes"]) == DEMO_STEPS
    assert record["all_losses_finite"]
    assert record["final_loss"] < record["first_loss"] - 1.0, record["losses"]  # ~6.3 -> ~3
    for drift in record["memory_tail_drift_bytes"]:  # one per rank
        assert drift <= long_runs.CPU_RSS_TAIL_DRIFT_BOUND, record
    assert long_runs.failures(record) == []


def _passes_record(**changes) -> dict:
    record = {"kind": "repeat_passes", "first_pass_finite": True, "mismatching_passes": 0,
              "first_mismatch": None, "memory_kind": "cuda_reserved", "memory_spread_bytes": 0,
              "memory_tail_drift_bytes": 0}  # fmt: skip
    return {**record, **changes}


def test_failures_name_each_broken_rule():
    """The checks scripts/long_runs.py exits non-zero on, on made-up records."""
    assert long_runs.failures(_passes_record()) == []
    assert "the first pass has a NaN" in long_runs.failures(_passes_record(
        first_pass_finite=False))[0]  # fmt: skip
    assert "3 passes differ" in long_runs.failures(_passes_record(mismatching_passes=3,
                                                                  first_mismatch=7))[0]  # fmt: skip
    assert "memory_spread_bytes=2097152" in long_runs.failures(_passes_record(
        memory_spread_bytes=2 << 20))[0]  # fmt: skip
    rss = _passes_record(memory_kind="rss", memory_spread_bytes=1 << 30)
    assert long_runs.failures(rss) == []  # RSS: only the tail drift counts
    train = {"kind": "train_steps", "all_losses_finite": True, "first_loss": 6.0,
             "final_loss": 3.0, "memory_kind": "rss", "memory_spread_bytes": [0, 0],
             "memory_tail_drift_bytes": [0, 40 << 20]}  # fmt: skip
    assert long_runs.failures(train) == [
        f"rss memory_tail_drift_bytes={40 << 20} after the warm-up on rank 1 (bound {32 << 20})"
    ]
    assert "a loss is NaN" in long_runs.failures({**train, "all_losses_finite": False})[0]
    assert "did not fall" in long_runs.failures({**train, "final_loss": 6.5})[0]
