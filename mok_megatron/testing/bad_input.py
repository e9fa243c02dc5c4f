"""Every kind of bad input the functional API rejects, as one table: the CPU test runs it on the
reference backend (tests/cpu/test_bad_input.py), the GPU test on the CUDA backend's stage 1, its
megakernel and virtual ranks (tests/gpu/test_bad_input_cuda.py).

A kind (``BadInput``) names the call it spoils (``schedule``, ``forward``, ``backward`` or
``create_workspace``), the exception type, a regex of the message that names the rule, and a
function that turns one rank's good arguments (``GoodCall``) into the bad ones. The API checks
every input before any work, so a rejected call writes nothing: the tests clone every tensor the
workspace, the schedule, the context, the inputs and the pre-made outputs hold (``snapshot``),
make the bad call, and compare (``changed``).

``deferred`` kinds are found on the device on the CUDA backend (sync-free): the call returns,
its schedule kernels run (they skip the bad slots), and the next host-visible point
(``ws.check_errors()``, or the next ``build_schedule``'s poll) raises. The reference backend
raises in the call itself.

A config that differs across the ranks of a group needs real ranks: it is tested where the ranks
are (``ELSEWHERE``) and counted with the table (``kinds_line``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mok_megatron import functional as F
from mok_megatron.functional.api import TENSOR_ALIGN_BYTES

__all__ = [
    "BadInput", "GoodCall", "KINDS", "ELSEWHERE", "PATHS", "FORMS", "kinds", "cases",
    "kinds_line", "good_call", "prepare", "make_call", "snapshot", "changed", "strided",
    "misaligned", "PREPARE", "snapshot_calls", "differing",
]  # fmt: skip

#: Where a kind applies: the reference backend, or the CUDA backend's forward paths.
PATHS = ("reference", "stage1", "megakernel")
#: The routed weights' forms: (gate, up, down), or the fused (gate_up, None, down).
FORMS = ("split", "fused")
CALLS = ("schedule", "forward", "backward", "create_workspace")
#: The good calls a kind's call needs first (the forward needs a schedule; the backward a
#: schedule and the forward's context).
PREPARE = {"schedule": (), "create_workspace": (), "forward": ("schedule",),
           "backward": ("schedule", "forward")}  # fmt: skip


@dataclass
class GoodCall:
    """One rank's good arguments for every call (a kind replaces some of them)."""

    config: F.MoKConfig
    ws: F.MoKWorkspace
    form: str
    topk: torch.Tensor  # [T, K] int64
    x: torch.Tensor  # [T, H], the workspace's dtype
    rw: torch.Tensor  # [T, K] float32
    routed: tuple  # (gate, up, down) or (gate_up, None, down)
    shared: tuple  # (gate [I_s, H], up, down [H, I_s])
    d_out: torch.Tensor  # [T, H]
    accumulators: tuple  # float32 buffers in routed's form, poisoned: nothing may land in them
    create: dict  # create_workspace's keyword arguments for the workspace's shape
    other_device: torch.device  # a device the workspace is not on
    num_local_experts: int | None = None
    num_ranks: int = 1  # create_workspace: > 1 makes virtual ranks (a shape rule over EP)
    sched: Any = None  # after prepare(..., "schedule")
    ctx: Any = None  # after prepare(..., "forward")

    def fields(self) -> dict:
        """The values a kind's message regex is formatted with (strings regex-escaped)."""
        ws = self.ws
        gate = "w_routed_gate" if self.form == "split" else _FUSED_GATE
        t = self.x.shape[0]
        return dict(
            E=ws.num_experts, E1=ws.num_experts + 1, El=ws.num_local_experts,
            El2=2 * ws.num_local_experts, El1=ws.num_local_experts + 1, K=ws.topk,
            K1=ws.topk + 1, T=ws.num_local_tokens, T2=2 * ws.num_local_tokens, N=t, N1=t - 1,
            H=ws.hidden_size, H2=2 * ws.hidden_size, H4=ws.hidden_size + 4,
            I=ws.intermediate_size, I2=2 * ws.intermediate_size, Is=self.shared[0].shape[0],
            gate=re.escape(gate),
            dtype=re.escape(str(ws.dtype)), device=re.escape(str(ws.device)),
            other=re.escape(str(self.other_device)),
        )  # fmt: skip


