"""Grouped (per-expert) GEMMs of the MoE expert MLP on Hopper: ``torch.ops.mok.grouped_gemm_*``.

Groups follow ``torch._grouped_mm``: ``offs`` is int32 ``[G]``, the END row of each group, on the
device (never read by the host: no synchronisation, CUDA-graph safe). Group ``g`` owns rows
``[offs[g-1], offs[g])``; rows at or past ``offs[-1]`` are left unwritten. All matrices are
contiguous bf16; fp32 accumulation; every output tile is reduced by one CTA in a fixed order, so
results are bitwise reproducible.

The L1 weight is stored gate/up *interleaved in blocks of 8 rows* (:func:`interleave_gate_up`),
so one output tile holds matching gate and up columns and SwiGLU runs in the GEMM epilogue;
``h`` (the pre-activation) and ``d_h`` use the same interleaved column order.

Ops (shapes per call; ``R`` rows, ``G`` groups, ``H`` hidden, ``I`` intermediate):

==============================  =============================================================
``grouped_gemm_l1_swiglu``      x [R,H], w_gu [G,2I,H] -> act [R,I] (+ h [R,2I] if asked)
``grouped_gemm_nt``             a [R,K], b [G,N,K] -> a @ b[g]^T [R,N]       (L2 forward)
``grouped_gemm_nn``             a [R,K], b [G,K,N] -> a @ b[g] [R,N]         (L1 dgrad)
``grouped_gemm_dswiglu``        d_y [R,H], w_down [G,H,I], h [R,2I] -> d_h [R,2I] (+ act [R,I])
``grouped_gemm_tn``             a [R,M], b [R,N] -> a_g^T @ b_g [G,M,N]      (weight grads)
``grouped_gemm_tn_accumulate``  a [R,M], b [R,N], acc [G,M,N] fp32 -> acc[g] += a_g^T @ b_g
==============================  =============================================================

``grouped_gemm_tn_accumulate`` is Megatron's gradient-accumulation fusion on the engine: the
weight gradient's epilogue reads the caller's fp32 buffer (e.g. ``main_grad``) and writes back
``buffer + a_g^T @ b_g`` (one fp32 rounding, the same bits as adding the fp32 GEMM result in a
separate pass), so no bf16 gradient is written and no add pass follows. A bf16 acc is the same
sum rounded once to bf16 (a weight's ``.grad`` summed over macrobatch rounds in place).

``grouped_gemm_nt_wait`` and ``grouped_gemm_l1_swiglu_wait`` are the two forward ops with a
per-tile *flag wait* (the persistent megakernel's hook, docs/GEMM.md): before a tile loads its
rows of ``a`` / ``x``, it waits until ``ready[f] >= epoch`` for every flag ``f`` covering them.

Every op takes an optional :class:`GemmTuning`: the order its output tiles run in (results are
bitwise the same for every setting); the torch ops take it as their trailing ``schedule``,
``raster`` and ``swizzle`` arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mok_megatron.ops._extension import extension_available, has_op

__all__ = [
    "ACCUMULATE_STORES",
    "GEMM_SCHEDULES",
    "GEMM_RASTERS",
    "GEMM_SWIZZLES",
    "GemmTuning",
    "SWIGLU_INTERLEAVE",
    "DEFAULT_FLAG_WAIT_TIMEOUT_MS",
    "FLAG_WAIT_ERROR_FIELDS",
    "check_flag_wait_error",
    "default_flag_wait_error",
    "deinterleave_gate_up",
    "flag_wait_available",
    "flag_wait_error_buffer",
    "grouped_gemm_available",
    "grouped_gemm_dswiglu",
    "grouped_gemm_l1_swiglu",
    "grouped_gemm_l1_swiglu_wait",
    "grouped_gemm_nn",
    "grouped_gemm_nt",
    "grouped_gemm_nt_wait",
    "grouped_gemm_tn",
    "grouped_gemm_tn_accumulate",
    "interleave_gate_up",
]

#: Gate/up block width (rows of w_gu, columns of h); mirrors mok::gemm::kSwigluInterleave.
SWIGLU_INTERLEAVE = 8
#: GemmTuning's values; mirrors mok::launch::GemmTuning (checked again by the ops).
GEMM_SCHEDULES = ("cooperative", "pingpong", "cooperative_cluster2")
GEMM_RASTERS = ("m", "n")
GEMM_SWIZZLES = (1, 2, 4, 8)


@dataclass(frozen=True)
class GemmTuning:
    """The order a grouped GEMM's output tiles run in; every setting gives bitwise the same
    result (each tile is computed the same way). docs/GEMM.md has the sweep behind the defaults.

    schedule: "cooperative" (one 128-row tile over both consumer warpgroups), "pingpong" (a
    128x128 tile per warpgroup; the plain-epilogue ops nt, nn, tn and nt_wait only: the SwiGLU
    ops raise for it) or "cooperative_cluster2" (the cooperative tile in clusters of two CTAs
    along M that load each B tile once, by TMA multicast; the weight-gradient ops tn and
    tn_accumulate only: the others raise for it). raster: "m" or "n", the tile index that runs fastest. swizzle: 1, 2, 4
    or 8, the tile swizzle width.
    """

    schedule: str = "cooperative"
    raster: str = "m"
    swizzle: int = 1

    def __post_init__(self) -> None:
        if self.schedule not in GEMM_SCHEDULES:
            raise ValueError(
                f"GemmTuning.schedule={self.schedule!r} must be one of {GEMM_SCHEDULES}; "
                "'cooperative' is the default"
            )
        if self.raster not in GEMM_RASTERS:
            raise ValueError(
                f"GemmTuning.raster={self.raster!r} must be one of {GEMM_RASTERS}; 'm' is the "
                "default"
            )
        if isinstance(self.swizzle, bool) or self.swizzle not in GEMM_SWIZZLES:
            raise ValueError(
                f"GemmTuning.swizzle={self.swizzle!r} must be one of {GEMM_SWIZZLES}; 1 is the "
                "default"
            )

    def op_args(self) -> tuple[str, str, int]:
        """The ops' trailing (schedule, raster, swizzle) arguments."""
        return self.schedule, self.raster, self.swizzle


