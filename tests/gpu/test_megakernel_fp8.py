"""The FP8 forward megakernel (MoKConfig(expert_precision="fp8_blockwise",
cuda_forward="megakernel")) on one GPU: EP 1 and virtual ranks (W = 2), against stage 1's FP8
forward (cuda_forward="stage1"), the reference backend's FP8 emulation and the float64 oracle.

Bitwise: the FP8 megakernel computes what stage 1's FP8 forward computes, in the same order (the
tokens quantised in (1, 128) blocks, the same 128x128x128 FP8 wgmma tiles and K order, the same
SwiGLU, act quantised in (1, 128) blocks from the bf16 act as stage 1's quantiser does, the same
L2 and combine), so at EP 1 its output is bitwise stage 1's, and so are the activations it keeps
(act, h, y): the backward after it (stage 1's, with fp8_backward "bf16" or "dgrad") gives stage
1's gradients bit for bit. With several ranks stage 1 sums a token's slots rank by rank, the
megakernel in slot order (test_megakernel.py), so there the output agrees within rounding and
the gradients stay bitwise. The default backward after an FP8 megakernel forward is stage 1's:
the backward megakernel takes the router-weight gradient as <d_rows @ W_down, a>, the BF16
layer's, where the FP8 forward's is <d_rows, y> of the FP8 GEMM's y (Experts.backward_reads_y).

Every run is from fresh random inputs, its outputs allocated from poisoned memory and the
workspace's data regions poisoned (test_cuda_backend.Run); bitwise run to run, in a replayed CUDA
graph, without a host sync; a stalled minibatch times out naming it.
"""

from __future__ import annotations

import pytest
import torch
from test_cuda_backend import (
    Run,
    VirtualRuns,
    _assert_repeats_bitwise,
    _bitwise_equal,
    _graph_check,
    _no_sync_check,
    _poison_workspace,
    _problem,
)
from test_fp8_experts_cuda import FP8_VS_BF16, FP8_VS_REFERENCE
from test_fp8_experts_cuda import SHAPES as FP8_SHAPES
from test_fp8_experts_cuda import run as run_with_weights
from test_megakernel import _child, _child_script

from mok_megatron import functional as F
from mok_megatron.functional.cuda import stage1
from mok_megatron.functional.cuda.mega import unavailable_here
from mok_megatron.ops import interleave_gate_up
from mok_megatron.ops import moe as mops
from mok_megatron.ops.grouped_gemm_fp8 import grouped_gemm_fp8_available
from mok_megatron.testing import relative_error
from mok_megatron.testing.poison import poisoned_memory
from mok_megatron.testing.runs import GRAD_NAMES, global_d_out, run_oracle

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(unavailable_here()), reason=f"megakernel: {unavailable_here()}"),
    pytest.mark.skipif(not grouped_gemm_fp8_available(), reason="FP8 grouped GEMMs not built"),
]

#: The output of a megakernel and of stage 1 that sum a token's slots in other orders (several
#: ranks): within rounding of each other (test_megakernel.py's bound).
OTHER_SUM_ORDER = 5e-3


def fp8_config(forward: str = "megakernel", **knobs) -> F.MoKConfig:
    """FP8 experts on ``forward`` ('megakernel' or 'stage1'); made when a test runs, not at
    import, so that collection does not depend on the config's validation."""
    knobs = {"fwd_num_comm_sms": 8, **knobs}
    return F.MoKConfig(expert_precision="fp8_blockwise", cuda_forward=forward, **knobs)


@pytest.fixture
def ran(monkeypatch):
    """What ran, one entry per rank's call: 'megakernel' (ops.moe.moe_mega_forward, the
    megakernel's one op), 'stage1' (stage1.forward) or 'megakernel backward'
    (ops.moe.moe_mega_backward, the backward megakernel's)."""
    calls = []
    for module, name, what in ((mops, "moe_mega_forward", "megakernel"),
                               (stage1, "forward", "stage1"),
                               (mops, "moe_mega_backward", "megakernel backward")):  # fmt: skip
        real = getattr(module, name)

        def spy(*args, _real=real, _what=what, **kwargs):
            calls.append(_what)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls


