"""The forward megakernel (``MoKConfig.cuda_forward='megakernel'``) on one GPU: EP 1 and virtual
ranks (W = 2 and 4 on one GPU), against the float64 oracle, the reference backend and stage 1;
and at EP 2 on two GPUs (``-m multigpu``, under torchrun: scripts/gpu_check.sh 2).

Bitwise: at EP 1 in one round the megakernel computes what stage 1 computes, in the same order
(the same 128x256x64 wgmma tiles, the same SwiGLU, the same slot-ordered float32 sum), so its
output and the gradients of stage 1's backward on its context (MoKConfig.cuda_backward='stage1')
are bitwise equal to stage 1's (fused gate/up form, MoKConfig.expert_gemm='auto'). The default
backward after a megakernel forward, in one round or in macrobatch rounds (then one launch per
round, the last first), is the backward megakernel (tests/gpu/test_megakernel_backward.py): its
gradients agree with stage 1's within rounding (other GEMM tiles, other partial sums, in rounds
the weight gradients summed in the other round order), and with the oracle as tightly as stage
1's. Where stage 1 sums a token's slots in another order the output agrees within tolerance only
(stage 1's backward on the megakernel's context stays bitwise): in macrobatch rounds it sums
round by round, with several ranks rank by rank; the megakernel always in slot order. Run to
run, everything is bitwise equal.
Outputs are poisoned before every run (``testing.poison``), the plan is checked integer for
integer against stage 1's torch plan, and a stalled minibatch or rank times out with a record
that names it instead of hanging.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from test_cuda_backend import (
    EDGE_CASES,
    EP_CASES,
    ROUND_CASES,
    SHAPES,
    Run,
    VirtualRuns,
    _assert_repeats_bitwise,
    _assert_schedule_equal,
    _bitwise_equal,
    _check_accuracy,
    _check_against_reference,
    _device,
    _graph_check,
    _no_sync_check,
    _overflowing_problem,
    _poison_workspace,
    _problem,
    _schedule_failures,
    _virtual_run_failures,
    dist_group,  # noqa: F401 (the fixture of the EP 2 tests)
)

from mok_megatron import functional as F
from mok_megatron.functional.cuda.mega import rows_in_place, unavailable_here
from mok_megatron.functional.cuda.plan import GROUP_ALIGN, make_rounds, padded_plan
from mok_megatron.functional.schedule import MoKSchedule
from mok_megatron.functional.workspace import MoKCapacityError
from mok_megatron.ops import deinterleave_gate_up
from mok_megatron.testing import relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(unavailable_here()), reason=f"megakernel: {unavailable_here()}"),
]

MEGA = F.MoKConfig(cuda_forward="megakernel", fwd_num_comm_sms=8)
# MEGA's forward takes its rows as fwd_rows='auto' does on this GPU (the tuned table's choice for
# shapes it does not name: in place on an H200 since 9edf5e4, pulled where a table says 'pull';
# in place at one rank where there is none); MEGA_IN_PLACE reads them in place, and MEGA_PULL's
# comm CTAs pull them into the ring, as at several ranks.
MEGA_IN_PLACE = dataclasses.replace(MEGA, fwd_rows="in_place")
MEGA_PULL = dataclasses.replace(MEGA, fwd_rows="pull")
MEGA_STAGE1_BWD = F.MoKConfig(cuda_forward="megakernel", cuda_backward="stage1",
                              fwd_num_comm_sms=8)  # fmt: skip
STAGE1 = F.MoKConfig(cuda_forward="stage1", fwd_num_comm_sms=8)
MEGA_ROUNDS = F.MoKConfig(cuda_forward="megakernel", fwd_num_comm_sms=8, minibatch_size=128,
                          macrobatch_size=256)  # fmt: skip
STAGE1_ROUNDS = F.MoKConfig(cuda_forward="stage1", fwd_num_comm_sms=8, minibatch_size=128,
                            macrobatch_size=256)  # fmt: skip


def _mega_and_stage1(problem, mega_config, stage1_config, num_local_tokens=None):
    """(megakernel run, its schedule, its results, stage 1's results); the megakernel's forward
    with stage 1's backward checked bitwise against stage 1 on the way (``_assert_equal_to_stage1``
    then checks the default backward)."""
    mega = Run(problem, "cuda", config=mega_config, form="fused_auto",
               num_local_tokens=num_local_tokens)  # fmt: skip
    assert mega.ws.backend.path(mega.ws) == "megakernel"
    sched, got = mega()
    stage1 = Run(problem, "cuda", config=stage1_config, form="fused_auto",
                 num_local_tokens=num_local_tokens)  # fmt: skip
    assert stage1.ws.backend.path(stage1.ws) == "stage1"
    _, want = stage1()
    s1_bwd = dataclasses.replace(mega_config, cuda_backward="stage1")
    _, got_s1 = Run(problem, "cuda", config=s1_bwd, form="fused_auto",
                    num_local_tokens=num_local_tokens)()  # fmt: skip
    bad = _bitwise_equal(want, got_s1)
    if mega.ws.buffers.mega.num_rounds > 1:
        bad = [name for name in bad if name != "out"]  # stage 1 sums round by round
    assert not bad, f"megakernel + stage 1's backward differs from stage 1 (bitwise) in {bad}"
    return mega, sched, got, want


def _assert_equal_to_stage1(got, want, except_out=False, grads="close"):
    """The output bitwise equal to stage 1's (``except_out``: within tolerance only, checked
    against the oracle by the caller); the gradients bitwise (``grads='bitwise'``: stage 1's
    backward ran) or within rounding of stage 1's (the backward megakernel: relative error
    below 5e-3, where each is about 5e-3 from the float64 oracle)."""
    names = [name for name in want if name != "out" and want[name] is not None]
    bad = [] if except_out else [n for n in _bitwise_equal(want, got) if n == "out"]
    if grads == "bitwise":
        bad += [n for n in _bitwise_equal(want, got) if n != "out"]
    else:
        bad += [f"{n} ({relative_error(got[n].double(), want[n].double()):.2e})" for n in names
                if relative_error(got[n].double(), want[n].double()) >= 5e-3]  # fmt: skip
    assert not bad, f"megakernel differs from stage 1 in {bad}"


# ------------------------------------------------------------------------------------- plan
@pytest.mark.parametrize("macrobatch", [256, 1024, 131072])
@pytest.mark.parametrize("routing", ["uniform", "skewed", "one_expert"])
def test_device_plan_equals_stage1_torch_plan(routing, macrobatch):
    problem = _problem([300], (128, 64, 16, 4, 0), seed=3, routing=routing,
                       empty_slot_fraction=0.1)  # fmt: skip
    config = F.MoKConfig(cuda_forward="megakernel", minibatch_size=128, macrobatch_size=macrobatch)
    run = Run(problem, "cuda", config=config, form="fused")
    sched = run.schedule().ensure_built()  # the plan op (the forward's op would make it too)
    _assert_schedule_equal(sched, problem, run.ws)
    plan = sched.device_plan
    want = padded_plan(sched)
    rounds = make_rounds(macrobatch, sched, want, sched.global_weights)
    pairs = {
        "offs": want.offs, "expert_rows": want.expert_rows, "prow": want.prow,
        "token_rows_padded": want.token_rows, "row_tok": rounds.row_tok,
        "w_rows": rounds.w_rows, "first_round": rounds.first_round,
    }  # fmt: skip
    for name, expected in pairs.items():
        assert torch.equal(plan[name], expected), name
    _assert_tiles(plan, rounds, want)


def test_plan_and_rings_come_from_few_allocations_aligned_and_disjoint():
    """The op makes the schedule's and the plan's tensors from one allocation each
    (apis/tensor_arena.h) and each kept ring from its own (the backward lets each go after its
    last read): every tensor starts on a 256-byte boundary, none overlaps another, and the
    output the caller keeps has a storage of its own. No fused dSwiGLU: y is not kept (the L2
    epilogue stores each row only to its source slot); nor are the routed rows or the tokens
    (the backward dispatches x again)."""
    problem = _problem([300], (128, 64, 16, 4, 0), seed=5)
    run = Run(problem, "cuda", config=MEGA, form="fused_auto")
    sched = run.schedule()
    out, ctx = F.forward(run.config, run.ws, sched, run.x, run.rw, *run.weights)
    plan = sched.device_plan
    assert ctx.saved.y is None and ctx.saved.x_rows is None and ctx.x_recv is None
    rings = [ctx.saved.a, ctx.saved.h]
    schedule = [getattr(sched, name) for name in MoKSchedule.INTEGER_FIELDS]
    tensors = [t for t in (*plan.values(), *schedule, *rings) if t.numel()]
    spans = sorted({(t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors})
    assert all(begin % 256 == 0 for begin, _ in spans)
    assert all(a_end <= b_begin for (_, a_end), (b_begin, _) in zip(spans, spans[1:]))
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    # one each: the plan's tensors, the schedule's (with its scratch), each ring; the gathered
    # routing and router weights: at most one each
    assert len({t.untyped_storage().data_ptr() for t in rings}) == len(rings)
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in rings)
    assert len(storages) <= 4 + len(rings), len(storages)
    assert out.untyped_storage().data_ptr() not in storages
    assert out.untyped_storage().nbytes() == out.nbytes


def _assert_tiles(plan, rounds, cplan):
    """The tile table: each round's groups cut into <= 128-row m-tiles, in row order."""
    ends = cplan.offs.tolist()
    starts = [0, *ends[:-1]]  # each group's first padded row (8-aligned)
    for r in range(rounds.count):
        lo, hi = r * rounds.rows, (r + 1) * rounds.rows
        want = []
        for e, (s, t) in enumerate(zip(starts, ends)):
            b, end = max(s, lo), min(t, hi)
            while b < end:
                want.append([e, b - lo, min(b + 128, end) - lo])
                b += 128
        count = int(plan["tile_count"][r])
        got = plan["tiles"][r, :count, :3].tolist()
        assert got == want, f"round {r}: tiles {got[:4]}... != {want[:4]}..."


