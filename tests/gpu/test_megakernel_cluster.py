"""The megakernels in clusters of 2 CTAs (``MoKConfig.megakernel_cluster=2``) on one GPU.

The two CTAs of a cluster run n-tiles 2 n and 2 n + 1 of one m-tile and share its A tile by TMA
multicast; the first takes the tickets and posts them to the second (roles/megakernel_cluster.cuh).
Every tile is still computed by one CTA over K in the same order, so the forward's output and the
backward megakernel's gradients must be bitwise those of the same megakernels without clusters,
and the output bitwise stage 1's (tests/gpu/test_megakernel.py says why). Checked at EP 1 on the
scaled benchmark shapes, a shape whose GEMMs have odd n-tile counts (a cluster task whose second
tile lies past the last one), m-tiles of at most 64 rows, virtual ranks (W = 2: 66 CTAs each;
W = 4: 33, rounded down to 32); a stalled minibatch still times out naming the L1 wait, not the
mailbox. Repeats, graph replay and no host sync in clusters: test_megakernel.py's
test_bitwise_repeatable_graph_replay_and_no_host_sync.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_cuda_backend import (
    SHAPES,
    Run,
    VirtualRuns,
    _bitwise_equal,
    _check_accuracy,
    _problem,
    _virtual_run_failures,
)
from test_megakernel import (
    STAGE1,
    _assert_equal_to_stage1,
    _child,
    _mega_and_stage1,
    _stalled_minibatch,
)

from mok_megatron import functional as F
from mok_megatron.functional.cuda.mega import unavailable_here

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(unavailable_here()), reason=f"megakernel: {unavailable_here()}"),
]

MEGA = F.MoKConfig(cuda_forward="megakernel", fwd_num_comm_sms=8, bwd_num_comm_sms=8)
MEGA2 = dataclasses.replace(MEGA, megakernel_cluster=2)

CASES = {
    **{name: ([300], shape) for name, shape in SHAPES.items()},
    # hidden 640, inter 384: L1 (2I) and L2 (H) have 3 n-tiles each, the L2 dgrad (I) 2
    "odd_n_tiles": ([260], (640, 384, 8, 4, 0)),
    # ~175 rows per expert: about half the m-tiles have at most 64 rows
    "short_m_tiles": ([700], (256, 160, 16, 4, 0)),
}


def _assert_same_as_without_clusters(problem, got):
    _, plain = Run(problem, "cuda", config=MEGA, form="fused_auto")()
    bad = _bitwise_equal(plain, got)
    assert not bad, f"clusters of 2 differ from the megakernel without clusters in {bad}"


@pytest.mark.parametrize("case", list(CASES))
def test_clusters_of_two_equal_the_megakernel_without_them_and_stage1(case):
    tokens, shape = CASES[case]
    problem = _problem(tokens, shape, seed=31)
    mega, _, got, want = _mega_and_stage1(problem, MEGA2, STAGE1)
    assert mega.ws.config.megakernel_cluster == 2
    failures = _check_accuracy(problem, got)
    assert not failures, failures
    _assert_equal_to_stage1(got, want)
    _assert_same_as_without_clusters(problem, got)


# Cases where every cluster takes more tickets than its ticket queue and mailbox hold (4 each),
# over the launch: many m-tiles in one round, or rounds of a few tickets each. The cases above
# take at most about 4; with the second CTA's ticket-queue releases sent to the first CTA
# (fixed), these hung in an unbounded wait after the fourth ticket.
MANY_TICKETS = {
    "one_round": ([3000], {}),
    "three_rounds": ([1500], {"macrobatch_size": 4096, "minibatch_size": 128}),
}


@pytest.mark.parametrize("case", list(MANY_TICKETS))
def test_clusters_of_two_take_more_tickets_than_their_queues_hold(case):
    tokens, knobs = MANY_TICKETS[case]
    shape = SHAPES["qwen3-30b-a3b"]
    topk = shape[3]
    problem = _problem(tokens, shape, seed=37)
    config = dataclasses.replace(MEGA, **knobs)
    mega = Run(problem, "cuda", config=dataclasses.replace(config, megakernel_cluster=2),
               form="fused_auto")  # fmt: skip
    clusters = torch.cuda.get_device_properties(0).multi_processor_count // 2  # at most
    # at least: every m-tile holds at most 128 rows, one cluster task per m-tile and GEMM (each
    # GEMM has one pair of n-tiles), and every cluster takes one ticket past each round's tasks
    per_cluster = 2 * -(-sum(tokens) * topk // 128) / clusters + mega.ws.buffers.mega.num_rounds
    assert per_cluster > 4, per_cluster
    _, got = mega()
    failures = _check_accuracy(problem, got)
    assert not failures, failures
    _, plain = Run(problem, "cuda", config=config, form="fused_auto")()
    bad = _bitwise_equal(plain, got)
    assert not bad, f"clusters of 2 differ from the megakernel without clusters in {bad}"


@pytest.mark.parametrize("w", [2, 4])
def test_virtual_ranks_in_clusters_of_two_match_oracle_and_repeat_bitwise(w):
    tokens = [150, 90, 33, 81][:w]
    problem = _problem(tokens, SHAPES["qwen3-30b-a3b"], seed=47)
    config = F.MoKConfig(cuda_forward="megakernel", fwd_num_comm_sms=4, bwd_num_comm_sms=4,
                         schedule_capacity_multiplier=float(w), minibatch_size=128,
                         megakernel_cluster=2)  # fmt: skip
    vruns = VirtualRuns(problem, w, config=config, form="fused_auto")
    assert all(ws.backend.path(ws) == "megakernel" for ws in vruns.workspaces)
    failures = _virtual_run_failures(problem, vruns)
    assert not failures, failures


def test_a_stalled_minibatch_in_clusters_times_out_naming_the_rows_not_the_mailbox(tmp_path):
    """The mailbox waits (4x the timeout) outlast the L1 row wait (1x) that a stalled minibatch
    leaves waiting: the record names the cause."""
    output = _child(_stalled_minibatch(", megakernel_cluster=2"), tmp_path)
    assert "LAUNCH-FAILED" in output, output[-3000:]
    assert "L1 task waiting for its rows" in output and "minibatch 2" in output, output[-3000:]
    assert "mailbox" not in output, output[-3000:]
