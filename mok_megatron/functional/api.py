"""The functional API every backend meets (DESIGN.md, "The functional API").

``build_schedule`` → ``forward`` → ``backward`` (or ``recompute_forward_context`` first, for
activation checkpointing). Each call is a collective over the workspace's expert-parallel group.
This module checks every input and hands the call to ``ws.backend``: one contract for every
backend (each tensor contiguous, on the workspace's device, starting on a TENSOR_ALIGN_BYTES
boundary; x in the workspace's dtype), checked before any work, so a rejected call writes nothing
(``mok_megatron.testing.bad_input`` tabulates every kind of bad input).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from .config import MoKConfig
from .schedule import MoKSchedule
from .types import ExpertWeights, FusedExpertWeights, MoKGradients
from .workspace import MoKWorkspace, check_all_errors
from .workspace import poll_errors as poll_all_errors

__all__ = [
    "build_schedule", "forward", "backward", "backward_steps", "recompute_forward_context",
    "check_errors", "poll_errors", "check_wgrad_accumulators", "TENSOR_ALIGN_BYTES",
]  # fmt: skip

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

#: Where every tensor argument (inputs, weights, accumulators) must start: the CUDA kernels read
#: and write them by TMA and 16-byte vector loads. One contract for every backend; an empty
#: tensor is exempt (nothing is read).
TENSOR_ALIGN_BYTES = 16
#: Why, in the error for a tensor that breaks the rule.
_ALIGN_WHY = "the CUDA kernels read it by TMA and 16-byte vector loads; a view at an odd offset?"


def build_schedule(
    ws: MoKWorkspace,
    config: MoKConfig,
    topk_experts: torch.Tensor,
    num_local_experts: int | None = None,
    router_weights: torch.Tensor | None = None,
) -> MoKSchedule:
    """Gather every rank's routing and plan this rank's rows; no host sync.

    topk_experts: [T, K], int64 global expert ids, -1 = empty slot; T <= ws.num_local_tokens.
    router_weights (optional): [T, K] float32, gathered in the same collective; ``forward`` then
    reuses them when it is given this same tensor (unchanged), instead of gathering again.
    An expert id out of range, or routing over the schedule's capacity, raises at the next
    host-visible point (at once on CPU).
    """
    _check_config(ws, config)
    if num_local_experts is not None and num_local_experts != ws.num_local_experts:
        raise ValueError(
            f"num_local_experts={num_local_experts} but the workspace has "
            f"{ws.num_experts} experts over {ws.num_ranks} ranks = {ws.num_local_experts} each"
        )
    _check_tensor("topk_experts", topk_experts, ws, dtypes=(torch.int64,), ndim=2)
    _check_tokens("topk_experts", topk_experts, ws)
    if topk_experts.shape[1] != ws.topk:
        raise ValueError(
            f"topk_experts has {topk_experts.shape[1]} slots per token but the workspace was made "
            f"for topk={ws.topk}"
        )
    if router_weights is not None:
        _check_tensor(
            "router_weights", router_weights, ws, dtypes=(torch.float32, torch.float64), ndim=2
        )
        if router_weights.shape != topk_experts.shape:
            raise ValueError(
                f"router_weights has shape {tuple(router_weights.shape)}; it must match "
                f"topk_experts' {tuple(topk_experts.shape)}"
            )
    ws.monitor.poll()
    sched = ws.backend.build_schedule(ws, topk_experts, router_weights)
    if not sched.is_pending():  # a pending schedule submits its flags when it is built
        ws.monitor.submit(sched.error_flags, "mok build_schedule")
    return sched


def forward(
    config: MoKConfig,
    ws: MoKWorkspace,
    sched: MoKSchedule,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    w_shared_gate: Any,
    w_shared_up: Any,
    w_shared_down: Any,
    w_routed_gate: Any,
    w_routed_up: Any,
    w_routed_down: Any,
    *,
    save_for_backward: bool = True,
) -> tuple[torch.Tensor, Any]:
    """out[t] = Σ_k router_weights[t, k] · FFN_{e(t, k)}(x[t]) + FFN_shared(x[t]).

    x: [T, H], the workspace's dtype; router_weights: [T, K], float32 (float64 too when x is);
    routed weights in x's dtype, [E_l, I, H], [E_l, I, H], [E_l, H, I] (tensors, MXFP8 tuples
    from ``ops.mxfp8_quantize``, or (128, 128) ``FP8BlockTensor`` s from
    ``ops.fp8_blockwise_quantize``, which an ``expert_precision="fp8_blockwise"`` forward uses
    as given), or the fused form (gate_up [E_l, 2I, H] interleaved as ``ops.interleave_gate_up``
    makes it, None, down): see ``FusedExpertWeights``; shared weights [I_s, H], [I_s, H],
    [H, I_s] or all None. Returns ``out: [T, H]`` in x's dtype and the backend's context.
    ``save_for_backward=False`` (no backward will follow, e.g. under ``torch.no_grad()``): the
    CUDA backend keeps no activations and the context cannot serve ``backward``.
    """
    shared, routed = _check_call(config, ws, sched, x, router_weights,
                                 (w_shared_gate, w_shared_up, w_shared_down),
                                 (w_routed_gate, w_routed_up, w_routed_down))  # fmt: skip
    return ws.backend.forward(ws, sched, x, router_weights, shared, routed,
                              save=save_for_backward)  # fmt: skip


def recompute_forward_context(config, ws, sched, x, router_weights, *weights) -> Any:
    """Rebuild the context ``forward`` would have returned (activation checkpointing).

    Takes the same arguments as ``forward``; the output is recomputed and dropped.
    """
    return forward(config, ws, sched, x, router_weights, *weights)[1]


def backward(
    config: MoKConfig,
    ws: MoKWorkspace,
    sched: MoKSchedule,
    ctx: Any,
    d_out: torch.Tensor,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    w_shared_gate: Any,
    w_shared_up: Any,
    w_shared_down: Any,
    w_routed_gate: Any,
    w_routed_up: Any,
    w_routed_down: Any,
    *,
    wgrad_accumulators: tuple[torch.Tensor | None, ...] | None = None,
) -> MoKGradients:
    """All eight gradients of ``forward`` (``MoKGradients``, unpacks in the documented order).

    d_out: [T, H], x's dtype. Weight gradients come in each weight's dtype (x's for quantised
    ones); with the fused gate/up form, ``d_w_routed_gate`` is gate_up's gradient (same layout)
    and ``d_w_routed_up`` is None.

    wgrad_accumulators: None (return the routed-weight gradients), or one buffer per routed
    weight, in the weights' order and form: (gate [E_l, I, H], up [E_l, I, H], down [E_l, H, I]),
    or (gate_up [E_l, 2I, H], None, down) with the fused form; float32 (float64 too when x is),
    contiguous, 16-byte aligned, on the workspace's device (Megatron's fp32 ``main_grad`` is
    one). Each routed weight's gradient is then added into its buffer (gradient-accumulation
    fusion: on the CUDA engine, inside the weight-gradient GEMM) instead of being returned: its
    slot comes back None. The adds run in one fixed order (with macrobatch rounds, round after
    round), so the buffers are bitwise reproducible; an expert that received no rows leaves its
    part of every buffer untouched.
    """
    shared_in = (w_shared_gate, w_shared_up, w_shared_down)
    routed_in = (w_routed_gate, w_routed_up, w_routed_down)
    shared, routed, accumulators = _check_backward(
        config, ws, sched, d_out, x, router_weights, shared_in, routed_in, wgrad_accumulators
    )
    grads = ws.backend.backward(ws, sched, ctx, d_out, x, router_weights, shared, routed,
                                wgrad_acc=accumulators)  # fmt: skip
    return _cast_weight_grads(grads, shared_in, routed_in, x.dtype)


def backward_steps(config, ws, sched, ctx, d_out, x, router_weights, *weights,
                   wgrad_accumulators=None) -> Iterator:  # fmt: skip
    """``backward`` in two steps, for autograd (``functional.moe``): an iterator whose first
    ``next`` gives the routed down weight's gradient (None where ``backward`` has None there)
    and whose second gives every other gradient (``MoKGradients``, d_w_routed_down None).

    Autograd can then add the down gradient into its ``.grad`` and let it go before the gate/up
    gradient is made, so the two weight-sized gradients never exist at once. The arguments are
    ``backward``'s, checked now. ``ctx`` serves this one backward: the CUDA backend lets each
    kept activation go after its last read. A backend without such steps runs its whole
    ``backward`` at the first ``next``.
    """
    shared_in, routed_in = weights[:3], weights[3:]
    shared, routed, accumulators = _check_backward(
        config, ws, sched, d_out, x, router_weights, shared_in, routed_in, wgrad_accumulators
    )
    args = (ws, sched, ctx, d_out, x, router_weights, shared, routed)
    if hasattr(ws.backend, "backward_steps"):
        steps = ws.backend.backward_steps(*args, wgrad_acc=accumulators)
    else:
        steps = _all_at_once(ws.backend, args, accumulators)
    return _cast_steps(steps, shared_in, routed_in, x.dtype)


def _all_at_once(backend, args, accumulators) -> Iterator:
    grads = backend.backward(*args, wgrad_acc=accumulators)
    yield grads.d_w_routed_down
    yield grads._replace(d_w_routed_down=None)


def _cast_steps(steps, shared_in, routed_in, x_dtype) -> Iterator:
    # NOTE: no local names the down gradient (this frame lives until the second step)
    yield _cast_weight_grad(next(steps), routed_in[2], x_dtype)
    yield _cast_weight_grads(next(steps), shared_in, routed_in, x_dtype)


def _check_backward(config, ws, sched, d_out, x, router_weights, shared_in, routed_in,
                    wgrad_accumulators):  # fmt: skip
    """``backward``'s arguments checked: (shared, routed, accumulators) in the backend's forms."""
    shared, routed = _check_call(config, ws, sched, x, router_weights, shared_in, routed_in)
    _check_tensor("d_out", d_out, ws, dtypes=(x.dtype,), ndim=2)
    if d_out.shape != x.shape:
        raise ValueError(f"d_out has shape {tuple(d_out.shape)}, expected x's {tuple(x.shape)}")
    accumulators = check_wgrad_accumulators(wgrad_accumulators, ws, x.dtype, routed_in)
    return shared, routed, accumulators


def check_wgrad_accumulators(accumulators, ws: MoKWorkspace, dtype: torch.dtype, routed_in):
    """``backward``'s ``wgrad_accumulators`` checked against the routed weights ``routed_in``
    (as passed: tensors or MXFP8 tuples; ``dtype`` is x's): None, or the buffers as
    ``ExpertWeights`` / ``FusedExpertWeights`` (the weights' form). Raises naming the rule."""
    if accumulators is None:
        return None
    fused = routed_in[1] is None
    form = "(gate_up, None, down) for the fused gate/up form" if fused else "(gate, up, down)"
    if not isinstance(accumulators, (tuple, list)) or len(accumulators) != 3:
        raise TypeError(
            f"wgrad_accumulators must be 3 buffers in the routed weights' order, {form}; got "
            f"{type(accumulators).__name__}"
            + (f" of {len(accumulators)}" if isinstance(accumulators, (tuple, list)) else "")
        )
    if fused and accumulators[1] is not None:
        raise ValueError(
            "wgrad_accumulators[1] must be None with the fused gate/up form (w_routed_up=None): "
            "gate_up's gradient goes into wgrad_accumulators[0]"
        )
    dtypes = (torch.float32, torch.float64) if dtype == torch.float64 else (torch.float32,)
    slots = (0, 2) if fused else (0, 1, 2)
    for slot in slots:
        shape = _dense_shape(routed_in[slot]) if routed_in[slot] is not None else None
        _check_accumulator(f"wgrad_accumulators[{slot}]", accumulators[slot], shape, ws, dtypes)
    if fused:
        return FusedExpertWeights(accumulators[0], accumulators[2])
    return ExpertWeights(*accumulators)


def _check_accumulator(name, buf, shape, ws, dtypes) -> None:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (its weight's fp32 gradient buffer), got "
                        f"{type(buf).__name__}")  # fmt: skip
    if buf.dtype not in dtypes:
        also = " (or float64, as x is float64)" if torch.float64 in dtypes else ""
        raise TypeError(
            f"{name} has dtype {buf.dtype}; weight gradients accumulate in float32{also}, like "
            "Megatron's fp32 main_grad: pass a float32 buffer"
        )
    if shape is not None and tuple(buf.shape) != tuple(shape):
        raise ValueError(
            f"{name} has shape {tuple(buf.shape)}; an accumulator has its weight's shape "
            f"{tuple(shape)}"
        )
    _check_tensor(name, buf, ws, dtypes=dtypes, ndim=len(buf.shape),
                  why="the weight-gradient GEMM's epilogue reads and writes it by TMA",
                  fix="pass a fresh tensor")  # fmt: skip
    if buf.requires_grad:
        raise ValueError(
            f"{name} requires grad; an accumulator is a plain buffer (like main_grad): pass "
            "it detached"
        )


def check_errors(ws: MoKWorkspace | None = None) -> None:
    """Wait for the device and raise if an earlier call recorded an error (a capacity overflow
    or a bad expert id), on ``ws`` or, when None, on every live workspace. A host sync."""
    if ws is None:
        check_all_errors()
    else:
        ws.check_errors()


def poll_errors() -> None:
    """Raise for any error that a finished pass (eager or a CUDA-graph replay) recorded on any
    live workspace; never blocks. Call it where the host syncs anyway, e.g. once per training
    step after the loss is on the host (``mok_megatron.megatron``'s trainers and launcher do)."""
    poll_all_errors()


# ------------------------------------------------------------------------------ validation
def _check_call(config, ws, sched, x, router_weights, shared_in, routed_in):
    _check_config(ws, config)
    _check_tensor("x", x, ws, dtypes=_FLOAT_DTYPES, ndim=2)
    if x.dtype != ws.dtype:
        raise TypeError(
            f"x has dtype {x.dtype} but the workspace was made for dtype={ws.dtype}; make a "
            "workspace per activation dtype (create_workspace(..., dtype=x.dtype))"
        )
    _check_tokens("x", x, ws)
    if x.shape[0] != sched.num_tokens:
        raise ValueError(
            f"x has {x.shape[0]} tokens but the schedule was built for {sched.num_tokens}"
        )
    if x.shape[1] != ws.hidden_size:
        raise ValueError(f"x has hidden size {x.shape[1]}, the workspace {ws.hidden_size}")
    rw_dtypes = (torch.float32, torch.float64) if x.dtype == torch.float64 else (torch.float32,)
    _check_tensor("router_weights", router_weights, ws, dtypes=rw_dtypes, ndim=2)
    if router_weights.shape != (x.shape[0], ws.topk):
        raise ValueError(
            f"router_weights has shape {tuple(router_weights.shape)}; it must match "
            f"topk_experts' [T, K] = [{x.shape[0]}, {ws.topk}]"
        )
    e_l, h, i = ws.num_local_experts, ws.hidden_size, ws.intermediate_size
    if routed_in[1] is None:  # the fused gate/up form
        routed = _fused_expert_weights(routed_in, ws, x.dtype)
    else:
        shapes = [(e_l, i, h)] * 2 + [(e_l, h, i)]
        routed = ExpertWeights(*_expert_weights("w_routed", routed_in, ws, x.dtype, shapes))
    shared = None
    if any(w is not None for w in shared_in):
        if any(w is None for w in shared_in):
            raise ValueError("pass all three shared-expert weights or none of them")
        i_s = _dense_shape(shared_in[0])[0]
        shapes = [(i_s, h)] * 2 + [(h, i_s)]
        shared = ExpertWeights(*_expert_weights("w_shared", shared_in, ws, x.dtype, shapes))
    return shared, routed


def _fused_expert_weights(routed_in, ws, dtype) -> FusedExpertWeights:
    from mok_megatron.ops.grouped_gemm import SWIGLU_INTERLEAVE

    e_l, h, i = ws.num_local_experts, ws.hidden_size, ws.intermediate_size
    gate_up, _, down = routed_in
    if gate_up is None:
        raise ValueError(
            "w_routed_gate and w_routed_up are both None; pass the routed experts' weights"
        )
    if i % SWIGLU_INTERLEAVE:
        raise ValueError(
            f"the fused gate/up form (w_routed_up=None) needs intermediate_size={i} to be a "
            f"multiple of {SWIGLU_INTERLEAVE} (its interleave block); pass gate and up separately"
        )
    return FusedExpertWeights(*_expert_weights(
        "w_routed", (gate_up, down), ws, dtype, [(e_l, 2 * i, h), (e_l, h, i)],
        roles=("gate_up (w_routed_up=None: the fused form)", "down"),
    ))  # fmt: skip


def _expert_weights(prefix, weights, ws, dtype, shapes, roles=("gate", "up", "down")) -> list:
    """Each weight checked against its shape (quantised ones dequantized), in order."""
    dense = []
    for role, w, shape in zip(roles, weights, shapes):
        name = f"{prefix}_{role}"
        if _is_fp8_blocks(w):
            _check_fp8_block_parts(name, w)
        w = _dequantize_if_quantized(w, dtype)
        _check_tensor(name, w, ws, dtypes=(dtype,), ndim=len(shape))
        if tuple(w.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {shape}")
        dense.append(w)
    return dense


def _check_fp8_block_parts(name: str, w) -> None:
    """The alignment rule for an FP8BlockTensor's own tensors: the FP8 GEMMs read its data and
    scales as given (the dense copy the other checks see is fresh; an MXFP8 weight is only ever
    read through such a copy)."""
    for field, t in zip(w._fields, w):
        if isinstance(t, torch.Tensor):
            _check_aligned(f"{name}.{field}", t, _ALIGN_WHY,
                           f"quantise a fresh tensor, or pass {field}.clone()")  # fmt: skip


def _dense_shape(w) -> tuple[int, ...]:
    from mok_megatron.ops.mxfp8 import mxfp8_part

    if _is_fp8_blocks(w):
        return tuple(w.data.shape)
    return tuple(mxfp8_part(w).data.shape if _is_quantized(w) else w.shape)


def _is_quantized(w) -> bool:
    """An MXFP8 tuple or an FP8BlockTensor (tuples, not tensors)."""
    return isinstance(w, tuple) and not isinstance(w, torch.Tensor)


def _is_fp8_blocks(w) -> bool:
    if not isinstance(w, tuple):  # a tensor (FP8BlockTensor is a NamedTuple): no import
        return False
    from mok_megatron.ops.fp8_blockwise import FP8BlockTensor

    return isinstance(w, FP8BlockTensor)


def _dequantize_if_quantized(w, dtype: torch.dtype):
    """A dense weight in ``dtype``. An FP8BlockTensor's dense form carries it as its FP8 copy
    (``fp8_weights.attach_fp8_weight``): an FP8 forward uses the caller's quantisation."""
    if not _is_quantized(w):  # a dense weight (both quantised forms are tuples)
        return w
    if _is_fp8_blocks(w):
        from mok_megatron.ops.fp8_blockwise import fp8_blockwise_dequantize

        from .fp8_weights import attach_fp8_weight

        return attach_fp8_weight(fp8_blockwise_dequantize(w, dtype).contiguous(), w)
    from mok_megatron.ops import mxfp8_dequantize
    from mok_megatron.ops.mxfp8 import mxfp8_part

    from .fp8_weights import attach_mxfp8_source

    mx = mxfp8_part(w)  # an FP8 forward runs on mx requantised (fp8_weights), not this copy
    return attach_mxfp8_source(mxfp8_dequantize(mx, dtype=dtype).contiguous(), mx)


def _check_config(ws: MoKWorkspace, config: MoKConfig) -> None:
    if config is ws.config or config is ws.given_config:  # no field-by-field compare
        return
    if config != ws.config and config != ws.given_config:  # as resolved, or as given
        raise ValueError(
            f"config {config} differs from the one the workspace was made with ({ws.config}); "
            "make a workspace per config"
        )


def _check_tensor(name: str, t, ws: MoKWorkspace, *, dtypes, ndim: int, why: str = _ALIGN_WHY,
                  fix: str | None = None) -> None:  # fmt: skip
    """A tensor argument's type, dtype, dims, device, contiguity and alignment (``why`` and
    ``fix``: the alignment rule's reason and remedy, named in its error)."""
    # NOTE: the good case of a plain tensor or parameter in one test (host time on every pass);
    # the rules in the same order, so anything it lets by passes each of them, and anything else
    # meets them one by one, with their errors.
    if (type(t) in _PLAIN_TENSOR_TYPES and t.dtype in dtypes and t.dim() == ndim
            and t.device == ws.device and t.is_contiguous()
            and (t.data_ptr() % TENSOR_ALIGN_BYTES == 0 or not t.numel())):  # fmt: skip
        return
    _check_tensor_rules(name, t, ws, dtypes, ndim, why, fix)


def _check_tensor_rules(name, t, ws, dtypes, ndim, why, fix) -> None:
    """``_check_tensor``'s rules one by one, raising for the first that ``t`` breaks."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {list(dtypes)}")
    if t.dim() != ndim:
        raise ValueError(f"{name} has {t.dim()} dims (shape {tuple(t.shape)}); expected {ndim}")
    if t.device != ws.device:
        raise ValueError(f"{name} is on {t.device} but the workspace is on {ws.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() on it)")
    _check_aligned(name, t, why, fix or f"pass {name.split(' (')[0]}.clone() (a fresh tensor)")


def _check_aligned(name: str, t: torch.Tensor, why: str, fix: str) -> None:
    """The alignment rule (TENSOR_ALIGN_BYTES), its error naming ``why`` and ``fix``."""
    if _misaligned(t):
        per = TENSOR_ALIGN_BYTES // t.element_size()
        raise ValueError(
            f"{name} starts at an address that is not {TENSOR_ALIGN_BYTES}-byte aligned ({why}); "
            f"{fix}, or a view that starts at a multiple of {per} "
            f"{str(t.dtype).removeprefix('torch.')} elements"
        )


def _aligned_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` when it is contiguous and starts on a TENSOR_ALIGN_BYTES boundary, else a copy that
    does (for tensors the API makes itself, e.g. the gradient autograd hands the backward)."""
    t = t.contiguous()
    return t.clone() if _misaligned(t) else t


def _misaligned(t: torch.Tensor) -> bool:
    """Whether ``t`` holds elements and starts off a TENSOR_ALIGN_BYTES boundary (never for a
    fake tensor, which has no address: torch.compile's tracing of a call)."""
    if not t.numel():
        return False
    # NOTE: is_fake walks the tensor's subclass structure (microseconds per call, on every pass);
    # a FakeTensor is a subclass, so a plain tensor or parameter needs no such test.
    if type(t) not in _PLAIN_TENSOR_TYPES and is_fake(t):
        return False
    return t.data_ptr() % TENSOR_ALIGN_BYTES != 0


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _check_tokens(name: str, t: torch.Tensor, ws: MoKWorkspace) -> None:
    if t.shape[0] > ws.num_local_tokens:
        raise ValueError(
            f"{name} has {t.shape[0]} tokens but the workspace holds at most "
            f"num_local_tokens={ws.num_local_tokens}; make the workspace for the largest batch"
        )


def _cast_weight_grad(g, w, x_dtype):
    """A weight's gradient in the weight's dtype (x's for a quantised weight); None stays None."""
    if g is None:
        return None
    return g.to(x_dtype if _is_quantized(w) else w.dtype)


def _cast_weight_grads(grads: MoKGradients, shared_in, routed_in, x_dtype) -> MoKGradients:
    return MoKGradients(
        grads.d_x,
        grads.d_router_weights,
        *(_cast_weight_grad(g, w, x_dtype) for g, w in zip(grads[2:5], routed_in)),
        *(_cast_weight_grad(g, w, x_dtype) for g, w in zip(grads[5:8], shared_in)),
    )