# --------------------------------------------------------------------------------- EP 1
ROWS = {"in_place": MEGA_IN_PLACE, "pull": MEGA_PULL}


@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_shapes_match_oracle_and_equal_stage1(shape, rows):
    problem = _problem([300], SHAPES[shape], seed=11)
    mega, sched, got, want = _mega_and_stage1(problem, ROWS[rows], STAGE1)
    _assert_schedule_equal(sched, problem, mega.ws)
    failures = _check_accuracy(problem, got)
    failures += _check_against_reference(problem, got, MEGA, form="fused")
    assert not failures, failures
    _assert_equal_to_stage1(got, want)


@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_edge_cases_match_oracle_and_equal_stage1(case, rows):
    tokens, shape, kwargs, t_max = EDGE_CASES[case]
    problem = _problem(tokens, shape, seed=5, **kwargs)
    mega, sched, got, want = _mega_and_stage1(problem, ROWS[rows], STAGE1,
                                              num_local_tokens=t_max)  # fmt: skip
    _assert_schedule_equal(sched, problem, mega.ws)
    failures = _check_accuracy(problem, got)
    assert not failures, failures
    _assert_equal_to_stage1(got, want)


@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("case", list(ROUND_CASES))
def test_more_rows_than_one_ring(case, rows):
    """Rounds of 256 rows (several per pass): the ring is refilled after each round (with the
    rows in place, each round's L1 tiles read the round's rows from the token rows)."""
    tokens, shape, kwargs = ROUND_CASES[case]
    problem = _problem(tokens, shape, seed=23, **kwargs)
    config = dataclasses.replace(MEGA_ROUNDS, fwd_rows="in_place" if rows == "in_place" else "pull")
    mega, sched, got, want = _mega_and_stage1(problem, config, STAGE1_ROUNDS)
    assert mega.ws.buffers.mega.num_rounds > 1
    failures = _check_accuracy(problem, got)
    failures += _check_against_reference(problem, got, MEGA_ROUNDS, form="fused")
    assert not failures, failures
    # stage 1 sums round by round; the backward megakernel takes the rounds last first
    _assert_equal_to_stage1(got, want, except_out=True)


