"""The backward megakernel (``MoKConfig.cuda_backward``, 'auto' after a megakernel forward that
kept its activation rings: one round, or bf16 experts in macrobatch rounds) on one GPU: that it is the path that runs, against the float64 oracle, the reference
backend and stage 1's backward on the same forward; bitwise run to run and across the knobs that
only change the launch; accumulation into caller buffers (Megatron's main_grad); the clear
errors where it cannot run; a stalled minibatch times out naming the backward's phase.

Its data gradients are computed in another arithmetic order than stage 1's (its own GEMM tiles
over N-contiguous weights; the router-weight gradient's partial sums per 256 columns), so they
agree with stage 1's within rounding, and each with the oracle as tightly as PyTorch's bf16.
test_megakernel.py's tests (shapes, edge cases, virtual ranks W = 2 and 4, autograd, the CUDA
graph of forward and backward, the no-sync check) run it too, with the default config.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_cuda_backend import (
    ROUND_CASES,
    ROUTED,
    SHAPES,
    Run,
    VirtualRuns,
    _bitwise_equal,
    _check_accuracy,
    _check_against_reference,
    _clone,
    _problem,
    _virtual_run_failures,
)
from test_megakernel import _child, _child_script

from mok_megatron import functional as F
from mok_megatron.functional.cuda.mega import unavailable_here
from mok_megatron.ops import moe as mops
from mok_megatron.testing import relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(unavailable_here()), reason=f"megakernel: {unavailable_here()}"),
]

MEGA = F.MoKConfig(cuda_forward="megakernel", fwd_num_comm_sms=8, bwd_num_comm_sms=8)
MEGA_WGRAD = dataclasses.replace(MEGA, bwd_wgrad="down")
#: The down-weight gradient's task orders: after the data gradients' tasks, or among them.
WGRAD_ORDERS = {
    "last": MEGA_WGRAD,
    "interleaved": dataclasses.replace(MEGA, bwd_wgrad="down_interleaved"),
}
MEGA_STAGE1_BWD = F.MoKConfig(cuda_forward="megakernel", cuda_backward="stage1",
                              fwd_num_comm_sms=8)  # fmt: skip


@pytest.fixture
def backward_calls(monkeypatch):
    """How often ops.moe.moe_mega_backward ran (a list, one entry per call)."""
    calls = []
    real = mops.moe_mega_backward

    def spy(*args, **kwargs):
        calls.append(kwargs["num_comm_sms"])
        return real(*args, **kwargs)

    monkeypatch.setattr(mops, "moe_mega_backward", spy)
    return calls


@pytest.fixture
def wgrad_calls(monkeypatch):
    """What each ops.moe.moe_mega_backward call was asked of the down weight's gradient (a list,
    one entry per call): None (none in the launch), or (its buffer's dtype, added into it,
    interleaved)."""
    calls = []
    real = mops.moe_mega_backward

    def spy(*args, **kwargs):
        dw = kwargs.get("wgrad_down")
        calls.append(None if dw is None else (dw.dtype, kwargs["wgrad_accumulate"],
                                              kwargs["wgrad_interleave"]))  # fmt: skip
        return real(*args, **kwargs)

    monkeypatch.setattr(mops, "moe_mega_backward", spy)
    return calls


def _close(got: dict, want: dict, tol: float) -> list[str]:
    bad = []
    for name, w in want.items():
        if w is None or not w.numel():
            continue
        err = relative_error(got[name].double(), w.double())
        if not err < tol:
            bad.append(f"{name}: {err:.2e} from stage 1's backward")
    return bad


@pytest.mark.parametrize("shape", list(SHAPES))
def test_runs_and_matches_oracle_reference_and_stage1_backward(shape, backward_calls):
    problem = _problem([300], SHAPES[shape], seed=13)
    run = Run(problem, "cuda", config=MEGA, form="fused_auto")
    _, got = run()
    assert backward_calls == [MEGA.bwd_num_comm_sms], "the backward megakernel did not run"
    failures = _check_accuracy(problem, got)
    failures += _check_against_reference(problem, got, MEGA, form="fused")
    _, want = Run(problem, "cuda", config=MEGA_STAGE1_BWD, form="fused_auto")()
    assert len(backward_calls) == 1, "cuda_backward='stage1' ran the backward megakernel"
    assert torch.equal(got["out"], want["out"]), "the forward changed with the backward"
    # the shared expert's gradients are stage 1's code on both paths: bitwise
    shared = [n for n in ("d_w_shared_gate", "d_w_shared_up", "d_w_shared_down")
              if want[n] is not None]  # fmt: skip
    failures += [f"{n}: not bitwise stage 1's" for n in _bitwise_equal(
        {n: want[n] for n in shared}, got)]  # fmt: skip
    failures += _close(got, {n: want[n] for n in ("d_x", "d_router_weights", *ROUTED)}, 5e-3)
    assert not failures, failures


@pytest.mark.parametrize(
    "case,tokens,shape,kwargs",
    [
        ("empty_experts_and_dropped_slots", [97], (128, 64, 16, 4, 0),
         {"empty_slot_fraction": 0.3}),
        ("all_to_one_expert_topk1", [120], (128, 64, 8, 1, 0), {"routing": "one_expert"}),
        ("topk8_ragged", [133], (256, 192, 16, 8, 0), {}),
        ("wide_inter", [50], (128, 640, 4, 2, 0), {}),  # I = 640: a partial 256-column tile
        ("experts_without_tokens", [5], (128, 64, 64, 2, 0), {}),  # exact zero weight grads
    ],
)  # fmt: skip
def test_edge_cases_match_oracle_and_repeat_bitwise(case, tokens, shape, kwargs, backward_calls):
    problem = _problem(tokens, shape, seed=29, **kwargs)
    run = Run(problem, "cuda", config=MEGA, form="fused_auto")
    _, got = run()
    assert backward_calls, "the backward megakernel did not run"
    failures = _check_accuracy(problem, got)
    for i in range(2):
        _, again = run()
        failures += [f"repeat {i + 1} differs in {n}" for n in _bitwise_equal(got, again)]
    assert not failures, failures


def test_knobs_change_the_launch_not_the_result(backward_calls):
    """bwd_num_comm_sms and minibatch_size reach the backward's launch but not its arithmetic;
    a grid that cannot spare bwd_num_comm_sms raises naming the knob."""
    problem = _problem([257], SHAPES["qwen3-30b-a3b"], seed=9)
    results = []
    for comm, mini in ((1, 128), (8, 256), (30, 512)):
        config = F.MoKConfig(cuda_forward="megakernel", fwd_num_comm_sms=8,
                             bwd_num_comm_sms=comm, minibatch_size=mini)  # fmt: skip
        results.append(Run(problem, "cuda", config=config, form="fused_auto")()[1])
    assert backward_calls == [1, 8, 30]
    for other in results[1:]:
        assert not _bitwise_equal(results[0], other)
    config = F.MoKConfig(cuda_forward="megakernel", fwd_num_comm_sms=4, bwd_num_comm_sms=8)
    run = Run(problem, "cuda", config=config, form="fused")
    run.ws.buffers.num_sms = 8  # the forward fits (4 of 8 pull), the backward cannot spare 8
    with pytest.raises(RuntimeError, match=r"bwd_num_comm_sms=8 must be in \[1, 7\]"):
        run()


@pytest.mark.parametrize("in_rounds", [False, True], ids=["one_round", "rounds"])
def test_passes_across_the_counters_wrap_repeat_bitwise(in_rounds, backward_calls):
    """The megakernels' flags hold gen = epoch * R + round and are never reset between passes;
    before a pass whose generations would pass INT32_MAX (signed compares would read every old
    flag as set) the epoch kernel zeroes them and restarts the epoch at 1 (launch/moe_mega.cu).
    Forward and backward passes on both sides of that point give the first pass's results. In
    macrobatch rounds each backward launch (one per round) is a pass of its own with the stride
    R, so there the wrap falls between the forward and the backward's first launch."""
    problem = _problem([300], SHAPES["qwen3-30b-a3b"], seed=13)
    run = Run(problem, "cuda", config=F.MoKConfig(**ROUNDS) if in_rounds else MEGA,
              form="fused_auto")  # fmt: skip
    _, want = run()
    rounds = run.ws.buffers.mega.num_rounds
    assert (rounds > 1) == in_rounds
    counters = run.ws.buffers.region("counters", torch.int32)
    epoch = (2**31 - 1) // rounds - 2  # the next bump is the last before the wrap
    counters[0] = epoch  # layout/mega.cuh's kEpoch
    for _ in range(3):
        _, got = run()
        assert not _bitwise_equal(want, got)
    bumps = 1 + rounds  # per run: the forward's, and each backward launch's
    assert 1 <= int(counters[0]) <= 3 * bumps, int(counters[0])  # wrapped
    assert len(backward_calls) == 4 * rounds