def _fp8_runs(problem, ran, num_local_tokens=None, rows="auto", **knobs) -> tuple[dict, dict, int]:
    """(the FP8 megakernel's out and gradients, FP8 stage 1's, the megakernel's rounds) on the
    same problem with the same ``knobs`` (``rows``: the megakernel's fwd_rows), each pass from
    poisoned memory; checks that each ran its own forward and neither the backward megakernel."""
    results, rounds = [], 0
    for forward in ("megakernel", "stage1"):
        mine = {"fwd_rows": rows} if forward == "megakernel" else {}
        run = Run(problem, "cuda", config=fp8_config(forward, **knobs, **mine), form="fused_auto",
                  num_local_tokens=num_local_tokens)  # fmt: skip
        assert run.ws.backend.path(run.ws) == forward
        ran.clear()
        results.append(run()[1])
        assert ran == [forward], f"{forward}: what ran: {ran}"
        if forward == "megakernel":
            rounds = run.ws.buffers.mega.num_rounds
    return results[0], results[1], rounds


# name: (tokens, (hidden, inter, experts, topk, shared), problem kwargs, num_local_tokens);
# H and I multiples of 128 (FP8 blocks), T not.
CASES = {
    "qwen3-30b-a3b": ([300], FP8_SHAPES["qwen3-30b-a3b"], {}, None),
    "deepseek-v3_shared": ([211], FP8_SHAPES["deepseek-v3"], {}, None),
    "mixtral-8x7b": ([190], FP8_SHAPES["mixtral-8x7b"], {}, None),
    "topk1": ([77], (128, 128, 8, 1, 0), {}, None),
    "topk8_empty_slots": ([129], (256, 128, 16, 8, 0), {"empty_slot_fraction": 0.3}, None),
    "experts_without_tokens": ([5], (128, 128, 64, 2, 0), {}, None),
    # 300 rows on expert 0: three 128-row m-tiles, the last partial
    "all_to_one_expert_topk1": ([300], (128, 256, 8, 1, 0), {"routing": "one_expert"}, None),
    "all_to_one_expert_topk2": ([200], (256, 128, 8, 2, 0), {"routing": "one_expert"}, None),
    "fewer_tokens_than_workspace": ([33], (128, 128, 8, 2, 128), {}, 200),
    "one_token": ([1], (128, 128, 8, 2, 0), {}, None),
}


# --------------------------------------------------------------------------------- EP 1
@pytest.mark.parametrize("rows", ["in_place", "pull"])
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_megakernel_forward_equals_stage1_bitwise(case, rows, ran):
    """The output bitwise stage 1's FP8 forward's, the L1 rows read in place (x quantised in
    place: the producers copy them and their scales) or pulled into the ring; with stage 1's
    backward on both, every gradient too (the activations each forward kept are bitwise
    equal)."""
    tokens, shape, kwargs, t_max = CASES[case]
    problem = _problem(tokens, shape, seed=11, **kwargs)
    got, want, _ = _fp8_runs(problem, ran, t_max, rows=rows, cuda_backward="stage1")
    assert torch.equal(got["out"].view(torch.uint8), want["out"].view(torch.uint8)), (
        f"out: {relative_error(got['out'].float(), want['out'].float()):.2e} from stage 1's"
    )
    bad = _bitwise_equal(want, got)
    assert not bad, f"stage 1's backward after the FP8 megakernel differs (bitwise) in {bad}"