def test_tiles_of_at_most_64_rows_equal_stage1():
    """An m-tile of at most 64 rows (an expert's last, here about half the tiles) runs on one
    consumer warpgroup while the other idles (roles/megakernel_gemm.cuh, consumer_rows_idle):
    beside full tiles in the same pass its rows are bitwise stage 1's in the forward, and the
    backward megakernel's gradients are as close to stage 1's and the oracle as elsewhere."""
    problem = _problem([700], (256, 160, 16, 4, 0), seed=29)  # ~175 rows per expert
    mega, sched, got, want = _mega_and_stage1(problem, MEGA, STAGE1)
    plan = sched.device_plan
    count = int(plan["tile_count"][0])
    rows = (plan["tiles"][0, :count, 2] - plan["tiles"][0, :count, 1]).tolist()
    assert any(r <= 64 for r in rows) and any(r > 64 for r in rows), rows
    failures = _check_accuracy(problem, got)
    failures += _check_against_reference(problem, got, MEGA, form="fused")
    assert not failures, failures
    _assert_equal_to_stage1(got, want)


def test_full_width_qwen3_equals_stage1():
    problem = _problem([2000], (2048, 768, 64, 8, 0), seed=17)
    _, _, got, want = _mega_and_stage1(problem, MEGA, STAGE1)
    assert not _check_accuracy(problem, got, oracle_device=_device())
    _assert_equal_to_stage1(got, want)


def test_rows_longer_than_one_pull_batch_equal_stage1():
    """A comm warp copies a row in steps of 32 lanes x kPullUnroll 16-byte vectors
    (roles/megakernel_comm.cuh, pull_row); a row of several steps whose last is partial (hidden
    8320: 1040 vectors, four steps of 256 and one of 16) is copied whole. Forward and backward
    pull their rows so (x, then d_out): bitwise stage 1's output, gradients as close as
    elsewhere."""
    problem = _problem([150], (8320, 128, 4, 2, 0), seed=37)
    _, _, got, want = _mega_and_stage1(problem, MEGA, STAGE1)
    failures = _check_accuracy(problem, got)
    assert not failures, failures
    _assert_equal_to_stage1(got, want)


def test_one_rank_reads_the_token_rows_in_place():
    """At one rank the megakernels read x (forward) and d_out (backward) where they lie
    (MegaArgs::local_tokens), and the backward gathers the gate/up weight gradient's x rows from
    x by the plan's row_src (mega._routed_rows) instead of dispatching x again: neither pass
    copies or pulls the tokens (the tokens region stays poisoned, so a read of it would show in
    the results); the output is stage 1's, and the profiled pass repeats the first bit for bit.
    (Token rows not 16-byte aligned never reach the op: the API refuses them.)"""
    problem = _problem([211], SHAPES["qwen3-30b-a3b"], seed=5)
    _, _, got, want = _mega_and_stage1(problem, MEGA, STAGE1)
    _assert_equal_to_stage1(got, want)
    run = Run(problem, "cuda", config=MEGA, form="fused_auto")
    _poison_workspace(run.ws)
    sched = run.schedule()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out, ctx = F.forward(run.config, run.ws, sched, run.x, run.rw, *run.weights)
        torch.cuda.synchronize()
    # (the forward's one host copy, a DtoH into pinned memory, is not a token copy)
    copies = [e.name for e in prof.events() if "DtoD" in e.name]
    assert not copies, f"the one-rank forward still copies on the device: {copies}"
    assert any("moe_forward_megakernel" in e.name for e in prof.events())
    assert not _bitwise_equal({"out": want["out"]}, {"out": out})
    # the backward: d_out read in place, and the gate/up weight gradient's x rows gathered from
    # x by the plan (no dispatch of x: no staging copy, no pull), with the gradients as above
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        grads = F.backward(run.config, run.ws, sched, ctx, run.d_out, run.x, run.rw,
                           *run.weights)._asdict()  # fmt: skip
        torch.cuda.synchronize()
    moved = [e.name for e in prof.events() if "DtoD" in e.name or "pull_tokens" in e.name]
    assert not moved, f"the one-rank backward still copies or pulls the tokens: {moved}"
    assert any("moe_backward_megakernel" in e.name for e in prof.events())
    gate_up = grads["d_w_routed_gate"]
    grads["d_w_routed_gate"], grads["d_w_routed_up"] = deinterleave_gate_up(gate_up, -2)
    got_again = {"out": out, **grads}
    assert not _bitwise_equal(got, got_again), "the profiled pass differs from the first"
    run.ws.check_errors()