def _tuning_args(tuning: GemmTuning | None) -> tuple[str, str, int]:
    return (tuning or GemmTuning()).op_args()


def grouped_gemm_available() -> bool:
    """True when the CUDA extension provides the grouped-GEMM ops."""
    return has_op("grouped_gemm_nt_out")


def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """w_gate, w_up: [..., I, H] -> w_gu: [..., 2I, H], blocks of 8 gate rows then 8 up rows."""
    *lead, inter, hidden = w_gate.shape
    if w_up.shape != w_gate.shape or inter % SWIGLU_INTERLEAVE:
        raise ValueError(
            f"interleave_gate_up: w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} must "
            f"match with I a multiple of {SWIGLU_INTERLEAVE}"
        )
    blocks = inter // SWIGLU_INTERLEAVE
    g = w_gate.reshape(*lead, blocks, 1, SWIGLU_INTERLEAVE, hidden)
    u = w_up.reshape(*lead, blocks, 1, SWIGLU_INTERLEAVE, hidden)
    return torch.cat([g, u], dim=-3).reshape(*lead, 2 * inter, hidden).contiguous()


def deinterleave_gate_up(t: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Split an interleaved tensor (h or d_h along dim -1, w_gu or its grad along dim -2) into
    (gate, up), each with half the size along ``dim`` (contiguous copies)."""
    dim = dim % t.dim()
    two_i = t.shape[dim]
    blocks = two_i // (2 * SWIGLU_INTERLEAVE)
    v = t.reshape(*t.shape[:dim], blocks, 2, SWIGLU_INTERLEAVE, *t.shape[dim + 1 :])
    gate = v.select(dim + 1, 0).reshape(*t.shape[:dim], two_i // 2, *t.shape[dim + 1 :])
    up = v.select(dim + 1, 1).reshape(*t.shape[:dim], two_i // 2, *t.shape[dim + 1 :])
    return gate.contiguous(), up.contiguous()


def grouped_gemm_l1_swiglu(
    x: torch.Tensor, w_gu: torch.Tensor, offs: torch.Tensor, save_h: bool = False,
    tuning: GemmTuning | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """x: [R, H] bf16, w_gu: [G, 2I, H] bf16 (interleaved), offs: [G] int32 ->
    (act [R, I] = silu(gate) * up, h [R, 2I] pre-activation or None). ``tuning``: cooperative
    schedule only."""
    act = x.new_empty(x.shape[0], w_gu.shape[1] // 2)
    h = x.new_empty(x.shape[0], w_gu.shape[1]) if save_h else None
    grouped_gemm_l1_swiglu_into(x, w_gu, offs, act, h, tuning)
    return act, h


def grouped_gemm_l1_swiglu_into(
    x: torch.Tensor, w_gu: torch.Tensor, offs: torch.Tensor, act: torch.Tensor,
    h: torch.Tensor | None = None, tuning: GemmTuning | None = None,
) -> None:  # fmt: skip
    """:func:`grouped_gemm_l1_swiglu` into the caller's ``act`` [R, I] (and ``h`` [R, 2I] or
    None): only the rows of the groups (before ``offs[-1]``) are written; the others keep what
    they held (the backward megakernel's rings in rounds, ``functional.cuda.mega``)."""
    torch.ops.mok.grouped_gemm_l1_swiglu_out(x, w_gu, offs, act, h, *_tuning_args(tuning))


def grouped_gemm_nt(
    a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, tuning: GemmTuning | None = None
) -> torch.Tensor:
    """a: [R, K], b: [G, N, K] bf16 -> out [R, N], group g's rows times b[g]^T (L2 forward)."""
    out = a.new_empty(a.shape[0], b.shape[1])
    torch.ops.mok.grouped_gemm_nt_out(a, b, offs, out, *_tuning_args(tuning))
    return out


def grouped_gemm_nn(
    a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, tuning: GemmTuning | None = None
) -> torch.Tensor:
    """a: [R, K], b: [G, K, N] bf16 -> out [R, N], group g's rows times b[g] (L1 dgrad)."""
    out = a.new_empty(a.shape[0], b.shape[2])
    torch.ops.mok.grouped_gemm_nn_out(a, b, offs, out, *_tuning_args(tuning))
    return out


def grouped_gemm_dswiglu(
    d_y: torch.Tensor, w_down: torch.Tensor, h: torch.Tensor, offs: torch.Tensor,
    want_act: bool = False, tuning: GemmTuning | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """d_y: [R, H], w_down: [G, H, I], h: [R, 2I] (interleaved) bf16 -> (d_h [R, 2I] interleaved,
    act [R, I] recomputed or None): the L2 dgrad with the SwiGLU backward fused. ``tuning``:
    cooperative schedule only."""
    d_h = d_y.new_empty(d_y.shape[0], 2 * w_down.shape[2])
    act = d_y.new_empty(d_y.shape[0], w_down.shape[2]) if want_act else None
    torch.ops.mok.grouped_gemm_dswiglu_out(d_y, w_down, h, offs, d_h, act, *_tuning_args(tuning))
    return d_h, act


def grouped_gemm_tn(
    a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, tuning: GemmTuning | None = None
) -> torch.Tensor:
    """a: [R, M], b: [R, N] bf16 -> out [G, M, N] = a_g^T @ b_g over each group's rows, in a
    fixed order (zeros for an empty group): the weight gradients."""
    out = a.new_empty(offs.shape[0], a.shape[1], b.shape[1])
    torch.ops.mok.grouped_gemm_tn_out(a, b, offs, out, *_tuning_args(tuning))
    return out


#: How the float32 accumulate adds a tile into ``acc`` (the same bits every way), mirroring
#: csrc/launch/grouped_gemm.h's AccumulateStore: "load" (the epilogue reads the tile back, adds,
#: stores it), "reduce" (TMA reduce-add: the L2 adds it and the SM goes on), "auto" (reduce where
#: the groups average enough rows, that header's kReduceAddMinRowsPerGroup, else load).
ACCUMULATE_STORES = ("auto", "load", "reduce")


def grouped_gemm_tn_accumulate(
    a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, acc: torch.Tensor,
    tuning: GemmTuning | None = None, store: str = "auto",
) -> None:  # fmt: skip
    """acc[g] += a_g^T @ b_g over each group's rows, in the GEMM's epilogue (in place).

    a: [R, M], b: [R, N] bf16; acc: [G, M, N] float32 (e.g. Megatron's ``main_grad``) or
    bfloat16 (a ``.grad`` summed over macrobatch rounds in place), contiguous and 16-byte aligned
    (the epilogue loads and stores it by TMA). Each group's sum runs in :func:`grouped_gemm_tn`'s
    fixed order and lands once: ``acc + fp32(a_g^T @ b_g)`` computed in fp32 and rounded once to
    acc's type, so over a zero buffer it is bitwise :func:`grouped_gemm_tn`'s output (``bf16`` of
    it, for a float32 acc). A group without rows leaves its ``acc[g]`` untouched (not even -0.0
    becomes +0.0). ``store`` picks how a float32 acc's tile is added (:data:`ACCUMULATE_STORES`;
    a bfloat16 acc is always loaded and stored back)."""
    if store not in ACCUMULATE_STORES:
        raise ValueError(
            f"store={store!r} must be one of {ACCUMULATE_STORES}; 'auto' is the default"
        )
    torch.ops.mok.grouped_gemm_tn_accumulate_out(
        a, b, offs, acc, *_tuning_args(tuning), store=store
    )


# ------------------------------------------------------------------------------- flag wait
#: Words of the flag-wait error record (int32 each); mirrors mok::gemm::FlagWaitError.
FLAG_WAIT_ERROR_FIELDS = (
    "timed_out", "flag", "seen", "epoch", "group", "row_begin", "row_end", "timeout_ms",
)  # fmt: skip
#: A device wait gives up (error record, message, trap) after this long unless told otherwise.
DEFAULT_FLAG_WAIT_TIMEOUT_MS = 10_000


def flag_wait_available() -> bool:
    """True when the extension provides the flag-waiting grouped-GEMM ops."""
    return has_op("grouped_gemm_nt_wait_out") and has_op("grouped_gemm_l1_swiglu_wait_out")


def flag_wait_error_buffer() -> torch.Tensor:
    """A zeroed int32 ``[8]`` error record in pinned CPU memory for the ``*_wait`` ops. The kernel
    writes it when a wait times out, before it traps; being host memory, it stays readable after
    the trap has left the CUDA context unusable (read it with :func:`check_flag_wait_error`)."""
    return torch.zeros(len(FLAG_WAIT_ERROR_FIELDS), dtype=torch.int32, pin_memory=True)


_default_error: torch.Tensor | None = None


def default_flag_wait_error() -> torch.Tensor:
    """The process-wide pinned error record the ``*_wait`` wrappers pass when given none. Made on
    first use (a pinned allocation: call this once before capturing them in a CUDA graph)."""
    global _default_error
    if _default_error is None:
        _default_error = flag_wait_error_buffer()
    return _default_error


def check_flag_wait_error(error: torch.Tensor | None = None) -> None:
    """Raise RuntimeError naming the flag if ``error`` (default: :func:`default_flag_wait_error`)
    records a timed-out wait. Call it after a ``*_wait`` launch failed with a CUDA error: for a
    pinned record it reads host memory only, which still works once the context is lost."""
    error = default_flag_wait_error() if error is None else error
    record = dict(zip(FLAG_WAIT_ERROR_FIELDS, error.tolist()))
    if record["timed_out"]:
        raise RuntimeError(
            f"mok grouped GEMM: flag wait timed out after {record['timeout_ms']} ms on flag "
            f"{record['flag']}: ready[{record['flag']}] = {record['seen']} < epoch "
            f"{record['epoch']}, needed by the tile of group {record['group']}, rows "
            f"[{record['row_begin']}, {record['row_end']}). Did the producer of these rows run? "
            "Raise timeout_ms if it is only slow."
        )


def grouped_gemm_nt_wait(
    a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, ready: torch.Tensor,
    rows_per_flag: int, epoch: int, timeout_ms: int = DEFAULT_FLAG_WAIT_TIMEOUT_MS,
    error: torch.Tensor | None = None, tuning: GemmTuning | None = None,
) -> torch.Tensor:  # fmt: skip
    """:func:`grouped_gemm_nt` whose tiles first wait for their rows of ``a`` to land.

    ready: int32 ``[>= ceil(R / rows_per_flag)]`` on a's device; flag ``f`` covers rows
    ``[f * rows_per_flag, (f + 1) * rows_per_flag)`` of ``a`` (global rows), and a tile reading
    rows ``[r0, r1)`` waits until ``ready[f] >= epoch`` for each flag over them (ld.acquire.gpu;
    the writer sets a flag with release semantics after its rows). A wait still short after
    ``timeout_ms`` writes the error record ``error`` (default :func:`default_flag_wait_error`) and
    traps: the launch fails (it never hangs) and :func:`check_flag_wait_error` names the flag.
    Returns out ``[R, N]``, bitwise equal to :func:`grouped_gemm_nt` (with the same ``tuning``)."""
    error = default_flag_wait_error() if error is None else error
    out = a.new_empty(a.shape[0], b.shape[1])
    torch.ops.mok.grouped_gemm_nt_wait_out(
        a, b, offs, ready, rows_per_flag, epoch, timeout_ms, out, error, *_tuning_args(tuning)
    )
    return out


def grouped_gemm_l1_swiglu_wait(
    x: torch.Tensor, w_gu: torch.Tensor, offs: torch.Tensor, ready: torch.Tensor,
    rows_per_flag: int, epoch: int, save_h: bool = False,
    timeout_ms: int = DEFAULT_FLAG_WAIT_TIMEOUT_MS, error: torch.Tensor | None = None,
    tuning: GemmTuning | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """:func:`grouped_gemm_l1_swiglu` whose tiles first wait for their rows of ``x`` to land;
    ``ready``, ``rows_per_flag``, ``epoch``, ``timeout_ms`` and ``error`` as in
    :func:`grouped_gemm_nt_wait`. Returns (act ``[R, I]``, h ``[R, 2I]`` or None)."""
    error = default_flag_wait_error() if error is None else error
    act = x.new_empty(x.shape[0], w_gu.shape[1] // 2)
    h = x.new_empty(x.shape[0], w_gu.shape[1]) if save_h else None
    torch.ops.mok.grouped_gemm_l1_swiglu_wait_out(
        x, w_gu, offs, ready, rows_per_flag, epoch, timeout_ms, act, h, error,
        *_tuning_args(tuning),
    )  # fmt: skip
    return act, h


# ------------------------------------------------------------------------------------ fakes
def _out_fake(*args, **kwargs) -> None:  # every op writes into caller-provided outputs
    return None


if extension_available() and grouped_gemm_available():
    for _name in ("l1_swiglu", "nt", "nn", "dswiglu", "tn", "tn_accumulate", "nt_wait",
                  "l1_swiglu_wait"):  # fmt: skip
        if has_op(f"grouped_gemm_{_name}_out"):
            torch.library.register_fake(f"mok::grouped_gemm_{_name}_out")(_out_fake)
