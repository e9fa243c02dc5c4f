"""The routed expert MLP on one round's rows (``Experts``), for either weight form, and the
choice of which of its GEMMs run on the expert GEMM engine (``MoKConfig.expert_gemm``)."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

from mok_megatron.ops import grouped_gemm as gg
from mok_megatron.ops import moe as mops

from ..config import ENGINE_STEPS, engine_step_list
from ..types import FusedExpertWeights

__all__ = ["ENGINE_STEPS", "AUTO_ENGINE_STEPS", "AUTO_ACCUMULATE_STEPS", "WGRAD_TUNING",
           "ExpertRows", "Experts", "engine_steps", "grouped_mm", "accumulate", "weighted_rows",
           "not_hopper"]  # fmt: skip

#: What MoKConfig.expert_gemm="auto" picks on Hopper. "l2": its engine GEMM beat
#: torch._grouped_mm on all six points of the same-process micro-benchmark (docs/GEMM.md). "l1"
#: (which also writes h for the backward): in that micro-benchmark it is compared with
#: torch._grouped_mm + MoK's interleaved SwiGLU kernel, the backend's alternative (pair
#: "mok_save_h" / "torch_gemm+mok_swiglu"); in the layer at EP 2 the default's forward was ahead
#: of all-torch GEMMs (docs/PERF.md). Not the dgrads (the L1 dgrad lost on one shape), the weight
#: gradients (lost on most) or the fused dSwiGLU (its d_h store is not staged through shared
#: memory; pair "mok" / "torch_gemm+mok_dswiglu").
AUTO_ENGINE_STEPS = ("l1", "l2")
#: What "auto" adds when the backward accumulates the weight gradients: into caller buffers
#: (functional.backward's wgrad_accumulators, Megatron's main_grad), or over macrobatch rounds
#: into a bf16 total (stage1._weight_grad): the engine's weight gradient adds into the buffer in
#: its epilogue, while torch._grouped_mm (bf16 output only) needs its bf16 result and a separate
#: add pass over the buffer.
AUTO_ACCUMULATE_STEPS = ("wgrad",)
#: The engine's tile order for the weight gradients (its "wgrad" step, plain and accumulating):
#: every GemmTuning gives bitwise the same result. At EP 1 a weight-gradient GEMM's K is an
#: expert's rows, so each tile's epilogue (the bf16 store, or main_grad's fp32 read-modify-write)
#: weighs about as much as its mainloop, and the cooperative schedule runs the two one after the
#: other (scripts/wgrad_traffic.py's serial model); pingpong overlaps one warpgroup's epilogue
#: with the other's mainloop. ``bench_moe.py --mok-wgrad-pingpong`` times the layer with it in
#: the same process as this default: on one H200 at 81286a8 pingpong was 0.97-1.00x of it
#: (docs/results/bench_moe_h200_ep1_wgrad_*_81286a8.json), so cooperative stays; so did
#: ``--mok-wgrad-cluster2`` (clusters of two CTAs sharing B, 0.98-1.00x of it on one H100 at
#: 79c42ae, docs/results/bench_moe_h100_ep1_wgrad_cluster2_*_79c42ae.json).
WGRAD_TUNING = gg.GemmTuning()


@dataclass
class ExpertRows:
    """One round's expert activations, bf16: x_rows [M, H] (None in a saved context: the
    backward gathers them again), a [M, I], y [M, H] (None where the backward does not read it,
    ``Experts.backward_reads_y``, and in the rounds' recompute but for FP8 experts) and the
    pre-activation: g, u [M, I] (separate gate and up weights) or h [M, 2I] (fused form: gate
    and up columns interleaved in blocks of 8; None when only the forward of a round needs
    it)."""

    x_rows: torch.Tensor | None
    a: torch.Tensor
    y: torch.Tensor | None
    g: torch.Tensor | None = None
    u: torch.Tensor | None = None
    h: torch.Tensor | None = None


class Experts:
    """The routed expert MLP on one round's rows, for either weight form.

    Separate gate/up: two grouped GEMMs and the SwiGLU kernel. Fused gate/up
    (``FusedExpertWeights``): each step on the expert GEMM engine or on torch GEMMs, as
    ``engine_steps`` says for ``expert_gemm`` (MoKConfig.expert_gemm): L1 + SwiGLU in one
    engine GEMM (``h`` kept when the backward needs it) or one ``torch._grouped_mm`` over both
    halves and the interleaved SwiGLU kernel; the L2 dgrad with the SwiGLU backward in one
    engine GEMM, or ``torch._grouped_mm`` and the interleaved SwiGLU-backward kernel; the plain
    GEMMs (L2 forward, dgrads, weight gradients) likewise (``mm_nt``, ``mm_nn``, ``mm_tn``).

    ``accumulate``: the weight gradients add into buffers (``mm_tn_accumulate``: the caller's, or
    over macrobatch rounds a bf16 total); for either form, on the engine when its "wgrad" step is
    (AUTO_ACCUMULATE_STEPS), else by torch.

    ``precision`` (MoKConfig.expert_precision): "fp8_blockwise" runs the forward's L1 and L2 in
    blockwise FP8 (``fp8.forward``; fused form only); the backward's GEMMs stay as above, unless
    ``fp8_backward`` (MoKConfig.fp8_backward) is "dgrad": then the data gradients (``mm_nn``)
    are FP8 GEMMs (``fp8.dgrad``), and the L2 dgrad is not fused with the SwiGLU backward.
    """

    def __init__(self, routed, expert_gemm: str, device: torch.device, accumulate: bool = False,
                 precision: str = "bf16", fp8_backward: str = "bf16"):  # fmt: skip
        self.routed = routed
        self.fused = isinstance(routed, FusedExpertWeights)
        self.fp8 = precision == "fp8_blockwise"
        self.fp8_dgrad = self.fp8 and fp8_backward == "dgrad"
        if self.fp8:
            from . import fp8

            fp8.check_fp8_experts(routed, device)
        steps = engine_steps(expert_gemm, device, accumulate) if self.fused or accumulate else ()
        self.engine = steps if self.fused else ()
        # NOTE: the weight-gradient GEMM does not depend on the form, so accumulation follows
        # expert_gemm's "wgrad" step with separate gate and up weights too.
        self.accumulate_on_engine = accumulate and "wgrad" in steps
        if self.fused:
            self.pre_weights = (routed.gate_up,)
            self.grad_slots = (0, 2)  # d_w_routed_gate holds gate_up's gradient
        else:
            self.pre_weights = (routed.gate, routed.up)
            self.grad_slots = (0, 1, 2)

    @property
    def backward_reads_y(self) -> bool:
        """Whether a one-round backward reads the L2 output rows y (so the forward keeps them).

        The router-weight gradient of a row is <d_rows, y> = <d_rows @ W_down, a>. The engine's
        L2 dgrad with the SwiGLU backward fused (step "dswiglu") never makes d_rows @ W_down, so
        it takes <d_rows, y>; so does an FP8 forward, whose y came from the FP8 GEMM (the bf16
        d_rows @ W_down is not the derivative of what it computed). Otherwise the backward takes
        the second form and the forward keeps [M, H] less for every layer between it and its
        backward. (Where I > H, mixtral-8x7b, the backward's first step then holds d_rows @
        W_down and w * a, [M, I] each, where it would hold y and w * d_rows, [M, H] each: a
        higher peak inside one layer's backward, for less memory kept by all the others.)"""
        return self.fp8 or "dswiglu" in self.engine

    def forward(self, x_rows, offs, *, save_pre: bool, with_down: bool = True,
                x_q=None) -> ExpertRows:  # fmt: skip
        """x_rows [M, H] → ExpertRows; the pre-activation is kept only when ``save_pre`` (the
        separate form always has it: it is the GEMMs' output). ``x_q``: FP8 experts only, the
        rows already quantised (``fp8.gather_rows``), x_rows None."""
        w = self.routed
        g = u = h = None
        if self.fp8:
            from . import fp8

            a, y, h = fp8.forward(w, x_rows, offs, save_pre=save_pre, with_down=with_down,
                                  x_q=x_q)  # fmt: skip
            return ExpertRows(x_rows, a, y, h=h)
        if x_q is not None:
            raise ValueError("Experts.forward: quantised rows (x_q) are for FP8 experts only")
        if "l1" in self.engine:
            a, h = gg.grouped_gemm_l1_swiglu(x_rows, w.gate_up, offs, save_h=save_pre)
        elif self.fused:
            h = grouped_mm(x_rows, w.gate_up.transpose(1, 2), offs)
            a = mops.moe_swiglu_interleaved(h)
            h = h if save_pre else None
        else:
            # NOTE: gate and up stay two GEMMs: concatenating the weights would copy all of
            # them (2 * E_l * I * H) every pass; the SwiGLU kernel reads the two outputs.
            g = grouped_mm(x_rows, w.gate.transpose(1, 2), offs)
            u = grouped_mm(x_rows, w.up.transpose(1, 2), offs)
            a = mops.moe_swiglu(g, u)
        y = self.mm_nt(a, w.down, offs) if with_down else None
        return ExpertRows(x_rows, a, y, g, u, h)

    def l1_into(self, x_rows, offs, act: torch.Tensor, h: torch.Tensor) -> None:
        """The fused form's L1 + SwiGLU of ``x_rows`` into the caller's ``act`` [M, I] and ``h``
        [M, 2I]: the groups' rows (before ``offs[-1]``) are written, the others keep what they held
        (the backward megakernel's rings in rounds, ``mega._backward_rounds``). On the engine
        (step "l1") the GEMM writes only those rows; on torch._grouped_mm they are selected."""
        w = self.routed.gate_up
        if "l1" in self.engine:
            gg.grouped_gemm_l1_swiglu_into(x_rows, w, offs, act, h)
            return
        new_h = grouped_mm(x_rows, w.transpose(1, 2), offs)  # rows past offs[-1]: undefined
        rows = (torch.arange(h.shape[0], device=h.device) < offs[-1]).unsqueeze(1)
        act.copy_(torch.where(rows, mops.moe_swiglu_interleaved(new_h), act))
        h.copy_(torch.where(rows, new_h, h))

    def pre_grads_from_dy(self, dy, act: ExpertRows, offs) -> tuple[torch.Tensor, ...]:
        """dy = w * d_rows [M, H] → the pre-activation gradients (d_g, d_u) or (d_h,)."""
        if "dswiglu" in self.engine and not self.fp8_dgrad:  # the L2 dgrad + SwiGLU backward
            return (gg.grouped_gemm_dswiglu(dy, self.routed.down, act.h, offs)[0],)
        return self.pre_grads_from_da(self.mm_nn(dy, self.routed.down, offs), act)

    def pre_grads_from_da(self, da, act: ExpertRows) -> tuple[torch.Tensor, ...]:
        """da [M, I] (the gradient of the SwiGLU output) → (d_g, d_u) or (d_h,)."""
        if self.fused:
            return (mops.moe_swiglu_interleaved_backward(da, act.h),)
        return mops.moe_swiglu_backward(da, act.g, act.u)

    # The plain GEMMs: the engine's (steps "l2", "dgrad", "wgrad") or torch._grouped_mm.
    def mm_nt(self, a, b, offs):
        """a [M, K], b [G, N, K] → a_g @ b[g]^T [M, N] (the L2 forward)."""
        if "l2" in self.engine:
            return gg.grouped_gemm_nt(a, b, offs)
        return grouped_mm(a, b.transpose(1, 2), offs)

    def mm_nn(self, a, b, offs):
        """a [M, K], b [G, K, N] → a_g @ b[g] [M, N] (the dgrads)."""
        if self.fp8_dgrad:
            from . import fp8

            return fp8.dgrad(a, b, offs)

        if "dgrad" in self.engine:
            return gg.grouped_gemm_nn(a, b, offs)
        return grouped_mm(a, b, offs)

    def mm_tn(self, a, b, offs):
        """a [M, P], b [M, Q] → [G, P, Q], each group's a_g^T @ b_g (the weight gradients)."""
        if "wgrad" in self.engine:
            return gg.grouped_gemm_tn(a, b, offs, tuning=WGRAD_TUNING)
        return grouped_mm(a.T, b, offs)

    def mm_tn_accumulate(self, a, b, offs, acc: torch.Tensor) -> None:
        """acc [G, P, Q] (float32, or bf16) += each group's a_g^T @ b_g (a [M, P], b [M, Q]); a
        group without rows leaves acc[g] as it is. On the engine the GEMM's epilogue adds its fp32
        result (rounded once to acc's type); otherwise (the torch fallback) torch._grouped_mm's
        bf16 result is added in acc's type, the same as adding the gradient it would return, at
        one more pass over acc."""
        if self.accumulate_on_engine:
            gg.grouped_gemm_tn_accumulate(a, b, offs, acc, tuning=WGRAD_TUNING)
            return
        part = grouped_mm(a.T, b, offs)  # a group without rows holds anything: masked below
        rows = torch.diff(offs, prepend=offs.new_zeros(1))
        # NOTE: a select, not an add of zeros: NaN + 0 on the GPU gives the canonical NaN, not
        # the buffer's bits, and an expert without rows must keep its exact bits.
        acc.copy_(torch.where((rows > 0).view(-1, 1, 1), acc + part, acc))


def engine_steps(
    expert_gemm: str, device: torch.device, accumulate: bool = False
) -> tuple[str, ...]:
    """The steps of the fused gate/up form that run on the expert GEMM engine (ENGINE_STEPS)
    for ``expert_gemm`` (MoKConfig.expert_gemm, validated there); "auto" is AUTO_ENGINE_STEPS
    (plus AUTO_ACCUMULATE_STEPS when the weight gradients are ``accumulate``d: into caller
    buffers, or over macrobatch rounds) where the engine can run, else none (with a warning that
    says why)."""
    steps = _NAMED_STEPS.get((expert_gemm, bool(accumulate)))
    if steps is None:
        steps = engine_step_list(expert_gemm)
    if not _ENGINE_STEP_SET.issuperset(steps):
        raise ValueError(
            f"MoKConfig.expert_gemm={expert_gemm!r}: choose auto, torch, engine or a comma list "
            f"of {ENGINE_STEPS}"
        )
    if not steps:
        return ()
    why_not = not_hopper(device)
    if not gg.grouped_gemm_available():
        why_not = "mok_megatron._C lacks the grouped-GEMM ops"
    if why_not is None:
        return steps
    if expert_gemm != "auto":
        raise RuntimeError(
            f"MoKConfig.expert_gemm={expert_gemm!r} but the expert GEMM engine can't run: "
            f"{why_not}; use expert_gemm='auto' or 'torch'"
        )
    _warn_once(
        f"mok: the expert GEMMs run on torch._grouped_mm, not the expert GEMM engine: "
        f"{why_not} (MoKConfig.expert_gemm='torch' chooses this without the warning)"
    )
    return ()


#: engine_steps' named choices, by (expert_gemm, accumulate).
_NAMED_STEPS = {
    (name, accumulate): steps
    for accumulate in (False, True)
    for name, steps in (
        ("auto", AUTO_ENGINE_STEPS + (AUTO_ACCUMULATE_STEPS if accumulate else ())),
        ("torch", ()),
        ("engine", ENGINE_STEPS),
    )
}
_ENGINE_STEP_SET = frozenset(ENGINE_STEPS)


def not_hopper(device: torch.device | None) -> str | None:
    """Why ``device`` cannot run the sm_90a kernels (None when it can)."""
    if device is None or device.type != "cuda":
        return f"the device is {device}, not a CUDA GPU"
    major, minor = _capability(device)
    if (major, minor) != (9, 0):
        return f"mok_megatron._C is built for sm_90a and this GPU is sm_{major}{minor}"
    return None


def _capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(device)``, asked once per device index (it never
    changes in a process; the query builds a device-properties object each time, and every
    forward builds an ``Experts``)."""
    if device.index is None:  # the current device, which may change
        return torch.cuda.get_device_capability(device)
    return _capability_of_index(device.index)


@functools.cache
def _capability_of_index(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


def accumulate(total, part: torch.Tensor, offs: torch.Tensor, rounds, r: int):
    """Add round r's weight gradient to the total, in round order, touching only the experts
    that need it (ops.moe.moe_accumulate_groups); round 0's output becomes the total. Experts
    with no rows get exact zeros (whatever an empty group GEMM leaves)."""
    part = part.contiguous()
    total = part if total is None else total
    mops.moe_accumulate_groups(total, part, offs, rounds.first_round, r)
    return total


def weighted_rows(rows: torch.Tensor, w_rows: torch.Tensor, row_tok: torch.Tensor) -> torch.Tensor:
    """bf16(rows * w_rows[:, None]) [M, N], the product in float32 rounded once.

    The weighted SwiGLU output whose product with d_rows is the down weight's gradient,
    d_rows^T (w * a) = (w * d_rows)^T a. It is ``moe_row_grad``'s weighted output, one kernel
    (its row dot product and [M] float32 output unused), without the float32 [M, N] temporary
    of the torch expression."""
    return mops.moe_row_grad(rows, rows, w_rows, row_tok)[1]


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` (bf16, no host sync).

    2d x 3d: a [P, K], b [G, K, N] → [P, N] (rows past offs[-1] are undefined);
    2d x 2d: a [M, P], b [P, N] → [G, M, N], reducing each group's rows.
    """
    return torch._grouped_mm(a, b, offs=offs)
