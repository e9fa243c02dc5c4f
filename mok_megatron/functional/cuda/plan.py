"""Stage 1's padded row layout and macrobatch rounds, computed from a schedule in torch.

The megakernel's device plan (ops.moe.moe_build_plan) produces the same integers; its GPU test
checks it against these functions, which stay the plain statement of the layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..schedule import MoKSchedule

__all__ = ["GROUP_ALIGN", "CudaPlan", "Rounds", "padded_plan", "make_rounds", "window_offs"]

#: Row alignment of each expert's group in the padded GEMM layout (16 bytes of bf16).
GROUP_ALIGN = 8


@dataclass
class CudaPlan:
    """The padded row layout of one schedule (P = C + 8 * E_l rows; all device tensors).

    row_tok: [P] received-token index of each padded row, -1 for padding;
    token_rows: [C_tok, K] padded row of each slot, -1; offs: [E_l] int32 group ends;
    expert_rows: [E_l] rows per expert (weight gradients of empty experts are zeroed).
    """

    row_tok: torch.Tensor
    token_rows: torch.Tensor
    offs: torch.Tensor
    expert_rows: torch.Tensor
    prow: torch.Tensor  # [C] padded row of each schedule row (P for unused rows)


@dataclass
class Rounds:
    """Macrobatch rounds over the padded rows: ``count`` windows of ``rows`` rows each.

    row_tok: [count * rows] received-token index of each padded row (-1 for padding);
    w_rows: [count * rows] float32 router weight of each row (0 for padding);
    first_round: [E_l] int32 round of each expert's first row (-1 for an expert with none).
    """

    count: int
    rows: int
    row_tok: torch.Tensor
    w_rows: torch.Tensor
    first_round: torch.Tensor

    def window(self, r: int) -> slice:
        return slice(r * self.rows, (r + 1) * self.rows)

    def last_first(self, plan: CudaPlan) -> tuple[Rounds, torch.Tensor]:
        """These rounds as the backward megakernel takes them, the last first: (the rounds with
        ``first_round`` in that order, each expert's visit, 0 to count - 1, that holds its first
        rows, -1 for an expert with none; the round that holds the last padded row with rows,
        a 0-dim device tensor, -1 without rows). Visit ``i`` is round ``count - 1 - i``."""
        ends = plan.offs.to(torch.int64)
        last = torch.div(ends - 1, self.rows, rounding_mode="floor")  # each expert's last round
        visit = torch.where(plan.expert_rows > 0, self.count - 1 - last, -1).to(torch.int32)
        held = torch.div(ends[-1] - 1, self.rows, rounding_mode="floor")  # -1 without rows
        return replace(self, first_round=visit), held


def padded_plan(sched: MoKSchedule) -> CudaPlan:
    """Schedule rows → padded rows: expert e's rows start at a multiple of GROUP_ALIGN."""
    e_l, cap = sched.num_local_experts, sched.row_capacity
    num_padded = cap + GROUP_ALIGN * e_l
    offsets = sched.expert_offsets
    expert_rows = offsets[1:] - offsets[:-1]
    padded = (expert_rows + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    used = sched.row_expert < e_l
    expert = sched.row_expert.clamp(max=e_l - 1)
    rows = torch.arange(cap, device=offsets.device)
    prow = torch.where(used, rows - offsets[expert] + pad_start[expert], num_padded)
    row_tok = torch.full((num_padded + 1,), -1, dtype=torch.int64, device=offsets.device)
    row_tok.scatter_(0, prow, torch.where(used, sched.row_token_idx, -1))
    slot = sched.token_rows
    token_rows = torch.where(slot >= 0, prow[slot.clamp(min=0)], -1)
    return CudaPlan(row_tok[:num_padded], token_rows.contiguous(), pad_end.to(torch.int32),
                    expert_rows, prow)  # fmt: skip


def make_rounds(macrobatch: int, sched: MoKSchedule, plan: CudaPlan, slot_weights) -> Rounds:
    """Split the P padded rows into ceil(row_capacity / macrobatch) equal windows (a multiple of
    GROUP_ALIGN rows each, so every group in a window stays 16-byte aligned)."""
    padded = plan.row_tok.shape[0]
    count = max(1, math.ceil(sched.row_capacity / macrobatch))
    rows = padded if count == 1 else _align(math.ceil(padded / count), GROUP_ALIGN)
    extra = count * rows - padded
    row_tok, w_rows = plan.row_tok, _row_weights(slot_weights, sched, plan)
    if extra:
        row_tok = torch.cat([row_tok, row_tok.new_full((extra,), -1)])
        w_rows = torch.cat([w_rows, w_rows.new_zeros(extra)])
    ends = plan.offs.to(torch.int64)
    start = torch.cat([ends.new_zeros(1), ends[:-1]])  # each expert's first padded row
    first_round = torch.where(plan.expert_rows > 0, start // rows, -1).to(torch.int32)
    return Rounds(count, rows, row_tok, w_rows, first_round)


def window_offs(plan: CudaPlan, window: slice) -> torch.Tensor:
    """Group ends of the padded layout, seen from inside one window ([G] int32)."""
    width = window.stop - window.start
    return (plan.offs - window.start).clamp_(0, width).to(torch.int32)


def round_accumulator(rounds: Rounds, recv: torch.Tensor, hidden: int | None = None):
    """The float32 per-received-token sum [C_tok, hidden] carried between rounds (None for one
    round); ``hidden``: where ``recv``'s rows are not [H] wide (packed FP8 tokens)."""
    if rounds.count == 1:
        return None
    width = recv.shape[1] if hidden is None else hidden
    return torch.empty(recv.shape[0], width, dtype=torch.float32, device=recv.device)


def _row_weights(slot_weights: torch.Tensor, sched: MoKSchedule, plan: CudaPlan):
    """[W, T_max, K] router weights → [P] weight of each padded row (0 on padding)."""
    flat = (sched.row_src_rank * sched.max_tokens + sched.row_src_token) * sched.topk
    flat = (flat + sched.row_src_slot).clamp(min=0)
    values = torch.where(
        sched.row_expert < sched.num_local_experts, slot_weights.flatten()[flat], 0
    )
    out = torch.zeros(plan.row_tok.shape[0] + 1, dtype=torch.float32, device=values.device)
    out.scatter_(0, plan.prow, values)  # unused rows all land on the dropped last entry
    return out[:-1]


def _align(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple
