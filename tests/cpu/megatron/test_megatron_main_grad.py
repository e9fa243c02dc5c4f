"""MoKExperts under Megatron's gradient-accumulation fusion (gloo, spawned ranks, reference backend).

With ``config.gradient_accumulation_fusion`` and float32 ``main_grad`` buffers on the expert
weights, the backward adds the weight gradients into ``main_grad`` (exactly old + the gradient
the unfused layer puts in ``.grad``) and hands autograd what Megatron's linear layers do: with
``grad_added_to_main_grad`` present it becomes True and ``.grad`` is a dummy (zeros under
``zero_out_wgrad``), without it ``.grad`` stays None. Without main_grad, with the flag off, or with
a main_grad MoK cannot add into (bfloat16, misaligned), nothing changes. Under Megatron's own
``DistributedDataParallel`` (with and without overlapped grad reduction, two micro-batches) the
reduced main_grads equal the unfused layer's bit for bit, at EP 1 and 2.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mok_megatron.testing import run_ranks

HIDDEN = 32


def _tokens(rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x and d_out: [S, B, H] with S = 6 - rank (ranks hold different token counts)."""
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    shape = (6 - rank, 3, HIDDEN)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _layer(world_size: int):
    from mok_megatron.megatron import parity

    parity.init_megatron_parallel(world_size)
    case = parity.LayerCase(topk=2, hidden=HIDDEN)
    return parity.build_moe_layer(case, "mok_fused", world_size)


