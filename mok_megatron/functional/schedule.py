"""The routed schedule: which rows each rank computes, in which order, and where results go.

The schedule is a pure function of every rank's routing (never of arrival order), so it is
bitwise reproducible; every backend builds the same integers. Shapes are fixed by the workspace's
capacities, so building it needs no host synchronisation.

Notation: ``W`` ranks, this rank ``r``, ``T_max`` padded local tokens, ``K`` slots, ``E_l`` local
experts, ``C`` row capacity, ``C_tok`` received-token capacity. A *row* is one (source rank ``s``,
token ``t``, slot ``k``) routed to one of this rank's experts. Rows are sorted by
(local expert, s, t, k); received tokens (each moved once per destination rank) by (s, t).

``error_flags`` bits (see ``MOK_ERR_*``) are raised at the next host-visible point by the
workspace's error monitor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = [
    "MoKSchedule",
    "build_schedule_from_global",
    "MOK_ERR_ROW_OVERFLOW",
    "MOK_ERR_EXPERT_ID",
]

#: More rows were routed to some rank than its schedule holds (raise schedule_capacity_multiplier).
MOK_ERR_ROW_OVERFLOW = 1
#: A routed expert id was outside [-1, num_experts).
MOK_ERR_EXPERT_ID = 2


@dataclass
class MoKSchedule:
    """Integer plan for one forward/backward pass on one rank (all tensors int64 unless noted).

    Expert side (rows this rank computes):
      row_expert:      [C]      local expert of each row; ``E_l`` for an unused row
      row_src_rank:    [C]      source rank s, -1 for an unused row
      row_src_token:   [C]      source token t, -1 for an unused row
      row_src_slot:    [C]      slot k, -1 for an unused row
      row_token_idx:   [C]      index into the received tokens, -1 for an unused row
      expert_offsets:  [E_l+1]  psum of rows per local expert, capped at C
      num_rows:        [1]      rows routed here (uncapped; > C means overflow)
      recv_token_src:  [C_tok]  s * T_max + t of each received token, -1 when unused
      recv_token_pos:  [W*T_max] index of (s, t) among the received tokens, -1 when absent
      num_recv_tokens: [1]      received tokens (capped at C_tok)
      token_rows:      [C_tok, K]  row of each slot of a received token, -1 when not here
    Source side (this rank's own tokens):
      global_topk:     [W, T_max, K]  every rank's routing, -1 padded
      send_to:         [T_max, W] bool  token t has at least one slot on rank d
      error_flags:     [] int32 (0-dim)  ``MOK_ERR_*`` bits
    Gathered with the routing when ``build_schedule`` was given the router weights:
      global_weights:  [W, T_max, K] float32 every rank's router weights, 0 padded (or None)
    """

    rank: int
    num_ranks: int
    num_tokens: int
    max_tokens: int
    topk: int
    num_local_experts: int
    row_capacity: int
    token_capacity: int
    global_topk: torch.Tensor
    row_expert: torch.Tensor
    row_src_rank: torch.Tensor
    row_src_token: torch.Tensor
    row_src_slot: torch.Tensor
    row_token_idx: torch.Tensor
    expert_offsets: torch.Tensor
    num_rows: torch.Tensor
    recv_token_src: torch.Tensor
    recv_token_pos: torch.Tensor
    num_recv_tokens: torch.Tensor
    token_rows: torch.Tensor
    send_to: torch.Tensor
    error_flags: torch.Tensor
    global_weights: torch.Tensor | None = None
    weights_source: tuple | None = None  # (the router_weights tensor, its _version then)

    # ---- a pending schedule (the megakernel path): its tensors are made by the forward's one
    # op call, or by ``build`` on the first read of one of them before that.
    @classmethod
    def pending(cls, *, build, **sizes) -> MoKSchedule:
        """A schedule of these sizes whose INTEGER_FIELDS do not exist yet: reading one runs
        ``build(sched)``, which must ``fill`` them."""
        if sizes.keys() == _PENDING_SIZES:
            # what __init__ would set, but the tensors, without __init__ and its 14 deletions
            # after (host time on every forward; see the NOTE at _check_init_only_sets_fields)
            sched = cls.__new__(cls)
            sched.__dict__.update(sizes, **_PENDING_DEFAULTS)
        else:  # missing or other sizes: the dataclass's own checks
            sched = cls(**sizes, **dict.fromkeys(cls.INTEGER_FIELDS))
            for name in cls.INTEGER_FIELDS:
                del sched.__dict__[name]
        sched.__dict__["_build"] = build
        return sched

    def is_pending(self) -> bool:
        return self.__dict__.get("_build") is not None

    def ensure_built(self) -> MoKSchedule:
        """Make a pending schedule's tensors now (a no-op once made); returns self."""
        build = self.__dict__.get("_build")
        if build is not None:
            build(self)
        return self

    def fill(self, tensors: dict) -> None:
        """Give a pending schedule its INTEGER_FIELDS (a dict with each of them)."""
        self.__dict__.update({name: tensors[name] for name in self.INTEGER_FIELDS})
        self.__dict__["_build"] = None

    def __getattr__(self, name: str):  # only for attributes that do not exist
        build = self.__dict__.get("_build")
        if build is not None and name in type(self).INTEGER_FIELDS:
            build(self)
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def gathered_weights_match(self, router_weights: torch.Tensor) -> bool:
        """Whether ``global_weights`` were gathered from exactly this tensor, unchanged since."""
        if self.global_weights is None or self.weights_source is None:
            return False
        source, version = self.weights_source
        return source is router_weights and version == router_weights._version

    INTEGER_FIELDS = (
        "global_topk", "row_expert", "row_src_rank", "row_src_token", "row_src_slot",
        "row_token_idx", "expert_offsets", "num_rows", "recv_token_src", "recv_token_pos",
        "num_recv_tokens",
        "token_rows", "send_to", "error_flags",
    )  # fmt: skip


#: The sizes ``MoKSchedule.pending`` takes (every field without a default but the tensors), and
#: the defaults of the others.
_PENDING_SIZES = frozenset(
    f.name for f in dataclasses.fields(MoKSchedule)
    if f.default is dataclasses.MISSING and f.name not in MoKSchedule.INTEGER_FIELDS
)  # fmt: skip
_PENDING_DEFAULTS = {
    f.name: f.default
    for f in dataclasses.fields(MoKSchedule)
    if f.default is not dataclasses.MISSING
}


def _check_init_only_sets_fields(cls) -> None:
    """Raises unless ``cls.__init__`` does no more than set each field to its argument or its
    default: what ``MoKSchedule.pending`` does without calling it."""
    skipped = [f"{f.name} (init=False)" for f in dataclasses.fields(cls) if not f.init]
    skipped += [f"{f.name} (default_factory)" for f in dataclasses.fields(cls)
                if f.default_factory is not dataclasses.MISSING]  # fmt: skip
    if hasattr(cls, "__post_init__"):
        skipped.append("__post_init__")
    if skipped:
        raise TypeError(
            f"{cls.__name__}.pending sets a schedule's fields without __init__, which would skip "
            f"{', '.join(skipped)}; update pending (and _PENDING_DEFAULTS) to do what they do"
        )


# NOTE: pending() skips __init__ (host time on every forward): a __post_init__, an init=False
# field or a default_factory field added to MoKSchedule must be handled there too.
_check_init_only_sets_fields(MoKSchedule)


def build_schedule_from_global(
    global_topk: torch.Tensor,
    *,
    rank: int,
    num_tokens: int,
    num_experts: int,
    num_local_experts: int,
    row_capacity: int,
    token_capacity: int,
) -> MoKSchedule:
    """Build rank ``rank``'s schedule from the gathered routing.

    global_topk: [W, T_max, K], int64, every rank's ``topk_experts`` padded with -1.
    """
    num_ranks, max_tokens, topk = global_topk.shape
    device = global_topk.device
    e_l, cap, cap_tok = num_local_experts, row_capacity, token_capacity
    bad_id = ((global_topk < -1) | (global_topk >= num_experts)).any()

    # Rows: every (s, t, k) routed to a local expert, keyed by (local expert, s, t, k).
    local = global_topk - rank * e_l
    routed_here = (local >= 0) & (local < e_l)
    flat = torch.arange(global_topk.numel(), device=device).view_as(global_topk)
    span = global_topk.numel()
    keys = torch.where(routed_here, local * span + flat, torch.full_like(flat, e_l * span))
    sorted_keys, order = torch.sort(keys.flatten(), stable=True)
    row_keys = _take_padded(sorted_keys, cap, e_l * span)
    used = row_keys < e_l * span
    src_flat = torch.where(used, row_keys % span, -1)
    row_expert = torch.where(used, row_keys // span, e_l)
    row_src_rank = torch.where(used, src_flat // (max_tokens * topk), -1)
    row_src_token = torch.where(used, (src_flat // topk) % max_tokens, -1)
    row_src_slot = torch.where(used, src_flat % topk, -1)
    num_rows = routed_here.sum().reshape(1)

    counts = torch.zeros(e_l + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, row_expert, torch.ones_like(row_expert))
    expert_offsets = torch.zeros(e_l + 1, dtype=torch.int64, device=device)
    expert_offsets[1:] = torch.cumsum(counts[:e_l], 0)

    # Row index of every (s, t, k): the inverse of the sort, kept only where it fits.
    row_of = torch.empty(span, dtype=torch.int64, device=device)
    row_of[order] = torch.arange(span, device=device)
    row_of = row_of.view_as(global_topk)
    slot_row = torch.where(routed_here & (row_of < cap), row_of, -1)

    # Received tokens: each (s, t) with a slot here, once, in (s, t) order.
    tok_here = (slot_row >= 0).any(-1).flatten()
    tok_flat = torch.arange(num_ranks * max_tokens, device=device)
    tok_keys = torch.where(tok_here, tok_flat, num_ranks * max_tokens)
    recv_keys = _take_padded(torch.sort(tok_keys).values, cap_tok, num_ranks * max_tokens)
    recv_token_src = torch.where(recv_keys < num_ranks * max_tokens, recv_keys, -1)
    tok_pos = torch.cumsum(tok_here.to(torch.int64), 0) - 1
    recv_token_pos = torch.where(tok_here & (tok_pos < cap_tok), tok_pos, -1)
    num_recv_tokens = tok_here.sum().clamp(max=cap_tok).reshape(1)
    token_rows = slot_row.view(-1, topk)[recv_token_src.clamp(min=0)]
    token_rows = torch.where((recv_token_src >= 0)[:, None], token_rows, -1)
    row_token_idx = torch.full((cap,), -1, dtype=torch.int64, device=device)
    row_src_tok = (row_src_rank * max_tokens + row_src_token).clamp(min=0)
    row_token_idx = torch.where(used, tok_pos[row_src_tok], row_token_idx)

    # Source side: which ranks this rank's tokens visit.
    mine = global_topk[rank]
    dest = torch.where((mine >= 0) & (mine < num_experts), mine // e_l, num_ranks)
    send_to = torch.zeros(max_tokens, num_ranks + 1, dtype=torch.bool, device=device)
    send_to.scatter_(1, dest, torch.ones_like(dest, dtype=torch.bool))
    # Every rank sees all routing, so all ranks agree on an overflow anywhere (and all raise).
    valid = (global_topk >= 0) & (global_topk < num_experts)
    rank_of = torch.where(valid, global_topk // e_l, num_ranks)
    rows_per_rank = torch.zeros(num_ranks + 1, dtype=torch.int64, device=device)
    rows_per_rank.scatter_add_(0, rank_of.flatten(), torch.ones_like(rank_of.flatten()))
    overflow = (rows_per_rank[:num_ranks] > cap).any()
    flags = torch.where(overflow, MOK_ERR_ROW_OVERFLOW, 0) + torch.where(
        bad_id, MOK_ERR_EXPERT_ID, 0
    )
    return MoKSchedule(
        rank=rank, num_ranks=num_ranks, num_tokens=num_tokens, max_tokens=max_tokens,
        topk=topk, num_local_experts=e_l, row_capacity=cap, token_capacity=cap_tok,
        global_topk=global_topk, row_expert=row_expert, row_src_rank=row_src_rank,
        row_src_token=row_src_token, row_src_slot=row_src_slot, row_token_idx=row_token_idx,
        expert_offsets=expert_offsets.clamp(max=cap), num_rows=num_rows,
        recv_token_src=recv_token_src, recv_token_pos=recv_token_pos,
        num_recv_tokens=num_recv_tokens, token_rows=token_rows,
        send_to=send_to[:, :num_ranks].contiguous(), error_flags=flags.to(torch.int32),
    )  # fmt: skip


def _take_padded(values: torch.Tensor, size: int, pad: int) -> torch.Tensor:
    """values[:size], padded with ``pad`` when shorter (shapes fixed, no host sync)."""
    if values.numel() >= size:
        return values[:size]
    tail = torch.full((size - values.numel(),), pad, dtype=values.dtype, device=values.device)
    return torch.cat([values, tail])