@pytest.mark.parametrize("cluster", [1, 2], ids=["one_cta", "clusters_of_2"])
def test_bitwise_repeatable_graph_replay_and_no_host_sync(cluster):
    """Also in clusters of two CTAs (MoKConfig.megakernel_cluster, tests/gpu/
    test_megakernel_cluster.py)."""
    problem = _problem([211], SHAPES["deepseek-v3"], seed=3)
    config = dataclasses.replace(MEGA, megakernel_cluster=cluster)
    run = Run(problem, "cuda", config=config, form="fused_auto")
    _, first = run()
    for i in range(4):
        _, again = run()
        assert not _bitwise_equal(first, again), f"run {i + 2} differs"
    _graph_check(run)
    _no_sync_check(run)


def test_knob_values_change_the_launch_not_the_result(monkeypatch):
    """fwd_num_comm_sms, minibatch_size and megakernel_order_block reach the launch (a value it
    cannot take raises there) but not the arithmetic: every setting gives the same bits. The
    m-tiles (1100 tokens to 32 experts, top 8: about 3 an expert, 96 in all) span several
    blocks of 8 and of 16."""
    problem = _problem([1100], SHAPES["qwen3-30b-a3b"], seed=9)
    results = []
    for comm, mini, rows, block in ((1, 128, "pull", "auto"), (8, 256, "pull", 8),
                                    (40, 512, "pull", 16), (8, 256, "in_place", 8),
                                    (8, 256, "in_place", 16)):  # fmt: skip
        config = F.MoKConfig(cuda_forward="megakernel", fwd_num_comm_sms=comm,
                             minibatch_size=mini, macrobatch_size=131072, fwd_rows=rows,
                             megakernel_order_block=block)  # fmt: skip
        results.append(Run(problem, "cuda", config=config, form="fused_auto")()[1])
    for other in results[1:]:
        assert not _bitwise_equal(results[0], other)
    run = Run(problem, "cuda", config=MEGA, form="fused")
    run.ws.buffers.num_sms = MEGA.fwd_num_comm_sms  # a grid of 8 SMs cannot spare 8 for comm
    with pytest.raises(RuntimeError, match=r"fwd_num_comm_sms=8 must be in \[1, 7\]"):
        run()
    # the op's own check, past MoKConfig's (which refuses 4 first, and again wherever the
    # config is replaced: tests/cpu/test_config.py): 4 given to the op's call itself
    from mok_megatron.ops import moe as mops

    op = mops.moe_mega_forward
    monkeypatch.setattr(mops, "moe_mega_forward", lambda *a, **k: op(*a, **{**k, "order_block": 4}))
    with pytest.raises(RuntimeError, match=r"order_block=4 must be 0 \(auto\), 8 or 16"):
        Run(problem, "cuda", config=MEGA, form="fused")()


