"""Thin wrappers over the stage-1 expert-parallel MoE ops (``torch.ops.mok.moe_*``), with fakes.

The ops work on one symmetric workspace described by ``comm``, a list of ints whose fields are
defined once in C++ (``csrc/apis/comm.h``) and built here by name (``make_comm``). Those marked
*collective* must be called by every rank in the same order. None of them synchronises the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mok_megatron.ops._extension import extension_available

#: The torch.ops.mok ops with CUDA kernels this module wraps (each wrapper has the op's name):
#: what the CUDA backend needs from mok_megatron._C (besides moe_workspace_layout, host-only).
CUDA_OPS = (
    "moe_gather_routing",
    "moe_build_schedule",
    "moe_dispatch",
    "moe_combine",
    "moe_combine_slots",
    "moe_gather_rows",
    "moe_fp8_pack_rows",
    "moe_gather_rows_fp8",
    "moe_swiglu",
    "moe_swiglu_backward",
    "moe_swiglu_interleaved",
    "moe_swiglu_interleaved_backward",
    "moe_row_grad",
    "moe_accumulate_groups",
)

#: The megakernel path's ops (each wrapper below has the op's name): what the CUDA backend's
#: megakernel path needs besides CUDA_OPS.
MEGA_OPS = ("moe_mega_plan", "moe_mega_forward", "moe_mega_backward")

__all__ = [
    "MEGA_OPS", "moe_mega_plan", "moe_mega_forward", "moe_mega_backward", "mega_plan_fields",
    "mega_forward_fields", "mega_backward_fields",
    "MoeWorkspaceLayout", "moe_workspace_layout", "moe_fp8_packed_row_width", "MegaShape",
    "moe_mega_shape", "moe_mega_order_block", "make_comm",
    "comm_field", "comm_fields", "MEGA_ERROR_FIELDS", "MEGA_TRACE_CTA_FIELDS",
    "MEGA_TRACE_TASK_FIELDS", "check_mega_error", "routing_to_topk", "CUDA_OPS", *CUDA_OPS,
]  # fmt: skip

#: Region names in the order of ``mok::layout::Region`` (csrc/include/mok/layout/workspace.cuh).
REGIONS = (
    "routing_topk", "routing_weights", "tokens", "combine", "slot_values", "slot_rows", "counters",
)  # fmt: skip


@dataclass(frozen=True)
class MoeWorkspaceLayout:
    """One rank's symmetric workspace as the C++ layout header defines it: its byte size, each
    region's byte offset, and the guard of ``guard_bytes`` after each region (``guards``: region
    name -> guard offset), which no kernel writes."""

    total_bytes: int
    guard_bytes: int
    offsets: dict[str, int]
    guards: dict[str, int]


def moe_workspace_layout(
    num_ranks: int, max_tokens: int, topk: int, hidden: int, slot_rows: bool = False,
    counter_words: int = 0,
) -> MoeWorkspaceLayout:  # fmt: skip
    """The layout the shared C++ header defines; Python never recomputes an offset."""
    total, guard, *rest = torch.ops.mok.moe_workspace_layout(
        num_ranks, max_tokens, topk, hidden, int(slot_rows), counter_words
    )
    n = len(REGIONS)
    return MoeWorkspaceLayout(
        int(total), int(guard), dict(zip(REGIONS, map(int, rest[:n]))),
        dict(zip(REGIONS, map(int, rest[n:]))),
    )  # fmt: skip


@dataclass(frozen=True)
class MegaShape:
    """The megakernel's sizes (``mok::layout::MegaShape``, csrc/include/mok/layout/mega.cuh)."""

    padded_rows: int
    num_rounds: int
    ring_rows: int
    num_minibatches: int
    max_tiles: int
    l1_ntiles: int
    l2_ntiles: int
    counter_words: int
    max_tasks: int


def moe_mega_shape(row_capacity, num_local_experts, hidden, inter, minibatch, macrobatch):
    """Sizes of the ring, the rounds, the tiles and the counters, from the C++ header."""
    values = torch.ops.mok.moe_mega_shape(
        row_capacity, num_local_experts, hidden, inter, minibatch, macrobatch
    )
    return MegaShape(*map(int, values))


