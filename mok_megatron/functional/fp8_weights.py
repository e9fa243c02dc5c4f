"""The FP8 copies of the routed weights that ``expert_precision="fp8_blockwise"`` reads, made
once per weight update rather than once per pass (any backend, any device).

A weight's (128, 128)-block FP8 copy (``ops.grouped_gemm_fp8.fp8_gemm_weight``) is kept on the
weight tensor and made again when the weight has changed, as its version counter (an in-place
write through autograd, ``load_state_dict``), its storage, or a ``torch.optim`` optimizer step
anywhere in the process (the step hook below) says. A write none of these see (``p.data.copy_``
outside an optimizer step) needs :func:`invalidate_fp8_weight_cache`. A weight passed already
quantised (an ``FP8BlockTensor`` to ``functional.forward``) is used as given
(:func:`attach_fp8_weight`). A weight passed in MXFP8 (``ops.mxfp8_quantize``'s) runs as its
requantisation to (128, 128) blocks (``ops.requantize_mxfp8``, with its error bound), kept on
the MXFP8 data and made again when that changes (:func:`attach_mxfp8_source`).
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["attach_fp8_weight", "attach_mxfp8_source", "check_fp8_sizes", "fp8_weight",
           "fp8_weight_transposed", "invalidate_fp8_weight_cache"]  # fmt: skip

_CACHE_ATTR = "_mok_fp8_blocks"
_SOURCE_ATTR = "_mok_mxfp8_source"  # on a dense copy: the MXFP8 weight it was dequantised from
_TRANSPOSED_ATTR = "_mok_fp8_blocks_t"  # on an FP8 copy's data: (its versions, it transposed)
_HOLDER_ATTR = "_mok_fp8_holder"  # on a detached alias: the weight whose FP8 copy it shares
_epoch = 0  # bumped by every optimizer step and by invalidate_fp8_weight_cache()


def invalidate_fp8_weight_cache() -> None:
    """Make every FP8 weight copy stale: the next FP8 forward quantises its weights again."""
    global _epoch
    _epoch += 1


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    invalidate_fp8_weight_cache()


register_optimizer_step_post_hook(_after_optimizer_step)


def check_fp8_sizes(hidden: int, inter: int) -> None:
    """Raise, naming the rule, unless H and I fill whole FP8 scale blocks (any backend)."""
    from mok_megatron.ops.fp8_blockwise import BLOCK

    if hidden % BLOCK or inter % BLOCK:
        raise ValueError(
            f"MoKConfig.expert_precision='fp8_blockwise' needs hidden (H={hidden}) and "
            f"intermediate (I={inter}) sizes that are multiples of {BLOCK} (the FP8 scale "
            "blocks); pad them or use expert_precision='bf16'"
        )


def _key(w: torch.Tensor) -> tuple:
    return (_epoch, w._version, w.data_ptr(), tuple(w.shape))


def fp8_weight(w: torch.Tensor):
    """``w: [G, N, K]`` in (128, 128) FP8 blocks (an ``FP8BlockTensor``), made once per weight
    update (module docstring); the CUDA quantiser for CUDA tensors, the reference on CPU."""
    from mok_megatron.ops.grouped_gemm_fp8 import fp8_gemm_weight

    source = getattr(w, _SOURCE_ATTR, None)
    if source is not None:
        return _requantized(source)
    return _kept(getattr(w, _HOLDER_ATTR, w), _key(w), lambda: fp8_gemm_weight(w.detach()))


def share_fp8_weight(alias: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Make ``alias`` (``w.detach()``: same storage and version counter) read and keep ``w``'s
    FP8 copy, so a fresh alias per pass does not quantise ``w`` again. Returns ``alias``."""
    setattr(alias, _HOLDER_ATTR, w)
    return alias


def fp8_weight_transposed(w: torch.Tensor):
    """``w: [G, N, K]``'s FP8 copy transposed, ``[G, K, N]`` (the data gradients' B operand).
    A (128, 128) block quantises the same values transposed or not, so this is exactly the
    quantisation of ``w``'s transpose: data and scales transposed, no new rounding. It is kept
    on the FP8 copy's data tensor, so it lives exactly as long as that copy (a caller's own
    quantisation included: ``attach_fp8_weight``), and is made again if that copy's data or
    scales are written in place."""
    from mok_megatron.ops.fp8_blockwise import FP8BlockTensor

    q = fp8_weight(w)
    key = (q.data._version, q.scales._version, q.scales.data_ptr())
    cached = getattr(q.data, _TRANSPOSED_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.no_grad():
        t = FP8BlockTensor(q.data.transpose(1, 2).contiguous(),
                           q.scales.transpose(1, 2).contiguous(), tuple(q.block))  # fmt: skip
    setattr(q.data, _TRANSPOSED_ATTR, (key, t))
    return t


def _requantized(mx):
    """The (128, 128)-block copy of the MXFP8 tensor ``mx``, kept on its data tensor and made
    again when its data or scales change (as :func:`fp8_weight` does for a dense weight)."""
    from mok_megatron.ops.fp8_blockwise import requantize_mxfp8
    from mok_megatron.ops.grouped_gemm_fp8 import fp8_gemm_weight

    key = (_key(mx.data), mx.scales._version, mx.scales.data_ptr())
    return _kept(mx.data, key, lambda: fp8_gemm_weight(requantize_mxfp8(mx)))


def _kept(holder: torch.Tensor, key: tuple, make):
    """The FP8 copy kept on ``holder`` while its key is ``key``, else ``make()``'s, kept."""
    cached = getattr(holder, _CACHE_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.no_grad():
        q = make()
    setattr(holder, _CACHE_ATTR, (key, q))
    return q


def attach_mxfp8_source(dense: torch.Tensor, mx) -> torch.Tensor:
    """Mark ``dense`` (the dequantised copy of the MXFP8 tensor ``mx``) so that
    :func:`fp8_weight` returns ``mx`` requantised, made once per change of ``mx``, rather than a
    quantisation of this fresh copy on every pass. Returns ``dense``."""
    setattr(dense, _SOURCE_ATTR, mx)
    return dense


def attach_fp8_weight(dense: torch.Tensor, q) -> torch.Tensor:
    """Make ``q`` (the caller's quantisation of ``dense``) the FP8 copy :func:`fp8_weight`
    returns for ``dense`` until it changes, when it is a grouped weight in the GEMMs' (128, 128)
    blocks; another form (a 2-d or (1, 128) one) is only its dense value. Returns ``dense``."""
    if tuple(q.block) == (128, 128) and q.data.dim() == 3:
        setattr(dense, _CACHE_ATTR, (_key(dense), q))
    return dense