_FUSED_GATE = "w_routed_gate_up (w_routed_up=None: the fused form)"


@dataclass(frozen=True)
class BadInput:
    """One kind of bad input: ``spoil(good)`` is the bad call's arguments."""

    name: str
    call: str  # one of CALLS
    error: type[Exception]
    match: str  # a regex, formatted with GoodCall.fields()
    spoil: Callable[[GoodCall], GoodCall]
    deferred: bool = False  # CUDA backend: raised at the next host-visible point
    forms: tuple[str, ...] = FORMS
    where: tuple[str, ...] = PATHS

    def pattern(self, good: GoodCall) -> str:
        return self.match.format(**good.fields())


# ------------------------------------------------------------------------------ tensor makers
def strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor of its shape that is not contiguous (every other row of one
    twice as tall)."""
    tall = torch.empty((2 * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    view = tall[::2]
    view.copy_(t)
    assert not view.is_contiguous(), f"strided: {tuple(t.shape)} stays contiguous"
    return view


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a contiguous view that starts one element past an aligned address."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % TENSOR_ALIGN_BYTES, "misaligned: the view is aligned"
    return view


def _fp8_blocks_misaligned(w: torch.Tensor):
    """``w`` as a (128, 128)-block FP8BlockTensor whose data starts off an aligned address (the
    scales are ones: the alignment rule is checked before they are read)."""
    from mok_megatron.ops.fp8_blockwise import FP8BlockTensor

    blocks = (*w.shape[:-2], -(-w.shape[-2] // 128), -(-w.shape[-1] // 128))
    scales = torch.ones(blocks, dtype=torch.float32, device=w.device)
    return FP8BlockTensor(misaligned(w.to(torch.float8_e4m3fn)), scales, (128, 128))


def _with(**changes: Callable[[GoodCall], Any]) -> Callable[[GoodCall], GoodCall]:
    """A spoiler that replaces each named argument by ``change(good)``."""
    return lambda g: dataclasses.replace(g, **{k: f(g) for k, f in changes.items()})


def _slot(name: str, i: int, make: Callable[[torch.Tensor], Any]):
    """A spoiler that replaces slot ``i`` of the ``name`` tuple (routed, shared, accumulators)."""

    def change(g):
        values = list(getattr(g, name))
        values[i] = make(values[i])
        return tuple(values)

    return _with(**{name: change})


def _other_config(g: GoodCall) -> F.MoKConfig:
    c = g.ws.config
    return dataclasses.replace(c, bwd_num_comm_sms=c.bwd_num_comm_sms % 127 + 1)


def _expert_id(value: Callable[[GoodCall], int]):
    def change(g):
        topk = g.topk.clone()
        topk[min(3, topk.shape[0] - 1), topk.shape[1] - 1] = value(g)
        return topk

    return _with(topk=change)


def _resized_routed(g: GoodCall, experts: int, inter: int) -> tuple:
    """Routed weights of another shape: ``experts`` per rank, intermediate size ``inter``."""
    h, w = g.ws.hidden_size, g.routed[0]
    make = lambda *shape: torch.zeros(shape, dtype=w.dtype, device=w.device)
    if g.routed[1] is None:
        return make(experts, 2 * inter, h), None, make(experts, h, inter)
    return make(experts, inter, h), make(experts, inter, h), make(experts, h, inter)


def _unfused_gate(g: GoodCall) -> tuple:
    """(gate [E_l, I, H], None, down): gate alone where the fused form's gate_up goes."""
    gate = g.routed[0][:, : g.ws.intermediate_size].contiguous()
    return gate, None, g.routed[2]


def _split_again(g: GoodCall) -> tuple:
    from mok_megatron.ops import deinterleave_gate_up

    gate, up = deinterleave_gate_up(g.routed[0], dim=-2)
    return gate, up, g.routed[2]