def moe_mega_order_block(routed_rows, num_local_experts, l1_ntiles, num_ctas) -> int:
    """The m-tiles per block of the forward megakernel's task order (8 or 16) that
    ``MoKConfig.megakernel_order_block='auto'`` picks for ``routed_rows`` expected on this rank's
    ``num_local_experts`` experts, ``l1_ntiles`` n-tiles of 2I and a grid of ``num_ctas``
    (mok::layout::auto_order_block: the fewer distinct bytes a wave of L1 tasks reads from
    HBM). Host arithmetic, no GPU."""
    return int(torch.ops.mok.moe_mega_order_block(routed_rows, num_local_experts, l1_ntiles,
                                                  num_ctas))  # fmt: skip


#: Words of the megakernel's error record (int32 each); mirrors mok::layout::MegaError.
MEGA_ERROR_FIELDS = (
    "timed_out", "rank", "phase", "round", "index", "counter", "seen", "expected", "timeout_ms",
)  # fmt: skip
#: The megakernel's timeline records (diagnostics, ``moe_mega_forward(..., trace=True)``): the
#: words of one CTA's and of one task's record, int64 global-timer ns unless named otherwise;
#: mirror mok::layout::MegaTraceCta / MegaTraceTask (None: a word that is not used).
MEGA_TRACE_CTA_FIELDS = ("start", "pull_ns", "barrier_ns", "end", "start_cycles", "end_cycles")
MEGA_TRACE_TASK_FIELDS = ("cta", "task", "take", "ready", "got", "mma_end", "epi_end", "stored")

#: mok::layout::MegaPhase: which wait of the megakernel timed out.
MEGA_PHASES = {
    1: ("L1 task waiting for its rows to land", "minibatch", "arrive"),
    2: ("L2 task waiting for its m-tile's L1 tasks", "m-tile", "l1_done"),
    3: ("end-of-round barrier", "round", "grid barrier"),
    4: (
        "backward: L2-dgrad (or down-weight-gradient) task waiting for its d_out rows to land",
        "minibatch",
        "arrive",
    ),
    5: ("backward: L1-dgrad task waiting for its m-tile's L2-dgrad tasks", "m-tile", "l1_done"),
    6: ("backward: end-of-round barrier", "round", "grid barrier"),
    9: ("cluster mailbox: a cluster's CTAs passing their tickets", "ticket", "mailbox"),
    10: ("a producer waiting for a free pipeline stage or ticket slot", "CTA", "slot"),
    12: ("backward: cluster mailbox: a cluster's CTAs passing their tickets", "ticket", "mailbox"),
    13: (
        "backward: a producer waiting for a free pipeline stage or ticket slot",
        "CTA",
        "slot",
    ),
}


def check_mega_error(record: torch.Tensor) -> None:
    """Raise RuntimeError naming rank, phase, minibatch / tile and counter if the megakernel's
    pinned error record says a wait timed out. Reads host memory only, so it works after the
    trap has left the CUDA context unusable."""
    values = dict(zip(MEGA_ERROR_FIELDS, record.tolist()))
    if not values["timed_out"]:
        return
    what, index_name, counter = MEGA_PHASES.get(values["phase"], ("unknown wait", "index", "?"))
    if values["counter"] < 0:  # a barrier in shared memory: its slot and the slot's use
        waited = f"{counter} {values['seen']} stuck before its use {values['expected']}"
    else:
        waited = (f"counter {counter} (word {values['counter']}) = {values['seen']} < "
                  f"{values['expected']}")  # fmt: skip
    raise RuntimeError(
        f"mok megakernel: rank {values['rank']} timed out after {values['timeout_ms']} ms in "
        f"phase '{what}' (round {values['round']}, {index_name} {values['index']}): {waited}. "
        "Did the comm CTAs run (fwd_num_comm_sms), or is a rank stalled? Raise "
        "MoKConfig.wait_timeout_ms if it is only slow."
    )


_COMM_FIELDS: tuple[str, ...] | None = None


def comm_fields() -> tuple[str, ...]:
    """The names of ``comm``'s ints in order (defined once in csrc/apis/comm.h)."""
    global _COMM_FIELDS
    if _COMM_FIELDS is None:
        _COMM_FIELDS = tuple(torch.ops.mok.moe_comm_fields())
    return _COMM_FIELDS


def make_comm(**values: int) -> list[int]:
    """The ``comm`` list from its fields by name; every field must be given, none unknown."""
    names = comm_fields()
    missing, unknown = set(names) - set(values), set(values) - set(names)
    if missing or unknown:
        raise ValueError(f"make_comm: missing {sorted(missing)}, unknown {sorted(unknown)}")
    return [int(values[name]) for name in names]


def comm_field(comm: list[int], name: str) -> int:
    """One field of a ``comm`` list, by name."""
    return comm[comm_fields().index(name)]