@pytest.mark.parametrize(
    "case", ["qwen3-30b-a3b", "deepseek-v3_shared", "mixtral-8x7b", "all_to_one_expert_topk1"]
)
def test_fp8_megakernel_near_oracle(case):
    """Out and every gradient (default backward) within test_fp8_experts_cuda's bounds of the
    reference backend's FP8 emulation and of the float64 oracle (of the BF16 layer); and not
    the BF16 megakernel's output (the FP8 arithmetic ran)."""
    tokens, shape, kwargs, _ = CASES[case]
    problem = _problem(tokens, shape, seed=13, **kwargs)
    _, got = Run(problem, "cuda", config=fp8_config(), form="fused_auto")()
    _, ref = Run(problem, "reference", config=fp8_config("stage1"), form="fused")()
    oracle = run_oracle(problem, global_d_out(problem, 0))
    failures = []
    for name in ("out", *GRAD_NAMES):
        if ref[name] is None:
            assert got[name] is None, f"{name}: expected None"
            continue
        err = relative_error(got[name].float(), ref[name].float())
        if not err < FP8_VS_REFERENCE:
            failures.append(f"{name}: {err:.2e} from the reference's FP8 emulation")
        drift = relative_error(got[name].cpu(), oracle[name])
        if not drift < FP8_VS_BF16:
            failures.append(f"{name}: {drift:.2e} from the float64 oracle")
    assert not failures, failures
    bf16 = F.MoKConfig(cuda_forward="megakernel", fwd_num_comm_sms=8)
    _, bf16_got = Run(problem, "cuda", config=bf16, form="fused_auto")()
    assert not torch.equal(got["out"], bf16_got["out"]), "expert_precision changed nothing"


@pytest.mark.parametrize("fp8_backward", ["bf16", "dgrad"])
def test_fp8_megakernel_repeat_bitwise(fp8_backward):
    problem = _problem([211], FP8_SHAPES["deepseek-v3"], seed=3)
    run = Run(problem, "cuda", config=fp8_config(fp8_backward=fp8_backward), form="fused_auto")
    _, first = run()
    _assert_repeats_bitwise(run, first, 4)


def _forward_without_grad(run):
    """``run``'s forward with save_for_backward=False, its workspace and the output's memory
    poisoned first (the output must cover its poison): (out, context)."""
    _poison_workspace(run.ws)
    with poisoned_memory() as mem:
        sched = run.schedule()
        out, ctx = F.forward(run.config, run.ws, sched, run.x, run.rw, *run.weights,
                             save_for_backward=False)  # fmt: skip
    mem.assert_covers(out=out)
    return out, ctx


def test_fp8_megakernel_forward_without_grad_keeps_nothing_and_equals_the_saving_one():
    """Without a backward to follow, the FP8 forward stores no bf16 act (its L2 reads act's FP8
    copy): the same output, bitwise, as the forward that keeps the rings; its output comes from
    poisoned memory, as every run's here."""
    problem = _problem([300], FP8_SHAPES["qwen3-30b-a3b"], seed=13)
    run = Run(problem, "cuda", config=fp8_config(), form="fused_auto")
    _, saving = run()
    out, ctx = _forward_without_grad(run)
    assert ctx.saved is None and ctx.x_recv is None
    assert torch.equal(out, saving["out"])


@pytest.mark.parametrize("fp8_backward", ["bf16", "dgrad"])
def test_fp8_megakernel_cuda_graph_replay_equals_eager(fp8_backward):
    """Forward and backward captured in one CUDA graph, replayed into outputs filled with NaN:
    bitwise the eager pass's."""
    problem = _problem([190], FP8_SHAPES["qwen3-30b-a3b"], seed=8, shared_inter=128)
    config = fp8_config(fp8_backward=fp8_backward)
    _graph_check(Run(problem, "cuda", config=config, form="fused_auto"))


@pytest.mark.parametrize("fp8_backward", ["bf16", "dgrad"])
def test_fp8_megakernel_no_host_sync(fp8_backward):
    problem = _problem([128], FP8_SHAPES["mixtral-8x7b"], seed=4)
    config = fp8_config(fp8_backward=fp8_backward)
    _no_sync_check(Run(problem, "cuda", config=config, form="fused_auto"))