def test_wgrad_accumulation_into_caller_buffers(backward_calls):
    """Megatron's gradient-accumulation fusion on this path: the weight gradients go into the
    caller's float32 buffers (bitwise old + the sum into zeros), every other output as the
    plain pass's."""
    problem = _problem([300], SHAPES["deepseek-v3"], seed=11)
    run = Run(problem, "cuda", config=MEGA, form="fused")
    _, plain = run()
    zeros = run.make_accumulators("zeros")
    _, got = run(accumulators=zeros)
    old = run.make_accumulators("random", seed=3)
    acc = _clone(old)
    run(accumulators=acc)
    assert len(backward_calls) == 3
    failures = [f"{n}: returned with accumulators" for n in ROUTED if got[n] is not None]
    failures += [f"{n}: differs from the plain pass" for n in ("out", "d_x", "d_router_weights")
                 if not torch.equal(got[n], plain[n])]  # fmt: skip
    failures += [f"accumulator {i}: not bitwise old + the sum into zeros"
                 for i, (a, o, z) in enumerate(zip(acc, old, zeros))
                 if a is not None and not torch.equal(a, o + z)]  # fmt: skip
    summed = {**plain, **run.split_accumulators(zeros)}
    failures += _check_accuracy(problem, summed)
    assert not failures, failures