@pytest.mark.parametrize(
    "config",
    [MEGA_IN_PLACE, MEGA_PULL, MEGA_ROUNDS, dataclasses.replace(MEGA, megakernel_cluster=2)],
    ids=["one_round", "one_round_pull", "rounds", "clusters_of_2"],
)
def test_trace_records_every_task_in_dependency_order_and_changes_nothing(config):
    """The timeline (diagnostics, scripts/megakernel_trace.py): with the trace on, the pass gives
    the same bits; the plan's m-tiles are kept beside it and hold every routed row once; every
    CTA and every (round, m-tile, n-tile) task of the plan is recorded once; each record's stamps are in the order the kernel reaches them, and an L2 task's inputs
    were ready only after all of its m-tile's L1 mainloops had ended. In clusters of two
    (MoKConfig.megakernel_cluster=2) the CTA of rank c in its cluster records slots 2 ticket + c:
    the clusters ran."""
    from mok_megatron.ops.moe import MEGA_TRACE_CTA_FIELDS, MEGA_TRACE_TASK_FIELDS

    problem = _problem([300], SHAPES["qwen3-30b-a3b"], seed=31)
    run = Run(problem, "cuda", config=config, form="fused_auto")
    _, want = run()
    run.ws.buffers.trace = True
    sched, got = run()
    run.ws.buffers.trace = False
    assert not _bitwise_equal(want, got), "the trace changed the result"
    ctas, tasks = run.ws.buffers.last_trace
    shape = run.ws.buffers.mega
    sms = run.ws.buffers.num_sms or torch.cuda.get_device_properties(0).multi_processor_count
    cluster = config.megakernel_cluster
    sms = sms // cluster * cluster  # the grid: whole clusters
    assert ctas.shape == (sms, len(MEGA_TRACE_CTA_FIELDS))
    assert tasks.shape == (shape.num_rounds, shape.max_tasks, len(MEGA_TRACE_TASK_FIELDS))
    c = dict(zip(MEGA_TRACE_CTA_FIELDS, ctas.cpu().T))
    assert (c["start"] > 0).all() and (c["end"] >= c["start"]).all()
    # the SM's cycle counter over the same span: a clock between 0.3 and 3 GHz
    cycles, ns = c["end_cycles"] - c["start_cycles"], c["end"] - c["start"]
    assert (c["start_cycles"] > 0).all() and (cycles > 0).all()
    assert ((cycles > 0.3 * ns) & (cycles < 3.0 * ns)).all(), "cycles / ns is not an SM clock"
    if rows_in_place(run.ws):  # no CTA pulls
        assert (c["pull_ns"] == 0).all()
    else:
        assert c["pull_ns"][0] > 0 and (c["pull_ns"][config.fwd_num_comm_sms :] == 0).all()
    if shape.num_rounds > 1:
        assert c["barrier_ns"].sum() > 0
    else:
        assert (c["barrier_ns"] == 0).all()
    # every task of the plan once: (l2, m-tile, n-tile) per round from the plan's tile counts
    tile_count = sched.device_plan["tile_count"].cpu().tolist()
    # the plan's m-tiles kept beside the timeline (megakernel_trace.py's rows per task): every
    # m-tile of a round has 1..128 rows, and they hold every expert's rows padded to
    # GROUP_ALIGN once (one rank)
    tiles = run.ws.buffers.last_tiles
    assert torch.equal(tiles, sched.device_plan["tiles"])
    tile_rows = torch.cat([tiles[r, :m, 2] - tiles[r, :m, 1] for r, m in enumerate(tile_count)])
    assert ((tile_rows >= 1) & (tile_rows <= 128)).all()
    counts = torch.bincount(run.topk[run.topk >= 0])
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    assert int(tile_rows.sum()) == int(padded.sum())
    words = dict(zip(MEGA_TRACE_TASK_FIELDS, tasks.cpu().permute(2, 0, 1)))
    for r, mtiles in enumerate(tile_count):
        ran = words["cta"][r] > 0
        ids = words["task"][r][ran].tolist()
        want_ids = [(l2 << 40) | (m << 20) | n for l2, nt in ((0, shape.l1_ntiles),
                    (1, shape.l2_ntiles)) for m in range(mtiles) for n in range(nt)]  # fmt: skip
        assert sorted(ids) == sorted(want_ids), f"round {r}: tasks recorded != the plan's"
        assert (words["cta"][r][ran] <= sms).all()
        if cluster > 1:
            slots = torch.arange(tasks.shape[1])[ran]
            assert ((words["cta"][r][ran] - 1) % cluster == slots % cluster).all()
        t = {k: words[k][r][ran] for k in ("take", "ready", "got", "mma_end", "epi_end")}
        assert (t["take"] > 0).all() and (t["take"] <= t["ready"]).all()
        assert (t["got"] <= t["mma_end"]).all() and (t["mma_end"] <= t["epi_end"]).all()
        assert (t["ready"] <= t["mma_end"]).all(), "a mainloop ended before its inputs were ready"
        task = torch.tensor(ids)
        l2, tile = task >> 40, (task >> 20) & 0xFFFFF
        # an L1 task's stores end before its flag's release; other tasks have no such stamp
        stored = words["stored"][r][ran]
        assert (t["mma_end"][l2 == 0] <= stored[l2 == 0]).all()
        assert (stored[l2 == 0] <= t["epi_end"][l2 == 0]).all() and (stored[l2 == 1] == 0).all()
        for m in range(mtiles):
            l1_end = t["mma_end"][(l2 == 0) & (tile == m)].max()
            assert (t["ready"][(l2 == 1) & (tile == m)] >= l1_end).all(), (
                f"round {r}: an L2 task of m-tile {m} was ready before its L1 tasks ended"
            )


def test_forward_without_grad_keeps_nothing():
    problem = _problem([300], SHAPES["qwen3-30b-a3b"], seed=12)
    run = Run(problem, "cuda", config=MEGA, form="fused")
    sched = run.schedule()
    out, ctx = F.forward(run.config, run.ws, sched, run.x, run.rw, *run.weights,
                         save_for_backward=False)  # fmt: skip
    assert ctx.saved is None and ctx.x_recv is None
    with pytest.raises(RuntimeError, match="kept nothing"):
        F.backward(run.config, run.ws, sched, ctx, run.d_out, run.x, run.rw, *run.weights)
    x = run.x.clone().requires_grad_(False)
    with torch.no_grad():  # functional.moe under no_grad: the same
        y = F.moe(x, run.topk, run.rw, *run.routed, config=run.config, workspace=run.ws)
    assert torch.equal(y, out)


#: The gradients functional.moe's autograd tests compare, in the leaves' order.
_AUTOGRAD_GRADS = ("d_x", "d_router_weights", "gu", "down")


def _moe_autograd_step(run):
    """(leaves, step): copies of ``run``'s x, router weights, gate_up and down that require
    grad, and ``step()``, one functional.moe forward (with run's shared expert, if any) and
    autograd backward of run.d_out on them, returning the output."""
    gate_up, _, down = run.routed
    leaves = [t.detach().clone().requires_grad_() for t in (run.x, run.rw, gate_up, down)]

    def step():
        x, rw, w1, w2 = leaves
        out = F.moe(x, run.topk, rw, w1, None, w2, shared=run.shared, config=run.config,
                    workspace=run.ws)  # fmt: skip
        out.backward(run.d_out)
        return out

    return leaves, step


def _autograd_grads(leaves) -> dict:
    return {name: leaf.grad for name, leaf in zip(_AUTOGRAD_GRADS, leaves)}


def _autograd_expected(want) -> dict:
    """functional.backward's results (``Run``'s) as the autograd tests name them."""
    from mok_megatron.ops import interleave_gate_up

    gate_up = interleave_gate_up(want["d_w_routed_gate"], want["d_w_routed_up"])
    return {"out": want["out"], "d_x": want["d_x"], "d_router_weights": want["d_router_weights"],
            "gu": gate_up, "down": want["d_w_routed_down"]}  # fmt: skip