@pytest.mark.parametrize(
    "tokens,shape,kwargs",
    [([300], FP8_SHAPES["qwen3-30b-a3b"], {}),
     ([700], (128, 128, 8, 1, 0), {"routing": "one_expert"})],
    ids=["qwen3-30b-a3b", "all_to_one_expert_topk1"],
)  # fmt: skip
def test_fp8_megakernel_rounds_equal_stage1(tokens, shape, kwargs, ran):
    """More routed rows than macrobatch_size (rounds of 256): stage 1 sums round by round, so
    the output within rounding of stage 1's; the backward recomputes each round from the
    received bf16 tokens on both, so the gradients bitwise."""
    problem = _problem(tokens, shape, seed=23, **kwargs)
    got, want, rounds = _fp8_runs(problem, ran, minibatch_size=128, macrobatch_size=256)
    assert rounds > 1, rounds
    bad = [name for name in _bitwise_equal(want, got) if name != "out"]
    assert not bad, f"the gradients differ from stage 1's (bitwise) in {bad}"
    err = relative_error(got["out"].float(), want["out"].float())
    assert err < OTHER_SUM_ORDER, f"out: {err:.2e} from stage 1's"


def test_fp8_megakernel_rounds_without_grad_read_rows_in_place():
    """A forward of several rounds that keeps nothing for a backward keeps no tokens, so its FP8
    rows can be read in place ('auto' does): bitwise the pulled forward's output, both from
    poisoned memory."""
    problem = _problem([300], FP8_SHAPES["qwen3-30b-a3b"], seed=29)
    outs = {}
    for rows in ("in_place", "pull"):
        config = fp8_config(fwd_rows=rows, minibatch_size=128, macrobatch_size=256)
        run = Run(problem, "cuda", config=config, form="fused_auto")
        assert run.ws.buffers.mega.num_rounds > 1
        outs[rows], _ = _forward_without_grad(run)
    assert torch.equal(outs["in_place"].view(torch.uint8), outs["pull"].view(torch.uint8))


@pytest.mark.parametrize("form", ["fp8_blocks", "mxfp8"])
def test_fp8_megakernel_prequantised_weights_equal_stage1(form, ran):
    """Weights given already quantised ((128, 128) FP8BlockTensors, or MXFP8 requantised):
    the FP8 megakernel's out and gradients bitwise stage 1's on the same weights."""
    from mok_megatron.ops import fp8_blockwise_quantize, mxfp8_quantize

    problem = _problem([160], (256, 128, 8, 4, 0), seed=8)
    _, _, _, (gate, up, down), _ = problem.local(0, dtype=torch.bfloat16, device="cuda")
    dense = (interleave_gate_up(gate, up), down)
    if form == "fp8_blocks":
        gate_up, down = (fp8_blockwise_quantize(w, (128, 128)) for w in dense)
    else:
        gate_up, down = (mxfp8_quantize(w, rowwise=True, colwise=False) for w in dense)
    got, want = (run_with_weights(problem, fp8_config(forward), "cuda", "cuda",
                                  weights=(gate_up, None, down), poison=True)
                 for forward in ("megakernel", "stage1"))  # fmt: skip
    assert ran == ["megakernel", "stage1"], ran
    bad = _bitwise_equal(want, got)
    assert not bad, f"differs from stage 1's (bitwise) in {bad}"


# --------------------------------------------------------------------- the backward after it
@pytest.mark.parametrize("cuda_backward", ["auto", "stage1"])
@pytest.mark.parametrize("fp8_backward", ["bf16", "dgrad"])
@pytest.mark.parametrize("case", ["deepseek-v3_shared", "topk1", "all_to_one_expert_topk2"])
def test_fp8_megakernel_backward_equals_stage1_bitwise(case, fp8_backward, cuda_backward, ran):
    """The backward after the FP8 megakernel (cuda_backward 'auto', the default, and 'stage1')
    is stage 1's, never the backward megakernel: d_x, the router weights' and every weight's
    gradient bitwise those after stage 1's FP8 forward with the same fp8_backward. With
    fp8_backward='dgrad' the FP8 data gradients ran: d_x is not the BF16 backward's."""
    tokens, shape, kwargs, t_max = CASES[case]
    problem = _problem(tokens, shape, seed=17, **kwargs)
    knobs = {"fp8_backward": fp8_backward, "cuda_backward": cuda_backward}
    got, want, _ = _fp8_runs(problem, ran, t_max, **knobs)  # (neither ran the backward megakernel)
    bad = _bitwise_equal(want, got)
    assert not bad, f"differs from stage 1's FP8 forward + backward (bitwise) in {bad}"
    if fp8_backward == "dgrad":
        _, bf16_bwd = Run(problem, "cuda", config=fp8_config(cuda_backward=cuda_backward),
                          form="fused_auto", num_local_tokens=t_max)()  # fmt: skip
        assert torch.equal(got["out"], bf16_bwd["out"])
        assert not torch.equal(got["d_x"], bf16_bwd["d_x"]), "fp8_backward changed nothing"