def _built_and_new_weights(g: GoodCall) -> torch.Tensor:
    g.sched.ensure_built()  # the plan gathered g.rw: other weights no longer match it
    return g.rw.clone()


def _forward_without_save(g: GoodCall):
    return make_call("forward", g, save_for_backward=False)[1]


# --------------------------------------------------------------------------------- the table
_DEV = r"is on {other} but the workspace is on {device}"
_MIS = rf"starts at an address that is not {TENSOR_ALIGN_BYTES}-byte aligned .* multiple of"
_RW = r"router_weights has dtype torch\.{0}; expected one of \[torch\.float32\]"
_SPLIT, _FUSED = ("split",), ("fused",)


def _table() -> list[BadInput]:
    B = BadInput  # noqa: N806
    return [
        # ---- build_schedule: topk_experts [T, K] int64, router_weights [T, K]
        B("topk_not_a_tensor", "schedule", TypeError,
          r"topk_experts must be a torch\.Tensor, got list", _with(topk=lambda g: g.topk.tolist())),
        B("topk_int32", "schedule", TypeError,
          r"topk_experts has dtype torch\.int32; expected one of \[torch\.int64\]",
          _with(topk=lambda g: g.topk.int())),
        B("topk_1d", "schedule", ValueError, r"topk_experts has 1 dims .*; expected 2",
          _with(topk=lambda g: g.topk.flatten())),
        B("topk_other_device", "schedule", ValueError, "topk_experts " + _DEV,
          _with(topk=lambda g: g.topk.to(g.other_device))),
        B("topk_non_contiguous", "schedule", ValueError, r"topk_experts must be contiguous",
          _with(topk=lambda g: strided(g.topk))),
        B("topk_misaligned", "schedule", ValueError, r"topk_experts " + _MIS + rf" {TENSOR_ALIGN_BYTES // 8} int64",
          _with(topk=lambda g: misaligned(g.topk))),
        B("topk_more_tokens_than_workspace", "schedule", ValueError,
          r"topk_experts has {T2} tokens but the workspace holds at most num_local_tokens={T}",
          _with(topk=lambda g: torch.cat([g.topk, g.topk]),
                rw=lambda g: torch.cat([g.rw, g.rw]))),
        B("topk_wrong_number_of_slots", "schedule", ValueError,
          r"topk_experts has {K1} slots per token but the workspace was made for topk={K}",
          _with(topk=lambda g: torch.cat([g.topk, g.topk[:, :1]], 1))),
        B("expert_id_out_of_range", "schedule", ValueError, r"expert id outside \[-1, {E}\)",
          _expert_id(lambda g: g.ws.num_experts), deferred=True),
        B("expert_id_below_minus_one", "schedule", ValueError, r"expert id outside \[-1, {E}\)",
          _expert_id(lambda g: -2), deferred=True),
        B("num_local_experts_mismatch", "schedule", ValueError,
          r"num_local_experts={El1} but the workspace has {E} experts",
          _with(num_local_experts=lambda g: g.ws.num_local_experts + 1)),
        B("schedule_config_differs_from_workspace", "schedule", ValueError,
          r"differs from the one the workspace was made with", _with(config=_other_config)),
        B("schedule_router_weights_float16", "schedule", TypeError,
          r"router_weights has dtype torch\.float16; expected one of \[torch\.float32, "
          r"torch\.float64\]", _with(rw=lambda g: g.rw.half())),
        B("schedule_router_weights_shape", "schedule", ValueError,
          r"router_weights has shape \({N}, 1\); it must match topk_experts' \({N}, {K}\)",
          _with(rw=lambda g: g.rw[:, :1].contiguous())),
        # ---- forward: x [T, H]
        B("forward_config_differs_from_workspace", "forward", ValueError,
          r"differs from the one the workspace was made with", _with(config=_other_config)),
        B("x_not_a_tensor", "forward", TypeError, r"x must be a torch\.Tensor, got list",
          _with(x=lambda g: g.x.tolist())),
        B("x_int", "forward", TypeError, r"x has dtype torch\.int32; expected one of",
          _with(x=lambda g: g.x.int())),
        B("x_other_float_than_workspace", "forward", TypeError,
          r"x has dtype torch\.float16 but the workspace was made for dtype={dtype}",
          _with(x=lambda g: g.x.half())),
        B("x_3d", "forward", ValueError, r"x has 3 dims .*; expected 2",
          _with(x=lambda g: g.x[None])),
        B("x_other_device", "forward", ValueError, "x " + _DEV,
          _with(x=lambda g: g.x.to(g.other_device))),
        B("x_non_contiguous", "forward", ValueError, r"x must be contiguous",
          _with(x=lambda g: strided(g.x))),
        B("x_misaligned", "forward", ValueError,
          rf"x starts at an address that is not {TENSOR_ALIGN_BYTES}-byte aligned \(.*\); pass "
          r"x\.clone\(\) \(a fresh "
          r"tensor\), or a view that starts at a multiple of", _with(x=lambda g: misaligned(g.x))),
        B("x_more_tokens_than_workspace", "forward", ValueError,
          r"x has {T2} tokens but the workspace holds at most num_local_tokens={T}",
          _with(x=lambda g: torch.cat([g.x, g.x]))),
        B("x_tokens_differ_from_schedule", "forward", ValueError,
          r"x has {N1} tokens but the schedule was built for {N}",
          _with(x=lambda g: g.x[:-1].clone())),
        B("x_hidden_size_differs_from_workspace", "forward", ValueError,
          r"x has hidden size {H2}, the workspace {H}",
          _with(x=lambda g: torch.cat([g.x, g.x], 1))),
        # ---- forward: router_weights [T, K] float32
        B("router_weights_float16", "forward", TypeError, _RW.format("float16"),
          _with(rw=lambda g: g.rw.half())),
        B("router_weights_float64_for_low_precision_x", "forward", TypeError,
          _RW.format("float64"), _with(rw=lambda g: g.rw.double())),
        B("router_weights_shape", "forward", ValueError,
          r"router_weights has shape \({N}, 1\); it must match topk_experts' \[T, K\] = "
          r"\[{N}, {K}\]", _with(rw=lambda g: g.rw[:, :1].contiguous())),
        B("router_weights_non_contiguous", "forward", ValueError,
          r"router_weights must be contiguous", _with(rw=lambda g: strided(g.rw))),
        B("router_weights_misaligned", "forward", ValueError, r"router_weights " + _MIS,
          _with(rw=lambda g: misaligned(g.rw))),
        # ---- forward: routed weights [E_l, I, H] x2, [E_l, H, I] (fused: [E_l, 2I, H], None, down)
        B("routed_gate_float64", "forward", TypeError,
          r"{gate} has dtype torch\.float64; expected one of \[{dtype}\]",
          _slot("routed", 0, lambda w: w.double())),
        B("routed_up_float64", "forward", TypeError, r"w_routed_up has dtype torch\.float64",
          _slot("routed", 1, lambda w: w.double()), forms=_SPLIT),
        B("routed_down_transposed", "forward", ValueError,
          r"w_routed_down has shape \({El}, {I}, {H}\), expected \({El}, {H}, {I}\)",
          _slot("routed", 2, lambda w: w.transpose(1, 2).contiguous())),
        B("routed_gate_2d", "forward", ValueError, r"{gate} has 2 dims .*; expected 3",
          _slot("routed", 0, lambda w: w[0])),
        B("routed_gate_not_a_tensor", "forward", TypeError,
          r"{gate} must be a torch\.Tensor, got ndarray",
          _slot("routed", 0, lambda w: w.float().cpu().numpy())),
        B("routed_gate_other_device", "forward", ValueError, r"{gate} " + _DEV,
          lambda g: _slot("routed", 0, lambda w: w.to(g.other_device))(g)),
        B("routed_gate_non_contiguous", "forward", ValueError, r"{gate} must be contiguous",
          _slot("routed", 0, lambda w: w.transpose(1, 2).contiguous().transpose(1, 2))),
        B("routed_down_misaligned", "forward", ValueError, r"w_routed_down " + _MIS,
          _slot("routed", 2, misaligned)),
        B("routed_down_fp8_blocks_misaligned", "forward", ValueError,
          rf"w_routed_down\.data starts at an address that is not {TENSOR_ALIGN_BYTES}-byte "
          r"aligned .*quantise a fresh tensor", _slot("routed", 2, _fp8_blocks_misaligned)),
        B("routed_weights_of_another_intermediate_size", "forward", ValueError,
          r"{gate} has shape .*, expected ",
          _with(routed=lambda g: _resized_routed(g, g.ws.num_local_experts,
                                                 g.ws.intermediate_size + 8))),
        B("routed_weights_for_another_number_of_experts", "forward", ValueError,
          r"{gate} has shape \({El2}, .*, expected \({El}, ",
          _with(routed=lambda g: _resized_routed(g, 2 * g.ws.num_local_experts,
                                                 g.ws.intermediate_size))),
        B("routed_gate_and_up_both_none", "forward", ValueError,
          r"w_routed_gate and w_routed_up are both None",
          _with(routed=lambda g: (None, None, g.routed[2]))),
        B("routed_up_none_with_an_unfused_gate", "forward", ValueError,
          re.escape(_FUSED_GATE) + r" has shape \({El}, {I}, {H}\), expected \({El}, {I2}, {H}\)",
          _with(routed=_unfused_gate)),
        # ---- forward: shared expert [I_s, H], [I_s, H], [H, I_s]
        B("shared_weights_partial", "forward", ValueError,
          r"pass all three shared-expert weights or none of them",
          _with(shared=lambda g: (g.shared[0], None, None))),
        B("shared_up_float64", "forward", TypeError, r"w_shared_up has dtype torch\.float64",
          _slot("shared", 1, lambda w: w.double())),
        B("shared_down_transposed", "forward", ValueError,
          r"w_shared_down has shape \({Is}, {H}\), expected \({H}, {Is}\)",
          _slot("shared", 2, lambda w: w.T.contiguous())),
        B("shared_gate_non_contiguous", "forward", ValueError, r"w_shared_gate must be contiguous",
          _slot("shared", 0, lambda w: w.T.contiguous().T)),
        B("shared_gate_misaligned", "forward", ValueError, r"w_shared_gate " + _MIS,
          _slot("shared", 0, misaligned)),
        # ---- forward, CUDA only: the megakernel's own rules
        B("megakernel_with_separate_gate_and_up", "forward", ValueError,
          r"MoKConfig\.cuda_forward='megakernel' takes the fused gate/up weights",
          _with(routed=_split_again), forms=_FUSED, where=("megakernel",)),
        B("megakernel_router_weights_not_the_scheduled_ones", "forward", ValueError,
          r"the megakernel forward needs the router weights given to build_schedule",
          _with(rw=_built_and_new_weights), forms=_FUSED, where=("megakernel",)),
        # ---- backward: d_out [T, H] in x's dtype, and the forward's checks again
        B("backward_config_differs_from_workspace", "backward", ValueError,
          r"differs from the one the workspace was made with", _with(config=_other_config)),
        B("backward_routed_down_transposed", "backward", ValueError, r"w_routed_down has shape",
          _slot("routed", 2, lambda w: w.transpose(1, 2).contiguous())),
        B("d_out_float64", "backward", TypeError,
          r"d_out has dtype torch\.float64; expected one of \[{dtype}\]",
          _with(d_out=lambda g: g.d_out.double())),
        B("d_out_shape", "backward", ValueError,
          r"d_out has shape \({N1}, {H}\), expected x's \({N}, {H}\)",
          _with(d_out=lambda g: g.d_out[:-1].clone())),
        B("d_out_other_device", "backward", ValueError, "d_out " + _DEV,
          _with(d_out=lambda g: g.d_out.to(g.other_device))),
        B("d_out_non_contiguous", "backward", ValueError, r"d_out must be contiguous",
          _with(d_out=lambda g: strided(g.d_out))),
        B("d_out_misaligned", "backward", ValueError, r"d_out " + _MIS,
          _with(d_out=lambda g: misaligned(g.d_out))),
        B("backward_after_a_forward_that_kept_nothing", "backward", RuntimeError,
          r"the forward kept nothing for a backward \(save_for_backward=False",
          _with(ctx=_forward_without_save), where=("stage1", "megakernel")),
        # ---- backward: wgrad_accumulators (api.check_wgrad_accumulators)
        B("accumulators_two_buffers", "backward", TypeError,
          r"wgrad_accumulators must be 3 buffers in the routed weights' order.*; got tuple of 2",
          _with(accumulators=lambda g: g.accumulators[:2])),
        B("accumulators_not_a_sequence", "backward", TypeError,
          r"wgrad_accumulators must be 3 buffers .*; got Tensor",
          _with(accumulators=lambda g: g.accumulators[0])),
        B("accumulators_fused_up_slot_not_none", "backward", ValueError,
          r"wgrad_accumulators\[1\] must be None with the fused gate/up form",
          _with(accumulators=lambda g: (g.accumulators[0], g.accumulators[0].clone(),
                                        g.accumulators[2])), forms=_FUSED),
        B("accumulator_bfloat16", "backward", TypeError,
          r"wgrad_accumulators\[0\] has dtype torch\.bfloat16; .* pass a float32 buffer",
          _slot("accumulators", 0, lambda a: a.bfloat16())),
        B("accumulator_float64_for_low_precision_x", "backward", TypeError,
          r"wgrad_accumulators\[2\] has dtype torch\.float64",
          _slot("accumulators", 2, lambda a: a.double())),
        B("accumulator_shape", "backward", ValueError,
          r"wgrad_accumulators\[2\] has shape .*; an accumulator has its weight's shape",
          lambda g: _slot("accumulators", 2, lambda a: g.accumulators[0].clone())(g)),
        B("accumulator_other_device", "backward", ValueError, r"wgrad_accumulators\[0\] " + _DEV,
          lambda g: _slot("accumulators", 0, lambda a: a.to(g.other_device))(g)),
        B("accumulator_non_contiguous", "backward", ValueError,
          r"wgrad_accumulators\[2\] must be contiguous",
          _slot("accumulators", 2, lambda a: a.transpose(1, 2).contiguous().transpose(1, 2))),
        B("accumulator_misaligned", "backward", ValueError,
          r"wgrad_accumulators\[2\] " + _MIS + rf" {TENSOR_ALIGN_BYTES // 4} float32 elements",
          _slot("accumulators", 2, misaligned)),
        B("accumulator_requires_grad", "backward", ValueError,
          r"wgrad_accumulators\[0\] requires grad; .* pass it detached",
          _slot("accumulators", 0, lambda a: a.clone().requires_grad_())),
        B("accumulator_not_a_tensor", "backward", TypeError,
          r"wgrad_accumulators\[2\] must be a torch\.Tensor .*, got str",
          _slot("accumulators", 2, lambda a: "main_grad")),
        # ---- create_workspace: the shape (workspace._validate_shape), the config, the backend
        B("topk_larger_than_num_experts", "create_workspace", ValueError,
          r"topk={E1} must be in \[1, num_experts={E}\]",
          _with(create=lambda g: {**g.create, "topk": g.ws.num_experts + 1})),
        B("topk_zero", "create_workspace", ValueError, r"topk=0 must be in \[1, num_experts",
          _with(create=lambda g: {**g.create, "topk": 0})),
        B("negative_num_local_tokens", "create_workspace", ValueError,
          r"num_local_tokens=-1, .*: tokens must be >= 0 and sizes > 0",
          _with(create=lambda g: {**g.create, "num_local_tokens": -1})),
        B("zero_hidden_size", "create_workspace", ValueError,
          r"hidden_size=0, .*: tokens must be >= 0 and sizes > 0",
          _with(create=lambda g: {**g.create, "hidden_size": 0})),
        B("zero_intermediate_size", "create_workspace", ValueError,
          r"intermediate_size=0: tokens must be >= 0 and sizes > 0",
          _with(create=lambda g: {**g.create, "intermediate_size": 0})),
        B("num_experts_not_divisible_by_ep", "create_workspace", ValueError,
          r"num_experts={E1} must be divisible by the expert-parallel size 2",
          _with(create=lambda g: {**g.create, "num_experts": g.ws.num_experts + 1},
                num_ranks=lambda g: 2)),
        B("config_not_a_mokconfig", "create_workspace", TypeError,
          r"config must be a MoKConfig, got dict", _with(config=lambda g: g.config.to_dict())),
        B("cuda_backend_hidden_size_not_a_multiple_of_8", "create_workspace", RuntimeError,
          r"backend='cuda' was asked for but cannot run this workspace: .*hidden_size={H4} is "
          r"not a multiple of 8", _with(create=lambda g: {**g.create,
                                                          "hidden_size": g.ws.hidden_size + 4}),
          where=("stage1", "megakernel")),
        B("cuda_backend_float32_activations", "create_workspace", RuntimeError,
          r"backend='cuda' was asked for but cannot run this workspace: .*the CUDA backend takes "
          r"bfloat16 activations, not torch\.float32",
          _with(create=lambda g: {**g.create, "dtype": torch.float32}),
          where=("stage1", "megakernel")),
        B("unknown_backend", "create_workspace", ValueError,
          r"backend='triton' must be one of", _with(create=lambda g: {**g.create,
                                                                      "backend": "triton"})),
    ]  # fmt: skip