def _step(layer, rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One forward + backward: out, d_x and the router's gradient."""
    x, d_out = _tokens(rank, seed)
    x.requires_grad_()
    out, _ = layer(x)
    out.backward(d_out)
    return {"out": out.detach(), "d_x": x.grad, "router": layer.router.weight.grad}


def _experts(layer):
    experts = layer.experts
    return {"weight_gate_up": experts.weight_gate_up, "weight_down": experts.weight_down}


def _reset(layer) -> None:
    for p in layer.parameters():
        p.grad = None
        for attr in ("main_grad", "grad_added_to_main_grad", "zero_out_wgrad"):
            if hasattr(p, attr):
                delattr(p, attr)


def _give_main_grads(layer, seed: int, dtype=torch.float32, ddp_attr=True, misalign=False):
    """Random main_grads (as DDP's buffer views would be) and DDP's flag; returns copies."""
    gen = torch.Generator().manual_seed(seed)
    old = {}
    for name, p in _experts(layer).items():
        buf = torch.randn(p.numel() + 1, generator=gen).to(dtype)
        p.main_grad = (buf[1:] if misalign else buf[:-1]).view(p.shape)
        if ddp_attr:
            p.grad_added_to_main_grad = False
        old[name] = p.main_grad.clone()
    return old


def _fusion_rank(rank: int, world_size: int) -> list[str]:
    """Every case on this rank; returns failure messages."""
    layer = _layer(world_size)
    failures = []

    def expect(ok, what):
        if not ok:
            failures.append(f"rank {rank}: {what}")

    plain = _step(layer, rank)
    plain_grads = {n: p.grad.clone() for n, p in _experts(layer).items()}

    def same_other_grads(got, case):
        for key in ("out", "d_x", "router"):
            expect(torch.equal(got[key], plain[key]), f"{case}: {key} differs from the plain run")

    # Flag off: main_grad is not touched, .grad as before.
    _reset(layer)
    old = _give_main_grads(layer, seed=1)
    same_other_grads(_step(layer, rank), "flag off")
    for name, p in _experts(layer).items():
        expect(torch.equal(p.main_grad, old[name]), f"flag off: {name}.main_grad changed")
        expect(torch.equal(p.grad, plain_grads[name]), f"flag off: {name}.grad differs")

    layer.config.gradient_accumulation_fusion = True
    # DDP's attribute present: main_grad += the gradient; .grad a dummy; the flag set.
    for zero_out in (False, True):
        _reset(layer)
        old = _give_main_grads(layer, seed=2)
        for p in _experts(layer).values():
            p.zero_out_wgrad = zero_out
        got = _step(layer, rank)
        same_other_grads(got, f"fusion zero_out_wgrad={zero_out}")
        for name, p in _experts(layer).items():
            case = f"fusion zero_out_wgrad={zero_out}: {name}"
            expect(torch.equal(p.main_grad, old[name] + plain_grads[name]), f"{case}.main_grad")
            expect(p.grad_added_to_main_grad is True, f"{case}: grad_added_to_main_grad")
            expect(p.grad is not None and p.grad.shape == p.shape, f"{case}: dummy .grad")
            if zero_out:
                expect(torch.count_nonzero(p.grad) == 0, f"{case}: .grad must be zeros")

    # main_grad without DDP's attribute: the gradient lands in main_grad, .grad stays None.
    _reset(layer)
    old = _give_main_grads(layer, seed=3, ddp_attr=False)
    _step(layer, rank)
    for name, p in _experts(layer).items():
        expect(torch.equal(p.main_grad, old[name] + plain_grads[name]), f"no attr: {name}")
        expect(p.grad is None, f"no attr: {name}.grad must stay None")

    # No main_grad at all, or one MoK cannot add into: the plain path (and a warning for those).
    for case, kwargs in (("none", None), ("bf16", {"dtype": torch.bfloat16}),
                         ("misaligned", {"misalign": True})):  # fmt: skip
        _reset(layer)
        old = _give_main_grads(layer, seed=4, **kwargs) if kwargs else {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            same_other_grads(_step(layer, rank), case)
        for name, p in _experts(layer).items():
            expect(torch.equal(p.grad, plain_grads[name]), f"{case}: {name}.grad differs")
            if kwargs:
                expect(torch.equal(p.main_grad, old[name]), f"{case}: {name}.main_grad changed")
        if kwargs:
            said = " ".join(str(w.message) for w in caught)
            expect("go through .grad" in said, f"{case}: no warning ({said!r})")
    return failures


@pytest.mark.parametrize("world_size", [1, 2])
def test_main_grad_fusion_follows_megatrons_contract(world_size):
    failures = [f for rank in run_ranks(_fusion_rank, world_size) for f in rank]
    assert not failures, "\n".join(failures)


def _ddp_rank(rank: int, world_size: int, overlap: bool) -> list[str]:
    """The same layer (same weights) under Megatron's DDP, unfused and fused: two micro-batches
    each, then the grad sync; returns failure messages."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    main_grads, weights = {}, None
    failures = []
    for fusion in (False, True):
        layer = _layer(world_size)
        if weights is None:
            weights = {k: v.clone() for k, v in layer.state_dict().items() if v is not None}
        else:
            layer.load_state_dict(weights, strict=False)
        layer.config.gradient_accumulation_fusion = fusion
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=overlap, bucket_size=None
        )
        model = DistributedDataParallel(config=layer.config, ddp_config=ddp_config, module=layer)
        model.zero_grad_buffer()
        for micro in range(2):
            x, d_out = _tokens(rank, seed=10 + micro)
            out, _ = model(x)
            out.backward(d_out)
            if fusion:
                flags = [p.grad_added_to_main_grad for p in _experts(layer).values()]
                if not all(flags):
                    failures.append(f"rank {rank} micro {micro}: the fused path was not taken")
        model.finish_grad_sync()
        main_grads[fusion] = {n: p.main_grad.clone() for n, p in layer.named_parameters()}
    for name, want in main_grads[False].items():
        if not torch.equal(main_grads[True][name], want):
            err = float((main_grads[True][name] - want).abs().max())
            failures.append(f"rank {rank} overlap={overlap}: {name}.main_grad max |diff| {err:.2e}")
    return failures


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("world_size", [1, 2])
def test_under_megatron_ddp_main_grads_equal_the_unfused_layers(world_size, overlap):
    failures = [f for rank in run_ranks(_ddp_rank, world_size, overlap) for f in rank]
    assert not failures, "\n".join(failures)