# ------------------------------------------------------------------------- virtual ranks
VIRTUAL = {
    "deepseek-v3_shared": ([200, 160], FP8_SHAPES["deepseek-v3"], {}),
    "uneven_skewed": ([97, 3], (256, 128, 8, 4, 0), {"routing": "skewed"}),
    "rank_without_tokens": ([61, 0], (128, 128, 8, 2, 0), {}),
    "all_to_one_expert_topk1": ([200, 90], (128, 128, 8, 1, 0), {"routing": "one_expert"}),
    "topk8_empty_slots": ([70, 33], (128, 128, 16, 8, 0), {"empty_slot_fraction": 0.2}),
}


@pytest.mark.parametrize("case", list(VIRTUAL))
def test_fp8_megakernel_virtual_ranks_equal_stage1(case, ran):
    """W = 2 virtual ranks on one GPU, the FP8 megakernel against FP8 stage 1 at W = 2: every
    gradient bitwise on every rank, the output within rounding (stage 1 sums a token's slots
    rank by rank); the megakernel's second pass bitwise its first."""
    tokens, shape, kwargs = VIRTUAL[case]
    problem = _problem(tokens, shape, seed=43, **kwargs)
    w = len(tokens)
    results = {}
    for forward in ("megakernel", "stage1"):
        config = fp8_config(forward, fwd_num_comm_sms=4, schedule_capacity_multiplier=float(w))
        vruns = VirtualRuns(problem, w, config=config, form="fused_auto")
        assert all(ws.backend.path(ws) == forward for ws in vruns.workspaces)
        ran.clear()
        _, results[forward] = vruns()
        assert ran == [forward] * w, f"{forward}: what ran: {ran}"
        if forward == "megakernel":
            _, again = vruns()
            bad = [f"rank {r}: {n}" for r, (a, b) in enumerate(zip(results[forward], again))
                   for n in _bitwise_equal(a, b)]  # fmt: skip
            assert not bad, f"the megakernel's second pass differs from its first in {bad}"
    failures = []
    for r, (got, want) in enumerate(zip(results["megakernel"], results["stage1"])):
        failures += [f"rank {r}: {n} not bitwise" for n in _bitwise_equal(want, got) if n != "out"]
        err = relative_error(got["out"].float(), want["out"].float())
        if not err < OTHER_SUM_ORDER:
            failures.append(f"rank {r}: out {err:.2e} from stage 1's")
    assert not failures, failures


# ------------------------------------------------------------------------------ timeouts
def test_fp8_megakernel_stalled_minibatch_times_out(tmp_path):
    """The FP8 megakernel's comm CTAs never release minibatch 2: its tiles give up and the
    record names rank, phase, minibatch and counter, instead of hanging."""
    script = _child_script(
        "expert_precision='fp8_blockwise', fwd_num_comm_sms=4, fwd_rows='pull', "
        "wait_timeout_ms=1500",
        "ws.buffers.stall_minibatch = 2",
        inter=128,
    )
    output = _child(script, tmp_path)
    assert "LAUNCH-FAILED" in output, output[-3000:]
    assert "rank 0 timed out" in output and "L1 task waiting for its rows" in output, output[-3000:]
    assert "minibatch 2" in output and "arrive" in output, output[-3000:]