KINDS: tuple[BadInput, ...] = tuple(_table())
assert len({k.name for k in KINDS}) == len(KINDS), "bad-input kinds need unique names"
assert all(k.call in CALLS for k in KINDS)

#: Kinds that need real ranks, and where they are tested.
ELSEWHERE = {
    "config_differs_across_ranks": (
        "tests/cpu/test_functional_ep.py::test_configs_that_differ_across_ranks_are_rejected "
        "(gloo, EP 2); tests/gpu/test_bad_input_cuda.py::"
        "test_ep2_config_differs_across_ranks_is_rejected (NCCL, -m multigpu)"
    ),
}


def kinds(path: str | None = None, calls: tuple[str, ...] = CALLS) -> list[BadInput]:
    """The kinds that apply on ``path`` (one of PATHS; None: all) to the ``calls`` given."""
    return [k for k in KINDS if (path is None or path in k.where) and k.call in calls]


def cases(path: str, forms: tuple[str, ...] = FORMS, calls: tuple[str, ...] = CALLS) -> list:
    """(kind, form) pairs to run on ``path``: each kind in each of ``forms`` it applies to."""
    return [(k, f) for k in kinds(path, calls) for f in forms if f in k.forms]


def kinds_line(path: str | None = None) -> str:
    """The line a report prints: "N kinds tried on PATH: ..."."""
    table = kinds(path)
    deferred = sum(k.deferred for k in table)
    return (f"{len(table) + len(ELSEWHERE)} kinds tried on {path or 'every path'}: "
            f"{len(table)} in the table ({deferred} deferred on the CUDA backend), "
            f"{len(ELSEWHERE)} with real ranks ({', '.join(ELSEWHERE)})")  # fmt: skip