@pytest.mark.parametrize("config", [MEGA, MEGA_ROUNDS, STAGE1],
                         ids=["megakernel", "megakernel_rounds", "stage1"])  # fmt: skip
def test_moe_autograd_gives_the_backward_bitwise_and_frees_as_it_goes(config):
    """functional.moe's backward runs in two autograd nodes (functional/autograd.py): its
    gradients equal functional.backward's bit for bit, and with .grad already there (a second
    step, as in training) its peak memory stays under both routed weights' gradients at once:
    the down gradient is added into .grad and let go before gate_up's is made. The outputs'
    blocks are poisoned first, each in its own size (autograd allocates on its device thread, so
    poisoned_memory's pool would not reach them). In macrobatch rounds (autograd consumes the
    context: the rounds' recompute goes into the forward's own rings) both weight gradients are
    summed over the rounds in the first node, as stage 1's rounds do, so only the bits are
    checked."""
    from mok_megatron.testing.poison import assert_fully_written, poison_

    problem = _problem([256], (2048, 1024, 8, 2, 0), seed=21)
    run = Run(problem, "cuda", config=config, form="fused")
    _, want = run()
    rounds = run.rounds > 1
    assert rounds == (config is MEGA_ROUNDS)
    leaves, step = _moe_autograd_step(run)
    gate_up, down = leaves[2], leaves[3]

    for t in [torch.empty_like(leaf) for leaf in leaves]:  # freed poisoned, reused by the grads
        poison_(t)
    torch.cuda.synchronize()
    out = step()
    grads = _autograd_grads(leaves)
    for name, g in grads.items():
        assert_fully_written(name, g)
    assert torch.equal(out, want["out"])
    expected = _autograd_expected(want)
    del expected["out"]
    bad = _bitwise_equal(grads, expected)
    assert not bad, f"autograd differs from functional.backward in {bad}"
    if rounds:
        return

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()  # .grad is there: autograd adds into it
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    gu_bytes, down_bytes = gate_up.nbytes, down.nbytes
    assert gu_bytes <= peak < gu_bytes + down_bytes // 2, (
        f"backward peak {peak / 2**20:.1f} MiB over what it held before; gate_up's gradient is "
        f"{gu_bytes / 2**20:.1f} MiB, down's {down_bytes / 2**20:.1f} MiB"
    )


@pytest.mark.parametrize("config", [MEGA, MEGA_ROUNDS, STAGE1],
                         ids=["megakernel", "megakernel_rounds", "stage1"])  # fmt: skip
def test_moe_autograd_forward_and_backward_replay_from_one_cuda_graph(config):
    """functional.moe's forward and its autograd backward (both nodes), captured in one CUDA
    graph as a training step is (the leaves' .grad set to None first, so the graph makes
    them), replay into outputs filled with NaN bitwise equal to functional.backward's."""
    problem = _problem([200], SHAPES["deepseek-v3"], seed=23)  # with its shared expert
    run = Run(problem, "cuda", config=config, form="fused")
    _, want = run()
    leaves, step = _moe_autograd_step(run)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on the capture stream
        step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for leaf in leaves:
        leaf.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    expected = _autograd_expected(want)
    for i in range(2):
        replayed = {"out": out, **_autograd_grads(leaves)}
        for t in replayed.values():
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        bad = _bitwise_equal(replayed, expected)
        assert not bad, f"replay {i + 1} differs from functional.backward in {bad}"
    run.ws.check_errors()


def test_split_weights_take_stage1_or_fail_clearly():
    problem = _problem([100], (128, 64, 8, 2, 0), seed=2)
    auto = Run(problem, "cuda", config=F.MoKConfig(cuda_forward="auto", fwd_num_comm_sms=8),
               form="split")  # fmt: skip
    assert auto.ws.backend.path(auto.ws) == "megakernel"
    _, got = auto()  # separate gate and up: stage 1 runs them
    assert not _check_accuracy(problem, got)
    strict = Run(problem, "cuda", config=MEGA, form="split")
    with pytest.raises(ValueError, match="fused gate/up"):
        strict()


# ------------------------------------------------------------------------- virtual ranks
VIRTUAL = {
    "qwen3-30b-a3b": ([256, 200], SHAPES["qwen3-30b-a3b"], {}),
    "deepseek-v3_shared": ([200, 160], SHAPES["deepseek-v3"], {}),
    "mixtral-8x7b": ([150, 190], SHAPES["mixtral-8x7b"], {}),
    "uneven_skewed": ([97, 3], (128, 64, 8, 4, 32), {"routing": "skewed"}),
    "rank_without_tokens": ([61, 0], (128, 64, 8, 2, 0), {}),
    "all_to_one_expert_topk1": ([120, 90], (128, 64, 8, 1, 0), {"routing": "one_expert"}),
    "four_ranks_topk8": ([70, 0, 33, 81], (128, 64, 16, 8, 0), {"empty_slot_fraction": 0.2}),
    "four_ranks_rounds": ([150, 90, 33, 81], (128, 64, 16, 4, 0), {"routing": "skewed"}),
}