#: Problems for the down weight's gradient inside the launch: the three shapes, and the edge
#: cases of its K (an expert's rows): experts without rows (exact zeros), one expert with every
#: row, dropped slots, a partial tile of I.
WGRAD_CASES = {
    "qwen3-30b-a3b": ([300], SHAPES["qwen3-30b-a3b"], {}),
    "deepseek-v3": ([300], SHAPES["deepseek-v3"], {}),
    "mixtral-8x7b": ([300], SHAPES["mixtral-8x7b"], {}),
    "empty_experts_and_dropped_slots": ([97], (128, 64, 16, 4, 0), {"empty_slot_fraction": 0.3}),
    "all_to_one_expert_topk1": ([120], (128, 64, 8, 1, 0), {"routing": "one_expert"}),
    "wide_inter": ([50], (128, 640, 4, 2, 0), {}),
    "experts_without_tokens": ([5], (128, 64, 64, 2, 0), {}),
}


@pytest.mark.parametrize(
    "case,order",
    [(case, "last") for case in WGRAD_CASES]
    + [(case, "interleaved") for case in ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")],
)
def test_down_wgrad_in_the_launch_is_the_engines_grouped_gemm_bitwise(case, order, wgrad_calls):
    """MoKConfig.bwd_wgrad="down": the down weight's gradient as tasks of the backward launch,
    each tile one CTA's over the expert's rows in 64-row k-tiles from its first row, is bitwise
    the engine's grouped_gemm_tn after the launch (the same tiles and k order; a last k-tile's
    rows past the expert meet zero rows of B), and every other output is the launch's without
    them; against the oracle; bitwise run to run. Outputs poisoned (Run): an expert without rows
    must store its zeros. "down_interleaved" (the tasks among the data gradients'): the same."""
    tokens, shape, kwargs = WGRAD_CASES[case]
    problem = _problem(tokens, shape, seed=17, **kwargs)
    _, want = Run(problem, "cuda", config=MEGA, form="fused")()
    run = Run(problem, "cuda", config=WGRAD_ORDERS[order], form="fused")
    _, got = run()
    # the default ran the grouped GEMM; the knob put the down weight's gradient into the launch
    assert wgrad_calls == [None, (torch.bfloat16, False, order == "interleaved")], wgrad_calls
    failures = [f"{n}: not bitwise the engine's" for n in _bitwise_equal(want, got)]
    failures += _check_accuracy(problem, got)
    _, again = run()
    failures += [f"repeat differs in {n}" for n in _bitwise_equal(got, again)]
    assert not failures, failures


@pytest.mark.parametrize(
    "case,order",
    [("deepseek-v3", "last"), ("experts_without_tokens", "last"), ("deepseek-v3", "interleaved")],
)
def test_down_wgrad_in_the_launch_adds_into_caller_buffers(case, order, wgrad_calls):
    """Into Megatron's float32 main_grad: each element its old value plus the tile's float32 sum
    rounded once, bitwise grouped_gemm_tn_accumulate's; an expert without rows keeps its
    buffer's bits; every other output as without the accumulators."""
    tokens, shape, kwargs = WGRAD_CASES[case]
    problem = _problem(tokens, shape, seed=23, **kwargs)
    off = Run(problem, "cuda", config=MEGA, form="fused")
    on = Run(problem, "cuda", config=WGRAD_ORDERS[order], form="fused")
    old = off.make_accumulators("random", seed=5)
    want, got = _clone(old), _clone(old)
    _, plain = off(accumulators=want)
    _, fused = on(accumulators=got)
    assert wgrad_calls == [None, (torch.float32, True, order == "interleaved")], wgrad_calls
    failures = [f"accumulator {i}: not bitwise the engine's"
                for i, (a, b) in enumerate(zip(got, want))
                if a is not None and not torch.equal(a.view(torch.int32), b.view(torch.int32))]  # fmt: skip
    failures += [f"{n}: differs" for n in _bitwise_equal(plain, fused)]
    assert not failures, failures


@pytest.mark.parametrize("bwd_wgrad", ["down", "down_interleaved"])
def test_down_wgrad_in_the_launch_with_virtual_ranks(bwd_wgrad):
    """Two virtual ranks on one GPU, each rank's experts' down-weight gradient from its own ring
    and B: against the oracle, bitwise run to run, and bitwise bwd_wgrad='off''s rank by rank."""
    problem = _problem([150, 190], SHAPES["qwen3-30b-a3b"], seed=43)
    base = dict(cuda_forward="megakernel", fwd_num_comm_sms=4, minibatch_size=128,
                schedule_capacity_multiplier=2.0)  # fmt: skip
    _, want = VirtualRuns(problem, 2, config=F.MoKConfig(**base), form="fused")()
    on = VirtualRuns(problem, 2, config=F.MoKConfig(**base, bwd_wgrad=bwd_wgrad), form="fused")
    failures = _virtual_run_failures(problem, on)
    _, got = on()
    failures += [f"rank {r}: {n} not bitwise bwd_wgrad='off''s"
                 for r, (a, b) in enumerate(zip(want, got)) for n in _bitwise_equal(a, b)]  # fmt: skip
    assert not failures, failures


def test_down_wgrad_in_rounds_runs_the_grouped_gemm(wgrad_calls):
    """In macrobatch rounds the down weight's gradient stays the grouped GEMM after each launch
    (bwd_wgrad is one round's): the results are bwd_wgrad='off''s, bitwise."""
    problem = _problem([300], SHAPES["qwen3-30b-a3b"], seed=13)
    _, want = Run(problem, "cuda", config=F.MoKConfig(**ROUNDS), form="fused")()
    run = Run(problem, "cuda", config=F.MoKConfig(**ROUNDS, bwd_wgrad="down"), form="fused")
    _, got = run()
    assert run.rounds > 1 and wgrad_calls == [None] * (2 * run.rounds), wgrad_calls
    assert not _bitwise_equal(want, got)


ROUNDS = dict(cuda_forward="megakernel", fwd_num_comm_sms=8, bwd_num_comm_sms=8,
              minibatch_size=128, macrobatch_size=256)  # fmt: skip


@pytest.mark.parametrize("case", list(ROUND_CASES))
def test_rounds_run_one_launch_each_against_oracle_reference_and_stage1(case, backward_calls):
    """More routed rows than macrobatch_size: the forward keeps the received tokens and its act
    and h rings; the backward launches the backward megakernel once per round, the last round
    first (on the kept rings, the earlier ones recomputed into them). Against the float64
    oracle, the reference backend and stage 1's backward of the same forward; bitwise run to
    run."""
    tokens, shape, kwargs = ROUND_CASES[case]
    problem = _problem(tokens, shape, seed=23, **kwargs)
    config = F.MoKConfig(**ROUNDS)
    run = Run(problem, "cuda", config=config, form="fused_auto")
    _, got = run()
    assert run.rounds > 1 and len(backward_calls) == run.rounds, (run.rounds, backward_calls)
    failures = _check_accuracy(problem, got)
    failures += _check_against_reference(problem, got, config, form="fused")
    stage1 = F.MoKConfig(cuda_backward="stage1", **ROUNDS)
    _, want = Run(problem, "cuda", config=stage1, form="fused_auto")()
    assert len(backward_calls) == run.rounds, "cuda_backward='stage1' ran the backward megakernel"
    assert torch.equal(got["out"], want["out"]), "the forward changed with the backward"
    failures += _close(got, {n: want[n] for n in ("d_x", "d_router_weights", *ROUTED)}, 5e-3)
    for i in range(2):
        _, again = run()
        failures += [f"repeat {i + 1} differs in {n}" for n in _bitwise_equal(got, again)]
    assert not failures, failures


@pytest.mark.parametrize("form", ["fused", "fused_torch"])
def test_rounds_recompute_on_the_engine_or_on_torch(form, backward_calls):
    """The rounds' recompute follows expert_gemm: the engine's L1 (it writes only the groups'
    rows) or torch._grouped_mm (the groups' rows selected into the rings)."""
    problem = _problem([300], SHAPES["qwen3-30b-a3b"], seed=17)
    run = Run(problem, "cuda", config=F.MoKConfig(**ROUNDS), form=form)
    _, got = run()
    assert run.rounds > 1 and len(backward_calls) == run.rounds
    failures = _check_accuracy(problem, got)
    assert not failures, failures


def test_rounds_after_the_last_with_rows_are_empty(backward_calls):
    """A workspace made for 8x the tokens: the rows fill the first rounds and the later ones are
    empty, so the forward's rings end holding a round before the last (found on the device)."""
    problem = _problem([150], (128, 64, 8, 4, 0), seed=5)
    config = F.MoKConfig(**ROUNDS)
    run = Run(problem, "cuda", config=config, form="fused_auto", num_local_tokens=1200)
    _, got = run()
    assert run.rounds >= 8 and len(backward_calls) == run.rounds
    failures = _check_accuracy(problem, got)
    _, again = run()
    failures += [f"repeat differs in {n}" for n in _bitwise_equal(got, again)]
    assert not failures, failures


def test_rounds_wgrad_accumulation_into_caller_buffers(backward_calls):
    """Megatron's main_grad in rounds: each round's weight gradients add into the caller's
    float32 buffers (last round first), every other output as the plain pass's; from zeros the
    buffers hold the gradients (against the oracle), and from the same old values the same bits
    run to run."""
    problem = _problem([300], SHAPES["deepseek-v3"], seed=11)
    run = Run(problem, "cuda", config=F.MoKConfig(**ROUNDS), form="fused")
    _, plain = run()
    assert run.rounds > 1
    zeros = run.make_accumulators("zeros")
    _, got = run(accumulators=zeros)
    failures = [f"{n}: returned with accumulators" for n in ROUTED if got[n] is not None]
    failures += [f"{n}: differs from the plain pass" for n in ("out", "d_x", "d_router_weights")
                 if not torch.equal(got[n], plain[n])]  # fmt: skip
    failures += _check_accuracy(problem, {**plain, **run.split_accumulators(zeros)})
    old = run.make_accumulators("random", seed=3)
    first, second = _clone(old), _clone(old)
    run(accumulators=first)
    run(accumulators=second)
    failures += [f"accumulator {i}: differs run to run" for i, (a, b) in
                 enumerate(zip(first, second)) if a is not None and not torch.equal(a, b)]  # fmt: skip
    failures += [f"accumulator {i}: {relative_error(a - o, z):.2e} from the sum into zeros"
                 for i, (a, o, z) in enumerate(zip(first, old, zeros))
                 if a is not None and not relative_error(a - o, z) < 1e-3]  # fmt: skip
    assert len(backward_calls) == 4 * run.rounds
    assert not failures, failures


def test_fp8_rounds_take_stage1(backward_calls):
    """FP8 experts' forward in rounds keeps only the received tokens (no bf16 rings): 'auto'
    runs stage 1's backward (cuda_backward='megakernel' with FP8 experts is refused by
    MoKConfig itself: tests/cpu)."""
    problem = _problem([300], (128, 128, 8, 4, 0), seed=4)
    run = Run(problem, "cuda", config=F.MoKConfig(expert_precision="fp8_blockwise", **ROUNDS),
              form="fused_auto")  # fmt: skip
    run()
    assert run.rounds > 1 and not backward_calls


def test_after_a_stage1_forward_megakernel_backward_fails_clearly():
    with pytest.raises(ValueError, match="cuda_backward='megakernel' needs the megakernel's"):
        F.MoKConfig(cuda_forward="stage1", cuda_backward="megakernel")


_STALL_BACKWARD = _child_script(
    "fwd_num_comm_sms=4, bwd_num_comm_sms=4, wait_timeout_ms=1500",
    """gu = interleave_gate_up(g, u)
out, ctx = F.forward(config, ws, sched, x, rw, None, None, None, gu, None, d)
torch.cuda.synchronize()
print("FORWARD-OK", flush=True)
ws.buffers.stall_minibatch = 1  # the backward's comm CTAs never release minibatch 1""",
    call="F.backward(config, ws, sched, ctx, torch.randn_like(out), x, rw, None, None, None, "
    "gu, None, d)",
)


def test_a_stalled_backward_minibatch_times_out_naming_the_backward_phase(tmp_path):
    output = _child(_STALL_BACKWARD, tmp_path)
    assert "FORWARD-OK" in output and "LAUNCH-FAILED" in output, output[-3000:]
    assert (
        "backward: L2-dgrad (or down-weight-gradient) task waiting for its d_out rows" in output
    ), output[-3000:]
    assert "minibatch 1" in output and "arrive" in output, output[-3000:]