# ------------------------------------------------------------------------------- the calls
def good_call(config, ws, problem, rank: int, form: str, dtype, device, other_device,
              backend: str, seed: int = 0) -> GoodCall:  # fmt: skip
    """Rank ``rank``'s good arguments from ``problem`` (an ``oracles.MoEProblem`` with a shared
    expert) for ``ws``; ``backend``: what ``create`` asks create_workspace for."""
    from mok_megatron.ops import interleave_gate_up
    from mok_megatron.testing.poison import poison_

    x, topk, rw, routed, shared = problem.local(rank, dtype, device)
    if form == "fused":
        routed = (interleave_gate_up(routed[0], routed[1]), None, routed[2])
    gen = torch.Generator().manual_seed(seed)
    d_out = torch.randn(x.shape, generator=gen, dtype=torch.float32).to(device, dtype)
    poisoned = lambda w: poison_(torch.empty(w.shape, dtype=torch.float32, device=device))
    acc = tuple(None if w is None else poisoned(w) for w in routed)
    create = dict(device=ws.device, num_local_tokens=ws.num_local_tokens,
                  hidden_size=ws.hidden_size, topk=ws.topk, num_experts=ws.num_experts,
                  intermediate_size=ws.intermediate_size,
                  shared_intermediate_size=ws.shared_intermediate_size, dtype=ws.dtype,
                  backend=backend)  # fmt: skip
    return GoodCall(config, ws, form, topk, x, rw, tuple(routed), tuple(shared), d_out, acc,
                    create, torch.device(other_device), ws.num_local_experts)  # fmt: skip