@pytest.mark.parametrize("case", list(VIRTUAL))
def test_virtual_ranks_match_oracle_and_repeat_bitwise(case):
    tokens, shape, kwargs = VIRTUAL[case]
    problem = _problem(tokens, shape, seed=43, **kwargs)
    w = len(tokens)
    rounds = case.endswith("rounds")
    config = F.MoKConfig(
        cuda_forward="megakernel", fwd_num_comm_sms=4, schedule_capacity_multiplier=float(w),
        minibatch_size=128, macrobatch_size=256 if rounds else 131072,
    )  # fmt: skip
    vruns = VirtualRuns(problem, w, config=config, form="fused_auto")
    assert all(ws.backend.path(ws) == "megakernel" for ws in vruns.workspaces)
    failures = _virtual_run_failures(problem, vruns)
    if rounds:
        assert vruns.workspaces[0].buffers.mega.num_rounds > 1
    assert not failures, failures


def test_virtual_ranks_capacity_overflow_drops_the_same_rows_as_stage1():
    """Routing over the schedule's capacity (every token on one expert of rank 0, capacity 1x):
    both passes finish and raise MoKCapacityError naming the knob, no kernel wrote past a
    workspace region, and the rows the schedule dropped add nothing. Their slots get zero rows
    in the poisoned workspace (roles::zero_dropped_slots, forward and backward), so the output
    is finite and equals stage 1's, which drops the same rows, within the rank-order sums'
    rounding (stage 1 sums a token's slots rank by rank)."""
    problem = _overflowing_problem()
    outs = {}
    for path in ("megakernel", "stage1"):
        config = F.MoKConfig(
            cuda_forward=path, fwd_num_comm_sms=4, schedule_capacity_multiplier=1.0
        )
        vruns = VirtualRuns(problem, 2, config=config, form="fused_auto")
        assert all(ws.backend.path(ws) == path for ws in vruns.workspaces)
        _, results = vruns(check_errors=False)
        outs[path] = [result["out"] for result in results]
        for ws in vruns.workspaces:
            assert ws.buffers.damaged_guards() == [], ws.buffers.damaged_guards()
        with pytest.raises(MoKCapacityError, match="schedule_capacity_multiplier"):
            vruns.workspaces[0].check_errors()
    for rank, (got, want) in enumerate(zip(outs["megakernel"], outs["stage1"])):
        assert torch.isfinite(got.float()).all(), (
            f"rank {rank}: a dropped slot's poison reached out"
        )
        err = relative_error(got.double(), want.double())
        assert err < 1e-2, (
            f"rank {rank}: the megakernel's output differs from stage 1's ({err:.2e})"
        )


# ------------------------------------------------------------------------------ timeouts
# A child script's imports, and its last lines: `call` (a pass that should time out) and what
# failed.
_CHILD_HEAD = """
import torch
from mok_megatron import functional as F
from mok_megatron.ops import interleave_gate_up
from mok_megatron.ops.moe import check_mega_error
from mok_megatron.testing import random_moe_problem
"""
_RUN_AND_REPORT = """
try:
    {call}
    torch.cuda.synchronize()
    print("NO-TIMEOUT", flush=True)
except Exception as exc:
    print("LAUNCH-FAILED", type(exc).__name__, flush=True)
    try:
        check_mega_error(ws.buffers.error_record)
    except RuntimeError as err:
        print("RECORD", err, flush=True)
"""
_FORWARD = (
    "F.forward(config, ws, sched, x, rw, None, None, None, interleave_gate_up(g, u), None, d)"
)


def _child_script(knobs: str, setup: str, call: str = _FORWARD, inter: int = 64) -> str:
    """A child's script (the timeout tests here and in test_megakernel_backward.py): 300 tokens
    of a problem with hidden 128, `inter`, 8 experts, top-2, on a megakernel workspace whose
    MoKConfig also gets `knobs` (its other fields, as keyword arguments); its schedule; `setup`
    (the fault to inject, and what must run first); then `call` and what failed."""
    return (
        _CHILD_HEAD
        + f"""
p = random_moe_problem([300], 128, {inter}, 8, 2, seed=1)
x, topk, rw, (g, u, d), _ = p.local(0, torch.bfloat16, "cuda")
config = F.MoKConfig(cuda_forward="megakernel", minibatch_size=128, {knobs})
ws = F.create_workspace(config, device="cuda", num_local_tokens=300, hidden_size=128, topk=2,
                        num_experts=8, intermediate_size={inter}, backend="cuda")
sched = F.build_schedule(ws, config, topk, router_weights=rw)
{setup}
"""
        + _RUN_AND_REPORT.format(call=call)
    )


def _stalled_minibatch(knobs: str = "") -> str:
    """A child's forward whose comm CTAs never release minibatch 2; `knobs`: more MoKConfig
    fields (", name=value ...")."""
    return _child_script(f"fwd_num_comm_sms=4, fwd_rows='pull', wait_timeout_ms=1500{knobs}",
                         "ws.buffers.stall_minibatch = 2")  # fmt: skip


def _child(script: str, tmp_path) -> str:
    """Run ``script`` in a child process (its device waits time out after the
    MoKConfig.wait_timeout_ms it sets: a trap leaves the CUDA context unusable)."""
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(script))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    return proc.stdout + proc.stderr


def test_a_stalled_minibatch_times_out_naming_rank_phase_minibatch_and_counter(tmp_path):
    output = _child(_stalled_minibatch(), tmp_path)
    assert "LAUNCH-FAILED" in output, output[-3000:]
    assert "rank 0 timed out" in output and "L1 task waiting for its rows" in output, output[-3000:]
    assert "minibatch 2" in output and "arrive" in output, output[-3000:]


