"""The megakernel ops' fakes (meta shapes, no GPU): the timeline's per-CTA rows follow the
launch's grid, ``num_sms`` rounded down to whole clusters of ``cluster`` CTAs (csrc/apis/
moe_mega.cpp, mega_grid), and the phases of the error record name the cluster mailbox. Skipped
unless the locally built extension provides the ops."""

from __future__ import annotations

import pytest
import torch

from mok_megatron import ops
from mok_megatron.ops import moe as mops

pytestmark = pytest.mark.skipif(
    not (ops.extension_available() and hasattr(torch.ops.mok, "moe_mega_backward")),
    reason=f"mok megakernel ops not built: {ops.extension_error() or 'op missing'}",
)


@pytest.mark.parametrize("num_sms,cluster,grid", [(33, 1, 33), (33, 2, 32), (66, 2, 66)])
def test_backward_timeline_rows_are_the_grid_in_whole_clusters(num_sms, cluster, grid):
    hidden, inter, experts, tokens, topk, capacity = 256, 128, 4, 64, 2, 160
    meta = {"device": "meta", "dtype": torch.bfloat16}
    shape = mops.moe_mega_shape(capacity, experts, hidden, inter, 128, 131072)
    ring = shape.ring_rows
    outs = mops.moe_mega_backward(
        torch.empty(tokens, hidden, **meta), torch.empty(tokens, topk, dtype=torch.int64,
                                                         device="meta"),
        {name: torch.empty(1, device="meta") for name in mops.mega_plan_fields()},
        torch.empty(ring, inter, **meta), torch.empty(ring, 2 * inter, **meta),
        torch.empty(experts, 2 * inter, hidden, **meta), torch.empty(experts, hidden, inter, **meta),
        None, [0] * len(mops.comm_fields()), num_experts=experts, row_capacity=capacity,
        minibatch=128, macrobatch=131072, num_comm_sms=2, num_sms=num_sms, trace=True,
        cluster=cluster,
    )  # fmt: skip
    assert outs["trace_ctas"].shape == (grid, len(mops.MEGA_TRACE_CTA_FIELDS))
    assert outs["trace_tasks"].shape == (1, shape.max_tasks, len(mops.MEGA_TRACE_TASK_FIELDS))
    assert outs["d_x"].shape == (tokens, hidden) and outs["d_h"].shape == (ring, 2 * inter)


def test_mailbox_and_producer_slot_phases_follow_the_others():
    """The mailbox's phases (layout/mega.cuh: 9 forward, 12 backward = 9 + kBackwardPhases) and
    the producer's slot waits' (10, 13) are named; the forward's and the backward's differ only
    by the backward's prefix."""
    forward, backward = mops.MEGA_PHASES[9], mops.MEGA_PHASES[12]
    assert "mailbox" in forward[0] and backward[0] == "backward: " + forward[0]
    assert forward[1:] == backward[1:] == ("ticket", "mailbox")
    forward, backward = mops.MEGA_PHASES[10], mops.MEGA_PHASES[13]
    assert "producer" in forward[0] and backward[0] == "backward: " + forward[0]
    assert forward[1:] == backward[1:] == ("CTA", "slot")
    for phase in (1, 2, 3):
        assert mops.MEGA_PHASES[phase + 3][0].startswith("backward: ")


def test_a_shared_memory_wait_reads_as_a_slot_and_its_use():
    """A record whose counter word is -1 (the mailbox, the producer's slots) names the slot and
    its use, not a counter word; a counter wait keeps its 'seen < expected'."""
    fields = mops.MEGA_ERROR_FIELDS
    slot = dict.fromkeys(fields, 0) | {"timed_out": 1, "phase": 10, "index": 7, "counter": -1,
                                        "seen": 2, "expected": 5, "timeout_ms": 4}  # fmt: skip
    with pytest.raises(RuntimeError, match=r"CTA 7\): slot 2 stuck before its use 5"):
        mops.check_mega_error(torch.tensor([slot[f] for f in fields], dtype=torch.int32))
    rows = slot | {"phase": 1, "counter": 40, "seen": 3, "expected": 4}
    with pytest.raises(RuntimeError, match=r"counter arrive \(word 40\) = 3 < 4"):
        mops.check_mega_error(torch.tensor([rows[f] for f in fields], dtype=torch.int32))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("save", [False, True])
def test_forward_keeps_a_bf16_act_ring_where_something_reads_it(fp8, save):
    """The BF16 forward's L2 reads act_ring; the FP8 forward's reads act's FP8 copy, so its bf16
    act ring exists only for a backward (save, one round)."""
    hidden, inter, experts, tokens, topk, capacity = 256, 128, 4, 64, 2, 160
    meta = {"device": "meta", "dtype": torch.bfloat16}
    shape = mops.moe_mega_shape(capacity, experts, hidden, inter, 128, 131072)
    assert shape.num_rounds == 1
    weights = (torch.empty(experts, 2 * inter, hidden, **meta),
               torch.empty(experts, hidden, inter, **meta))  # fmt: skip
    scales = {}
    if fp8:
        weights = tuple(w.to(torch.float8_e4m3fn) for w in weights)
        scales = {"w_gate_up_scales": torch.empty(experts, 2 * inter // 128, hidden // 128,
                                                  device="meta"),
                  "w_down_scales": torch.empty(experts, hidden // 128, inter // 128,
                                               device="meta")}  # fmt: skip
    outs, _ = mops.moe_mega_forward(
        torch.empty(tokens, hidden, **meta),
        torch.empty(tokens, topk, dtype=torch.int64, device="meta"),
        torch.empty(tokens, topk, dtype=torch.float32, device="meta"), *weights, None,
        {name: torch.empty(1, device="meta") for name in mops.mega_plan_fields()},
        [0] * len(mops.comm_fields()), num_experts=experts, row_capacity=capacity,
        token_capacity=tokens, minibatch=128, macrobatch=131072, num_comm_sms=2, num_sms=8,
        save=save, keep_y=False, **scales,
    )  # fmt: skip
    kept = not fp8 or save
    assert outs["act_ring"].shape == ((shape.ring_rows if kept else 0), inter)
    assert outs["x_ring"].shape[0] == (0 if fp8 else shape.ring_rows)