def make_call(call: str, g: GoodCall, **kwargs) -> Any:
    """Make ``call`` with ``g``'s arguments (backward: into g.accumulators)."""
    if call == "schedule":
        return F.build_schedule(g.ws, g.config, g.topk, g.num_local_experts, router_weights=g.rw)
    if call == "forward":
        return F.forward(g.config, g.ws, g.sched, g.x, g.rw, *g.shared, *g.routed, **kwargs)
    if call == "backward":
        return F.backward(g.config, g.ws, g.sched, g.ctx, g.d_out, g.x, g.rw, *g.shared,
                          *g.routed, wgrad_accumulators=g.accumulators)  # fmt: skip
    if g.num_ranks > 1:
        create = {k: v for k, v in g.create.items() if k != "backend"}
        return F.create_virtual_workspaces(g.config, g.num_ranks, **create)
    return F.create_workspace(g.config, None, **g.create)


def prepare(g: GoodCall, step: str) -> None:
    """One good call a kind's call needs first (PREPARE): "schedule" sets g.sched, "forward"
    g.ctx."""
    if step == "schedule":
        g.sched = make_call("schedule", g)
    else:
        g.ctx = make_call("forward", g)[1]


# ------------------------------------------------------------------------- nothing written
def snapshot(*roots) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, tensor, clone) for every tensor reachable from ``roots`` (through attributes,
    dicts, lists and tuples, each object once): what a rejected call must leave unchanged."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    _walk(roots, "", found, set(), depth=0)
    return [(name, t, t.detach().clone()) for name, t in found.values()]