# A child's forward on 2 CTAs (the first pulls) whose second CTA's consumers stop at their first
# L2 task: its producer's wait for a free stage (an L2 task has 6 k-tiles, the pipeline 4 stages)
# is then the only wait left, and it must give up, not hang (as CUTLASS's own wait would).
_STALLED_CONSUMERS = _child_script(
    "fwd_num_comm_sms=1, fwd_rows='pull', wait_timeout_ms=1000",
    "ws.buffers.num_sms = 2\nws.buffers.stall_l2_cta = 1",
    inter=384,
)


def test_consumers_that_stop_time_out_in_their_producers_slot_wait(tmp_path):
    output = _child(_STALLED_CONSUMERS, tmp_path)
    assert "LAUNCH-FAILED" in output, output[-3000:]
    assert "rank 0 timed out after 3000 ms" in output, output[-3000:]  # depth 3 x 1000 ms
    assert "a producer waiting for a free pipeline stage" in output, output[-3000:]
    assert "stuck before its use" in output, output[-3000:]


_STALLED_RANK = """
import torch
from mok_megatron import functional as F
from mok_megatron.ops import interleave_gate_up
from mok_megatron.testing import random_moe_problem
p = random_moe_problem([64, 64], 128, 64, 8, 2, seed=1)
config = F.MoKConfig(cuda_forward="megakernel", fwd_num_comm_sms=4, wait_timeout_ms=1500)
wss = F.create_virtual_workspaces(config, 2, device="cuda", num_local_tokens=64, hidden_size=128,
                                  topk=2, num_experts=8, intermediate_size=64)
x, topk, rw, (g, u, d), _ = p.local(0, torch.bfloat16, "cuda")
sched = F.build_schedule(wss[0], config, topk, router_weights=rw)
try:  # rank 1 never runs its pass: rank 0's barrier must give up, not hang
    F.forward(config, wss[0], sched, x, rw, None, None, None, interleave_gate_up(g, u), None, d)
    torch.cuda.synchronize()
    print("NO-TIMEOUT", flush=True)
except Exception as exc:
    print("LAUNCH-FAILED", type(exc).__name__, flush=True)
"""


def test_a_stalled_virtual_rank_times_out_instead_of_hanging(tmp_path):
    output = _child(_STALLED_RANK, tmp_path)
    assert "LAUNCH-FAILED" in output, output[-3000:]
    assert "mok: rank 0 timed out after 1500 ms in phase 'schedule/routing staged'" in output, (
        output[-3000:]
    )
    assert "peer 1" in output, output[-3000:]


# ------------------------------------------------------------------------ EP 2 (two GPUs)
# Real ranks on two GPUs (run by scripts/gpu_check.sh 2 under torchrun); the same checks as the
# virtual ranks above, over NVLink peers instead of one GPU's own memory.


@pytest.mark.multigpu
@pytest.mark.usefixtures("dist_group")
@pytest.mark.parametrize("case", list(EP_CASES))
def test_ep2_megakernel_matches_oracle_reference_and_stage1(case):
    # NOTE: failures are collected, not raised early, so both ranks run the same collectives.
    tokens, shape, kwargs = EP_CASES[case]
    problem = _problem(tokens, shape, seed=21, **kwargs)
    config = F.MoKConfig(cuda_forward="megakernel", schedule_capacity_multiplier=2.0)
    mega = Run(problem, "cuda", config=config, form="fused_auto")
    failures = [] if mega.ws.backend.path(mega.ws) == "megakernel" else ["not the megakernel"]
    sched, got = mega()
    failures += _schedule_failures(sched, problem, mega.ws)
    failures += _check_accuracy(problem, got)
    failures += _check_against_reference(problem, got, config, form="fused")
    stage1 = F.MoKConfig(cuda_forward="stage1", schedule_capacity_multiplier=2.0)
    _, want = Run(problem, "cuda", config=stage1, form="fused_auto")()
    # Stage 1 sums a token's slots rank by rank: the output within tolerance, gradients bitwise.
    failures += [f"{name} differs from stage 1" for name in _bitwise_equal(want, got)
                 if name != "out"]  # fmt: skip
    assert not failures, f"rank {dist.get_rank()}: {failures}"


@pytest.mark.multigpu
@pytest.mark.usefixtures("dist_group")
@pytest.mark.parametrize("case", ["all_to_one_expert", "uneven"])
def test_ep2_megakernel_rounds_match_oracle(case):
    tokens, shape, kwargs = EP_CASES[case]
    problem = _problem(tokens, shape, seed=37, **kwargs)
    config = F.MoKConfig(cuda_forward="megakernel", schedule_capacity_multiplier=2.0,
                         minibatch_size=128, macrobatch_size=256)  # fmt: skip
    run = Run(problem, "cuda", config=config, form="fused_auto")
    _, got = run()
    failures = [] if run.ws.buffers.mega.num_rounds > 1 else ["expected several rounds"]
    failures += _check_accuracy(problem, got)
    failures += _check_against_reference(problem, got, config, form="fused")
    assert not failures, f"rank {dist.get_rank()}: {failures}"


@pytest.mark.multigpu
@pytest.mark.usefixtures("dist_group")
def test_ep2_megakernel_repeats_bitwise_replays_in_a_graph_without_host_sync():
    problem = _problem([170, 130], SHAPES["qwen3-30b-a3b"], seed=9, shared_inter=64)
    run = Run(problem, "cuda", config=MEGA, form="fused_auto")
    _, first = run()
    _assert_repeats_bitwise(run, first, 4)
    _graph_check(run)
    _no_sync_check(run)