def test_backward_in_rounds_returns_d_x_from_round_0s_call_only():
    """A backward of several macrobatch rounds calls the op once per round, the last first; the
    call of round 0 sums the slots into d_x, the others return it [0, H]; each returns its
    round's rows and its round of the timeline."""
    hidden, inter, experts, tokens, topk, capacity, macrobatch = 256, 128, 4, 64, 2, 512, 256
    meta = {"device": "meta", "dtype": torch.bfloat16}
    shape = mops.moe_mega_shape(capacity, experts, hidden, inter, 128, macrobatch)
    assert shape.num_rounds == 2
    ring = shape.ring_rows
    for round_index, d_x_rows in ((1, 0), (0, tokens)):
        outs = mops.moe_mega_backward(
            torch.empty(tokens, hidden, **meta),
            torch.empty(tokens, topk, dtype=torch.int64, device="meta"),
            {name: torch.empty(1, device="meta") for name in mops.mega_plan_fields()},
            torch.empty(ring, inter, **meta), torch.empty(ring, 2 * inter, **meta),
            torch.empty(experts, 2 * inter, hidden, **meta),
            torch.empty(experts, hidden, inter, **meta), None, [0] * len(mops.comm_fields()),
            num_experts=experts, row_capacity=capacity, minibatch=128, macrobatch=macrobatch,
            num_comm_sms=2, num_sms=8, round=round_index,
        )  # fmt: skip
        assert outs["d_x"].shape == (d_x_rows, hidden)
        assert outs["d_rows"].shape == (ring, hidden) and outs["d_row_w"].shape == (ring,)


@pytest.mark.parametrize("keep_rings", [False, True])
def test_forward_in_rounds_keeps_its_rings_only_when_asked(keep_rings):
    """A forward of several rounds that saves keeps the received tokens; with keep_rings also
    its act and h rings (the backward megakernel in rounds)."""
    hidden, inter, experts, tokens, topk, capacity, macrobatch = 256, 128, 4, 64, 2, 512, 256
    meta = {"device": "meta", "dtype": torch.bfloat16}
    shape = mops.moe_mega_shape(capacity, experts, hidden, inter, 128, macrobatch)
    assert shape.num_rounds == 2
    outs, _ = mops.moe_mega_forward(
        torch.empty(tokens, hidden, **meta),
        torch.empty(tokens, topk, dtype=torch.int64, device="meta"),
        torch.empty(tokens, topk, dtype=torch.float32, device="meta"),
        torch.empty(experts, 2 * inter, hidden, **meta),
        torch.empty(experts, hidden, inter, **meta), None,
        {name: torch.empty(1, device="meta") for name in mops.mega_plan_fields()},
        [0] * len(mops.comm_fields()), num_experts=experts, row_capacity=capacity,
        token_capacity=tokens, minibatch=128, macrobatch=macrobatch, num_comm_sms=2, num_sms=8,
        save=True, keep_y=False, keep_rings=keep_rings,
    )  # fmt: skip
    assert outs["x_recv"].shape == (tokens, hidden)
    assert outs["act_ring"].shape == (shape.ring_rows, inter)
    assert outs["h_ring"].shape == ((shape.ring_rows if keep_rings else 0), 2 * inter)


@pytest.mark.parametrize("tokens", [8192, 16384])
def test_auto_order_block_takes_8_only_where_a_wave_covers_its_n_tiles(tokens):
    """layout::auto_order_block (MoKConfig.megakernel_order_block='auto') on the benchmark shapes
    at one rank and 132 CTAs: 8 for deepseek-v3 (2 or 4 m-tiles an expert, 16 n-tiles: a wave
    covers a block of 8's L1 tasks, whose A tiles it then reads from HBM once), 16 for
    qwen3-30b-a3b (a tie) and mixtral-8x7b (16 or 32 m-tiles an expert share each weight tile
    more in 16); arguments it cannot use raise."""
    shapes = {"qwen3-30b-a3b": (768, 128, 8, 16), "deepseek-v3": (2048, 256, 8, 8),
              "mixtral-8x7b": (14336, 8, 2, 16)}  # fmt: skip
    for name, (inter, experts, topk, block) in shapes.items():
        got = mops.moe_mega_order_block(tokens * topk, experts, 2 * inter // 256, 132)
        assert got == block, name
    assert mops.moe_mega_order_block(0, 4, 1, 1) in (8, 16)  # no rows: still a valid block
    with pytest.raises(RuntimeError, match="moe_mega_order_block: bad arguments"):
        mops.moe_mega_order_block(100, 0, 1, 132)