def moe_gather_routing(topk: torch.Tensor, weights: torch.Tensor, comm: list[int]):
    """topk: [T, K] int64, weights: [T, K] float32 → every rank's, [W, T_max, K] each. Collective."""
    return torch.ops.mok.moe_gather_routing(topk, weights, comm)


def routing_to_topk(probs: torch.Tensor, routing_map: torch.Tensor, topk: int):
    """One kernel: Megatron's router output (probs [T, E] float32 / bf16 / fp16, routing_map
    [T, E] bool, CUDA) → (topk_experts [T, K] int64, each token's chosen experts in ascending id,
    the first K of them, -1 for an empty slot; router_weights [T, K] float32, their probabilities,
    0 for an empty slot). Differentiable to ``probs``; no host sync."""
    return _RoutingToTopk.apply(probs.contiguous(), routing_map.contiguous(), topk)


class _RoutingToTopk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, probs, routing_map, topk):
        experts, weights = torch.ops.mok.routing_to_topk(probs, routing_map, topk)
        ctx.mark_non_differentiable(experts)
        ctx.save_for_backward(experts)
        ctx.probs_meta = (probs.shape, probs.dtype)
        return experts, weights

    @staticmethod
    def backward(ctx, d_experts, d_weights):
        if d_weights is None:
            return None, None, None
        (experts,) = ctx.saved_tensors
        (num_tokens, num_experts), dtype = ctx.probs_meta
        # Each slot's gradient goes to its expert's column (the experts of a token are distinct);
        # empty slots go to a spare last column, dropped: what gather's backward gives after
        # masking the empty slots, without an accumulation.
        cols = torch.where(experts < 0, num_experts, experts)
        d_probs = d_weights.new_zeros(num_tokens, num_experts + 1, dtype=dtype)
        d_probs.scatter_(1, cols, d_weights.to(dtype))
        return d_probs[:, :num_experts], None, None


def moe_build_schedule(global_topk, rank, num_experts, row_capacity, token_capacity):
    """global_topk: [W, T_max, K] int64 → the 13 schedule tensors after global_topk, in
    ``MoKSchedule.INTEGER_FIELDS`` order."""
    return torch.ops.mok.moe_build_schedule(
        global_topk, rank, num_experts, row_capacity, token_capacity
    )


def moe_dispatch(x: torch.Tensor, recv_token_src: torch.Tensor, comm: list[int]) -> torch.Tensor:
    """x: [T, H] bf16 → recv: [C_tok, H] bf16, each received token pulled once. Collective."""
    return torch.ops.mok.moe_dispatch(x, recv_token_src, comm)


def moe_combine(rows, token_rows, recv_token_src, slot_weights, send_to, shared_out, num_tokens,
                comm, acc=None, row_begin=0, first=True, last=True,
                rows2=None) -> torch.Tensor:  # fmt: skip
    """rows: [P, H] bf16; token_rows: [C_tok, K] int64 into rows; slot_weights: [W, T_max, K]
    float32 or None; shared_out: [T, H] bf16 or None → out: [T, H] bf16. Collective.

    Macrobatch rounds: ``rows`` holds the padded rows ``[row_begin, row_begin + P)`` and ``acc``
    ([C_tok, H] float32) carries each token's sum from round to round: a round that is not
    ``last`` adds its rows (slot order) to ``acc`` and returns an empty [0, H] tensor; the last
    round adds its rows, pushes and sums at the source (``shared_out`` counts only there).
    ``rows2`` (optional, shaped like ``rows``) is a second term per row, added in float32 right
    after ``rows`` (the backward's ``dg @ W_gate`` and ``du @ W_up`` without a bf16 add pass).
    """
    return torch.ops.mok.moe_combine(
        rows, token_rows, recv_token_src, slot_weights, send_to, shared_out, num_tokens, comm,
        acc, row_begin, first, last, rows2,
    )  # fmt: skip


def moe_combine_slots(row_values, token_rows, recv_token_src, send_to, num_tokens, comm):
    """row_values: [P] float32 → [T, K] float32, each slot's value from its rank. Collective."""
    return torch.ops.mok.moe_combine_slots(
        row_values, token_rows, recv_token_src, send_to, num_tokens, comm
    )


def moe_gather_rows(src: torch.Tensor, row_tok: torch.Tensor) -> torch.Tensor:
    """src: [C, H] bf16, row_tok: [P] int64 → [P, H]: src[row_tok[p]], zeros where it is -1."""
    return torch.ops.mok.moe_gather_rows(src, row_tok)