def snapshot_calls(*calls: GoodCall) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``snapshot`` of everything the calls' workspaces own (``ws.buffers``: on the CUDA backend
    the symmetric buffer, the peer and signal tables, the pinned error record; the error
    monitor's words) and of the calls' arguments (inputs, schedule, context, accumulators)."""
    return snapshot(*[root for c in calls for root in (c.ws.buffers, c.ws.monitor, c)])


def changed(snap) -> list[str]:
    """The names of the tensors of ``snap`` whose bytes differ from their clones."""
    return [name for name, t, before in snap if not _same_bytes(t, before)]


def differing(a: dict, b: dict) -> list[str]:
    """The names whose tensors differ bitwise between two dicts of outputs (None: absent)."""
    names = sorted(set(a) | set(b))
    return [n for n in names if (a.get(n) is None) != (b.get(n) is None)
            or (a.get(n) is not None and not _same_bytes(a[n], b[n]))]  # fmt: skip


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    flat = lambda t: t.detach().reshape(-1).contiguous().view(torch.uint8)
    return torch.equal(flat(a), flat(b))


_LEAVES = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)


def _walk(obj, name: str, found: dict, seen: set, depth: int) -> None:
    if isinstance(obj, _LEAVES) or id(obj) in seen or depth > 8:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "meta":
            found.setdefault(id(obj), (name, obj))
        return
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif callable(obj) or not hasattr(obj, "__dict__") or isinstance(obj, _OPAQUE):
        return
    else:
        items = vars(obj).items()  # never getattr: a pending schedule would build itself
    for key, value in items:
        _walk(value, f"{name}.{key}" if name else str(key), found, seen, depth + 1)


_OPAQUE = (F.MoKWorkspace, torch.nn.Module)