def moe_fp8_packed_row_width(hidden: int) -> int:
    """The packed FP8 token row's width in bf16 (the C++ format header's; never recomputed)."""
    return int(torch.ops.mok.moe_fp8_packed_row_width(hidden))


def moe_fp8_pack_rows(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(1, 128)-quantised rows, data [R, H] float8_e4m3fn and scales [R, H / 128] float32 →
    packed [R, moe_fp8_packed_row_width(H)] bf16: each row's data bytes, then its scales (what
    ``moe_dispatch`` moves: FP8 tokens over the peers' links, about half the bf16 bytes)."""
    return torch.ops.mok.moe_fp8_pack_rows(data, scales)


def moe_gather_rows_fp8(packed: torch.Tensor, row_tok: torch.Tensor, hidden: int):
    """packed: [C, moe_fp8_packed_row_width(H)] bf16, row_tok: [P] int64 → (data [P, H]
    float8_e4m3fn, scales [P, H / 128] float32): packed[row_tok[p]] split, and where row_tok[p]
    is -1 an all-zero row's quantisation (data 0, scales 1), as quantising the gathered rows."""
    return torch.ops.mok.moe_gather_rows_fp8(packed, row_tok, hidden)


def moe_swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """g, u: [P, I] bf16 (gate and up outputs; rows may be strided, e.g. the two halves of one
    [P, 2I] tensor) → silu(g) * u: [P, I] bf16."""
    return torch.ops.mok.moe_swiglu(g, u)


def moe_swiglu_backward(da: torch.Tensor, g: torch.Tensor, u: torch.Tensor):
    """da: [P, I], g, u: [P, I] bf16 → (dg, du): [P, I] bf16 each."""
    return torch.ops.mok.moe_swiglu_backward(da, g, u)


def moe_swiglu_interleaved(h: torch.Tensor) -> torch.Tensor:
    """h: [P, 2I] bf16, gate and up columns interleaved in blocks of 8 (the output of the fused
    gate/up weight, ``ops.interleave_gate_up``; rows may be strided) → silu(gate) * up: [P, I]."""
    return torch.ops.mok.moe_swiglu_interleaved(h)


def moe_swiglu_interleaved_backward(da: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """da: [P, I], h: [P, 2I] interleaved bf16 → d_h: [P, 2I] bf16, interleaved like h."""
    return torch.ops.mok.moe_swiglu_interleaved_backward(da, h)


def moe_accumulate_groups(total, part, offs, first_round, round_index: int) -> None:
    """One round's weight gradient into the total, touching only the groups that need it.

    total, part: [G, M, N] bf16 (``part`` may be ``total`` itself); offs: [G] int32 group ends in
    the round's window; first_round: [G] int32, the round of each group's first row (-1: no
    rows). In place: groups without rows are zeroed in round 0, a group's first round is copied,
    later rounds are added (bf16 rounding, round order).
    """
    torch.ops.mok.moe_accumulate_groups(total, part, offs, first_round, round_index)


# ------------------------------------------------------------------------------- megakernel
_MEGA_FIELDS: dict[str, tuple[str, ...]] = {}


def mega_plan_fields() -> tuple[str, ...]:
    """Names of the schedule and plan tensors of the megakernel ops (csrc/apis/moe_mega.h)."""
    if "plan" not in _MEGA_FIELDS:
        _MEGA_FIELDS["plan"] = tuple(torch.ops.mok.moe_mega_plan_fields())
    return _MEGA_FIELDS["plan"]


def mega_forward_fields() -> tuple[str, ...]:
    """Names of the forward outputs of ``moe_mega_forward`` (csrc/apis/moe_mega.h)."""
    if "forward" not in _MEGA_FIELDS:
        _MEGA_FIELDS["forward"] = tuple(torch.ops.mok.moe_mega_forward_fields())
    return _MEGA_FIELDS["forward"]


def mega_backward_fields() -> tuple[str, ...]:
    """Names of the outputs of ``moe_mega_backward`` (csrc/apis/moe_mega.h)."""
    if "backward" not in _MEGA_FIELDS:
        _MEGA_FIELDS["backward"] = tuple(torch.ops.mok.moe_mega_backward_fields())
    return _MEGA_FIELDS["backward"]


def moe_mega_plan(topk, router_weights, comm, num_experts, row_capacity, token_capacity, inter,
                  minibatch, macrobatch) -> dict[str, torch.Tensor]:  # fmt: skip
    """Gather the routing and router weights, build the schedule and the device plan. Collective.

    topk: [T, K] int64, router_weights: [T, K] float32 → {name: tensor} (``mega_plan_fields``).
    """
    values = torch.ops.mok.moe_mega_plan(
        topk, router_weights, comm, num_experts, row_capacity, token_capacity, inter, minibatch,
        macrobatch,
    )  # fmt: skip
    return dict(zip(mega_plan_fields(), values))


def moe_mega_forward(x, topk, router_weights, w_gate_up, w_down, shared_out, plan, comm, *,
                     num_experts, row_capacity, token_capacity, minibatch, macrobatch,
                     num_comm_sms, num_sms, save, keep_y=True, stall_minibatch=-1,
                     trace=False, cluster=1, stall_l2_cta=-1, w_gate_up_scales=None,
                     w_down_scales=None, rows_in_place=False, keep_rings=False,
                     order_block=0):  # fmt: skip
    """One forward pass in one op: the plan (unless ``plan``, a ``moe_mega_plan`` dict, is
    given), staging (none at one rank: the megakernel reads x in place), the megakernel, the
    slot-ordered sum at the source. Collective.

    x: [T, H] bf16; topk / router_weights: [T, K]; w_gate_up: [E_l, 2I, H] (interleaved);
    w_down: [E_l, H, I]; shared_out: [T, H] or None. Returns (forward outputs, plan), dicts by
    name (``mega_forward_fields``, ``mega_plan_fields``). ``save``: keep what a backward needs:
    in one round the rings (``x_ring``, ``act_ring``, ``h_ring``; the caller may drop
    ``x_ring``) and the L2 output rows ``y_rows`` when ``keep_y`` (else [0, H]: the L2 epilogue
    stores each row only to its source slot); in more rounds, the received tokens ``x_recv``,
    and with ``keep_rings`` (bf16) also ``act_ring`` and ``h_ring``, which end holding the last
    round that has rows (the backward in rounds takes that round first, without recomputing
    it).
    ``stall_minibatch`` (tests only): the comm CTAs never release that minibatch of round 0, so
    its tiles time out; ``stall_l2_cta`` (tests only): that CTA's consumers stop at their first
    L2 task, so its producer's wait for a free pipeline stage times out. ``trace``
    (diagnostics, scripts/megakernel_trace.py): the outputs ``trace_ctas`` / ``trace_tasks``
    hold the kernel's timeline (``MEGA_TRACE_CTA_FIELDS`` / ``MEGA_TRACE_TASK_FIELDS``), else
    [0]. ``cluster``: CTAs per cluster of the megakernel (1 or 2,
    ``MoKConfig.megakernel_cluster``); its grid is ``num_sms`` (0: every SM) rounded down to
    whole clusters. ``rows_in_place`` (``MoKConfig.fwd_rows``; one rank, ``cluster`` 1; FP8:
    one round, or ``save`` False): the L1 tiles read their rows from the token rows themselves
    (FP8: x quantised in place and its scales; the producer warpgroup copies them into each
    stage) and no CTA pulls; ``x_ring`` is then [0, H].

    FP8 experts (the FP8 megakernel): ``w_gate_up`` / ``w_down`` are the weights' (128, 128)-block
    e4m3 copies and ``w_gate_up_scales`` [E_l, 2I / 128, H / 128] / ``w_down_scales``
    [E_l, H / 128, I / 128] their scales (``functional.fp8_weights.fp8_weight``); x is quantised
    in (1, 128) blocks in the op and the pass computes stage 1's FP8 forward; ``x_ring`` is then
    [0, H] (the ring holds FP8 rows), and ``act_ring`` [0, I] unless a backward will read it
    (``save`` in one round: its L2 reads act's FP8 copy, the bf16 act is the backward's).

    ``order_block``: the m-tiles per block of the megakernel's task order, 8 or 16, or 0 for the
    shape's (``moe_mega_order_block`` of the rows this rank's experts are expected to get:
    ``MoKConfig.megakernel_order_block='auto'``). The outputs are the same bit for bit either
    way: it orders the tasks, and each tile is one CTA's, K in a fixed order.
    """
    given = [plan[name] for name in mega_plan_fields()] if plan is not None else []
    values = torch.ops.mok.moe_mega_forward(
        x, topk, router_weights, w_gate_up, w_down, shared_out, given, comm, num_experts,
        row_capacity, token_capacity, minibatch, macrobatch, num_comm_sms, num_sms, save,
        keep_y, stall_minibatch, trace, cluster, stall_l2_cta, w_gate_up_scales, w_down_scales,
        rows_in_place, keep_rings, order_block,
    )  # fmt: skip
    n = len(mega_forward_fields())
    return dict(zip(mega_forward_fields(), values[:n])), dict(zip(mega_plan_fields(), values[n:]))


def moe_mega_backward(d_out, topk, plan, act_ring, h_ring, w_gate_up, w_down, shared_dx, comm, *,
                      num_experts, row_capacity, minibatch, macrobatch, num_comm_sms, num_sms,
                      stall_minibatch=-1, trace=False, cluster=1, round=-1,
                      wgrad_down=None, wgrad_accumulate=False,
                      wgrad_interleave=False):  # fmt: skip
    """The data gradients of one forward pass in one op per macrobatch round: staging d_out
    (none at one rank: read in place), the backward megakernel (d_out rows pulled into the ring;
    the L2 dgrad with the SwiGLU backward and the router-weight gradient in its epilogue; the L1
    dgrad, its rows stored into their sources' slots), the unweighted slot sum (+
    ``shared_dx``), the rows' router-weight gradients. Collective.

    plan: the forward's ``moe_mega_plan`` dict; act_ring [ring, I] / h_ring [ring, 2I]: the
    round's activations (the forward's kept rings, or recomputed). ``round``: -1 for a plan of
    one round; with R > 1 one call per round, R - 1 first and 0 last (the first call stages
    d_out; round 0's sums the slots and adds ``shared_dx``). Returns a dict by name
    (``mega_backward_fields``): d_x [T, H] ([0, H] but in the last call), d_rows [ring, H] and
    d_h [ring, 2I] (the round's weight-gradient rows), d_row_w [ring] float32 (the round's; 0
    on padding), and the timeline and ``cluster`` as ``moe_mega_forward``'s (a round's call
    fills its round of ``trace_tasks``).

    ``wgrad_down`` [E_l, H, I] (one round, ``cluster`` 1; MoKConfig.bwd_wgrad="down"): the down
    weight's gradient d_rows^T bf16(w * a) computed inside the launch, after the data gradients'
    tasks, each tile by one CTA over the expert's rows in order (as ``grouped_gemm_tn``):
    stored into it (bf16), or with ``wgrad_accumulate`` added into it (float32: main_grad), each
    element its old value plus the tile's sum rounded once (as ``grouped_gemm_tn_accumulate``);
    ``wgrad_interleave``: its tasks among the data gradients' rather than after them.
    """
    given = [plan[name] for name in mega_plan_fields()]
    values = torch.ops.mok.moe_mega_backward(
        d_out, topk, given, act_ring, h_ring, w_gate_up, w_down, shared_dx, comm, num_experts,
        row_capacity, minibatch, macrobatch, num_comm_sms, num_sms, stall_minibatch, trace,
        cluster, round, wgrad_down, wgrad_accumulate, wgrad_interleave,
    )  # fmt: skip
    return dict(zip(mega_backward_fields(), values))


# ------------------------------------------------------------------------------------ fakes
def _mega_plan_fake(topk, router_weights, comm, num_experts, row_capacity, token_capacity,
                    inter, minibatch, macrobatch):  # fmt: skip
    w, t_max, k = (comm_field(comm, f) for f in ("num_ranks", "max_tokens", "topk"))
    e_l = num_experts // w
    shape = moe_mega_shape(row_capacity, e_l, comm_field(comm, "hidden"), inter, minibatch,
                           macrobatch)  # fmt: skip
    padded = shape.num_rounds * shape.ring_rows
    global_topk = topk.new_empty(w, t_max, k)
    sched = _build_schedule_fake(global_topk, 0, num_experts, row_capacity, token_capacity)
    i64, i32 = topk.new_empty, lambda *s: topk.new_empty(*s, dtype=torch.int32)
    plan = [
        i64(e_l), i32(e_l), i64(e_l), i32(e_l), i64(row_capacity), i64(padded),
        router_weights.new_empty(padded), i64(padded), i64(padded), i64(token_capacity, k),
        i32(shape.num_rounds), i32(shape.num_rounds, shape.max_tiles, 4),
    ]  # fmt: skip
    return [global_topk, router_weights.new_empty(w, t_max, k), *sched, i32(w * t_max * k), *plan]


def _mega_grid(like, num_sms: int, cluster: int) -> int:
    """The megakernel's grid (csrc/apis/moe_mega.cpp, mega_grid): num_sms (0: every SM of the
    device) rounded down to whole clusters. NOTE: with num_sms 0 in clusters, the op also caps the
    grid at the clusters the device holds at once, a device query the fake does not make: where
    they hold fewer CTAs than it has SMs, a traced op has fewer timeline rows than its fake."""
    grid = (
        num_sms
        if num_sms > 0
        else torch.cuda.get_device_properties(like.device).multi_processor_count
    )
    return grid // cluster * cluster


def _mega_forward_fake(x, topk, router_weights, w_gate_up, w_down, shared_out, plan, comm,
                       num_experts, row_capacity, token_capacity, minibatch, macrobatch,
                       num_comm_sms, num_sms, save, keep_y, stall_minibatch,
                       trace=False, cluster=1, stall_l2_cta=-1, w_gate_up_scales=None,
                       w_down_scales=None, rows_in_place=False, keep_rings=False,
                       order_block=0):  # fmt: skip
    inter, hidden = w_down.shape[2], x.shape[1]
    shape = moe_mega_shape(row_capacity, w_down.shape[0], hidden, inter, minibatch, macrobatch)
    ring, one = shape.ring_rows, shape.num_rounds == 1
    plan = list(plan) or _mega_plan_fake(topk, router_weights, comm, num_experts, row_capacity,
                                         token_capacity, inter, minibatch, macrobatch)  # fmt: skip
    out = [
        x.new_empty(x.shape),
        x.new_empty(0 if w_gate_up_scales is not None or rows_in_place else ring, hidden),
        x.new_empty(0 if w_gate_up_scales is not None and not (save and one) else ring, inter),
        x.new_empty(ring if (save and one) or keep_rings else 0, 2 * inter),
        x.new_empty(ring if save and one and keep_y else 0, hidden),
        x.new_empty(token_capacity if save and not one else 0, hidden),
    ]  # fmt: skip
    grid = _mega_grid(x, num_sms, cluster) if trace else 0
    i64 = lambda *s: x.new_empty(*s, dtype=torch.int64)  # noqa: E731
    out += [
        i64(grid if trace else 0, len(MEGA_TRACE_CTA_FIELDS)),
        i64(shape.num_rounds if trace else 0, shape.max_tasks, len(MEGA_TRACE_TASK_FIELDS)),
    ]
    return out + plan


def _mega_backward_fake(d_out, topk, plan, act_ring, h_ring, w_gate_up, w_down, shared_dx, comm,
                        num_experts, row_capacity, minibatch, macrobatch, num_comm_sms, num_sms,
                        stall_minibatch, trace=False, cluster=1, round=-1,
                        wgrad_down=None, wgrad_accumulate=False,
                        wgrad_interleave=False):  # fmt: skip
    inter, hidden = w_down.shape[2], d_out.shape[1]
    shape = moe_mega_shape(row_capacity, w_down.shape[0], hidden, inter, minibatch, macrobatch)
    ring = shape.ring_rows
    out = [d_out.new_empty(d_out.shape[0] if round <= 0 else 0, hidden),
           d_out.new_empty(ring, hidden),
           d_out.new_empty(ring, 2 * inter), d_out.new_empty(ring, dtype=torch.float32)]  # fmt: skip
    grid = _mega_grid(d_out, num_sms, cluster) if trace else 0
    i64 = lambda *s: d_out.new_empty(*s, dtype=torch.int64)  # noqa: E731
    return out + [
        i64(grid if trace else 0, len(MEGA_TRACE_CTA_FIELDS)),
        i64(shape.num_rounds if trace else 0, shape.max_tasks, len(MEGA_TRACE_TASK_FIELDS)),
    ]


def _routing_to_topk_fake(probs, routing_map, topk):
    shape = (routing_map.shape[0], topk)
    return (routing_map.new_empty(shape, dtype=torch.int64),
            routing_map.new_empty(shape, dtype=torch.float32))  # fmt: skip


def _gather_routing_fake(topk, weights, comm):
    shape = tuple(comm_field(comm, f) for f in ("num_ranks", "max_tokens", "topk"))
    return topk.new_empty(shape), weights.new_empty(shape)


def _build_schedule_fake(global_topk, rank, num_experts, row_capacity, token_capacity):
    w, t_max, k = global_topk.shape
    i64 = global_topk.new_empty
    return [
        *(i64(row_capacity) for _ in range(5)), i64(num_experts // w + 1), i64(1),
        i64(token_capacity), i64(w * t_max), i64(1), i64(token_capacity, k),
        global_topk.new_empty(t_max, w, dtype=torch.bool),
        global_topk.new_empty((), dtype=torch.int32),
    ]  # fmt: skip


def _dispatch_fake(x, recv_token_src, comm):
    return x.new_empty(recv_token_src.shape[0], x.shape[1])


def _combine_fake(rows, token_rows, recv_token_src, slot_weights, send_to, shared_out,
                  num_tokens, comm, acc=None, row_begin=0, first=True, last=True,
                  rows2=None):  # fmt: skip
    return rows.new_empty(num_tokens if last else 0, rows.shape[1])


def _combine_slots_fake(row_values, token_rows, recv_token_src, send_to, num_tokens, comm):
    return row_values.new_empty(num_tokens, token_rows.shape[1])


def _gather_rows_fake(src, row_tok):
    return src.new_empty(row_tok.shape[0], src.shape[1])


def _fp8_pack_rows_fake(data, scales):
    return data.new_empty(data.shape[0], moe_fp8_packed_row_width(data.shape[1]),
                          dtype=torch.bfloat16)  # fmt: skip


def _gather_rows_fp8_fake(packed, row_tok, hidden):
    from mok_megatron.ops.fp8_blockwise import BLOCK

    rows = row_tok.shape[0]
    return (packed.new_empty(rows, hidden, dtype=torch.float8_e4m3fn),
            packed.new_empty(rows, hidden // BLOCK, dtype=torch.float32))  # fmt: skip


def _swiglu_fake(g, u):
    return g.new_empty(g.shape)


def _swiglu_backward_fake(da, g, u):
    return da.new_empty(da.shape), da.new_empty(da.shape)


def _swiglu_interleaved_fake(h):
    return h.new_empty(h.shape[0], h.shape[1] // 2)


def _swiglu_interleaved_backward_fake(da, h):
    return da.new_empty(h.shape[0], h.shape[1])


# ------------------------------------------------------------------ fused per-row backward step
def moe_row_grad(
    d_rows: torch.Tensor, y: torch.Tensor, w_rows: torch.Tensor, row_tok: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-row work at the start of the backward, in one pass over ``d_rows`` and ``y``.

    d_rows, y: [P, H] bfloat16, contiguous, H a multiple of 8; w_rows: [P] float32 (router
    weight of each row); row_tok: [P] int64 (-1 = padding row). Returns ``(d_row_w, dy)``:
    d_row_w [P] float32 = sum_h d_rows * y (float32 products and sums in a fixed order that
    depends only on H; exactly 0 for padding rows); dy [P, H] bfloat16 =
    ``(d_rows.float() * w_rows[:, None]).to(torch.bfloat16)``, bit for bit, on every row.
    Deterministic; no host synchronisation.
    """
    return torch.ops.mok.moe_row_grad(d_rows, y, w_rows, row_tok)


def _row_grad_fake(d_rows, y, w_rows, row_tok):
    return d_rows.new_empty(d_rows.shape[0], dtype=torch.float32), d_rows.new_empty(d_rows.shape)


def _accumulate_groups_fake(total, part, offs, first_round, round_index):
    return None


_FAKES = {
    "moe_gather_routing": _gather_routing_fake,
    "moe_build_schedule": _build_schedule_fake,
    "moe_dispatch": _dispatch_fake,
    "moe_combine": _combine_fake,
    "moe_combine_slots": _combine_slots_fake,
    "moe_gather_rows": _gather_rows_fake,
    "moe_fp8_pack_rows": _fp8_pack_rows_fake,
    "moe_gather_rows_fp8": _gather_rows_fp8_fake,
    "moe_swiglu": _swiglu_fake,
    "moe_swiglu_backward": _swiglu_backward_fake,
    "moe_swiglu_interleaved": _swiglu_interleaved_fake,
    "moe_swiglu_interleaved_backward": _swiglu_interleaved_backward_fake,
    "moe_row_grad": _row_grad_fake,
    "moe_accumulate_groups": _accumulate_groups_fake,
    "moe_mega_plan": _mega_plan_fake,
    "moe_mega_forward": _mega_forward_fake,
    "moe_mega_backward": _mega_backward_fake,
    "routing_to_topk": _routing_to_topk_fake,
}

if extension_available():
    for _name, _fake in _FAKES.items():
        # NOTE: an older build may lack newer ops; the backend then reports them as missing.
        if hasattr(torch.ops.mok, _name):
            torch.library.register_fake(f"mok::{_name}")(_fake)
