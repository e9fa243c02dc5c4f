"""MoKConfig.expert_precision="fp8_blockwise" on the CUDA backend (stage 1, EP 1), with the
backward in BF16 and with its data gradients in FP8 (fp8_backward="dgrad"): forward and every
gradient against the reference backend's FP8 emulation and near the BF16 path; bitwise run
to run; no host sync; the FP8 weight copies follow weight updates (in place, optimizer steps,
explicit invalidation). The CUDA passes checked against the reference and run to run allocate
their outputs from poisoned memory (``testing.poison.poisoned_memory``: every size class), so an
element a kernel leaves unwritten shows as a NaN."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mok_megatron import functional as F
from mok_megatron.ops import interleave_gate_up
from mok_megatron.ops.grouped_gemm_fp8 import grouped_gemm_fp8_available
from mok_megatron.testing import random_moe_problem, relative_error
from mok_megatron.testing.poison import assert_fully_written, poisoned_memory
from mok_megatron.testing.runs import global_d_out

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not grouped_gemm_fp8_available(), reason="FP8 grouped GEMMs not built"),
]

FP8 = F.MoKConfig(expert_precision="fp8_blockwise", wait_timeout_ms=60_000)
FP8_DGRAD = dataclasses.replace(FP8, fp8_backward="dgrad")  # the data gradients in FP8 too
BF16 = dataclasses.replace(FP8, expert_precision="bf16")
# Scaled-down benchmark shapes with H and I multiples of 128: (hidden, inter, experts, topk,
# shared_inter).
SHAPES = {
    "qwen3-30b-a3b": (256, 128, 16, 8, 0),
    "deepseek-v3": (512, 256, 16, 8, 128),
    "mixtral-8x7b": (512, 512, 8, 2, 0),
}
# CUDA FP8 against the reference's FP8 emulation: the same quantised operands, different
# accumulation orders; an act that lands one bf16 ulp apart can quantise one e4m3 step apart.
FP8_VS_REFERENCE = 2e-2
# FP8 against BF16 on the same inputs: e4m3 keeps 3 mantissa bits (2^-4 relative per element
# and quantisation, three quantisations on the way to y).
FP8_VS_BF16 = 0.1
NAMES = ("out", "d_x", "d_router_weights", "d_w_routed_gate", "d_w_routed_down")


class Pass:
    """One rank's inputs on the device and its workspace; ``()`` runs schedule, forward and
    backward (no host work: the inputs are made here)."""

    def __init__(self, problem, config, backend, device, weights=None):
        x, topk, rw, routed, shared = problem.local(0, dtype=torch.bfloat16, device=device)
        if weights is None:
            gate, up, down = routed
            weights = (interleave_gate_up(gate, up), None, down)
        self.config, self.x, self.topk, self.rw = config, x, topk, rw
        self.weights = (*(shared or (None, None, None)), *weights)
        self.d_out = global_d_out(problem, 1).to(device, torch.bfloat16)
        self.ws = F.create_workspace(
            config, None, device=device, num_local_tokens=x.shape[0], hidden_size=x.shape[1],
            topk=topk.shape[1], num_experts=problem.w_gate.shape[0],
            intermediate_size=problem.w_gate.shape[1],
            shared_intermediate_size=shared[0].shape[0] if shared else 0, dtype=torch.bfloat16,
            backend=backend,
        )  # fmt: skip

    def __call__(self, poison: bool = False) -> dict:
        """Out and every gradient; ``poison``: allocated from poisoned memory (checked)."""
        if not poison:
            return self._pass()
        with poisoned_memory(large_bytes=1 << 30) as mem:
            result = self._pass()
        torch.cuda.synchronize()
        mem.assert_covers(**result)
        return result

    def _pass(self) -> dict:
        sched = F.build_schedule(self.ws, self.config, self.topk, self.ws.num_local_experts)
        out, ctx = F.forward(self.config, self.ws, sched, self.x, self.rw, *self.weights)
        grads = F.backward(self.config, self.ws, sched, ctx, self.d_out, self.x, self.rw,
                           *self.weights)  # fmt: skip
        return {"out": out, **grads._asdict()}


def run(problem, config, backend, device, *, weights=None, poison=False):
    return Pass(problem, config, backend, device, weights)(poison=poison)


def problem_of(shape, seed=0):
    hidden, inter, experts, topk, shared = SHAPES[shape]
    return random_moe_problem([200], hidden, inter, experts, topk, shared_inter=shared, seed=seed)


@pytest.mark.parametrize("config", [FP8, FP8_DGRAD], ids=["bf16_backward", "fp8_dgrad"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_matches_the_reference_emulation_and_stays_near_bf16(shape, config):
    """Out and every gradient against the reference's emulation of the same recipe (with
    fp8_backward="dgrad" its data-gradient GEMMs in FP8 too: tests/cpu/test_reference_fp8.py
    checks that emulation against a float64 oracle) and near the BF16 layer. With "dgrad" the
    data gradients differ from the BF16 backward's; what does not depend on them does not."""
    problem = problem_of(shape)
    got = run(problem, config, "cuda", "cuda", poison=True)
    want = run(problem, config, "reference", "cuda")
    bf16 = run(problem, BF16, "cuda", "cuda")
    for name in NAMES:
        err = relative_error(got[name].float(), want[name].float())
        assert err < FP8_VS_REFERENCE, f"{shape} {name}: {err:.2e} from the reference's FP8"
        drift = relative_error(got[name].float(), bf16[name].float())
        assert drift < FP8_VS_BF16, f"{shape} {name}: {drift:.2e} from BF16"
    assert not torch.equal(got["out"], bf16["out"]), "expert_precision changed nothing"
    if config.fp8_backward == "dgrad":
        bf16_bwd = run(problem, FP8, "cuda", "cuda")
        assert not torch.equal(got["d_x"], bf16_bwd["d_x"]), "fp8_backward changed nothing"
        for name in ("out", "d_router_weights", "d_w_routed_down"):
            assert torch.equal(got[name], bf16_bwd[name]), name


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_token_dispatch_equals_quantising_the_gathered_rows(shape, monkeypatch):
    """The tokens quantised at their source and dispatched as packed FP8 rows give, bit for
    bit, the forward and gradients of a bf16 dispatch whose gathered rows are quantised (a
    row's (1, 128) quantisation depends on that row alone); both passes from poisoned memory.
    Under torch.no_grad() (nothing saved) the FP8 dispatch serves macrobatch rounds as well."""
    from mok_megatron.functional.cuda import stage1

    problem = problem_of(shape, seed=5)
    layer = Pass(problem, FP8, "cuda", "cuda")
    calls = []
    chosen = stage1.dispatches_fp8_tokens
    monkeypatch.setattr(stage1, "dispatches_fp8_tokens",
                        lambda *a: calls.append(chosen(*a)) or calls[-1])  # fmt: skip
    got = layer(poison=True)
    assert calls == [True], calls
    for name in NAMES:  # every element written (the poison is NaN in each output's dtype)
        assert_fully_written(name, got[name])
    monkeypatch.setattr(stage1, "dispatches_fp8_tokens", lambda *a: False)
    want = layer(poison=True)
    for name in NAMES:
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name
    # rounds without a backward: the FP8 dispatch, against the bf16 one, each round's rows
    monkeypatch.setattr(stage1, "dispatches_fp8_tokens", chosen)
    rounds = Pass(problem, dataclasses.replace(FP8, macrobatch_size=512), "cuda", "cuda")
    if rounds.ws.row_capacity <= 512:
        return  # one round only at this shape
    with torch.no_grad():
        sched = F.build_schedule(rounds.ws, rounds.config, rounds.topk,
                                 rounds.ws.num_local_experts)  # fmt: skip
        args = (rounds.config, rounds.ws, sched, rounds.x, rounds.rw, *rounds.weights)
        out_fp8, _ = F.forward(*args)
        monkeypatch.setattr(stage1, "dispatches_fp8_tokens", lambda *a: False)
        out_bf16, _ = F.forward(*args)
    assert torch.equal(out_fp8.view(torch.uint8), out_bf16.view(torch.uint8))


@pytest.mark.parametrize("config", [FP8, FP8_DGRAD], ids=["bf16_backward", "fp8_dgrad"])
def test_fp8_in_macrobatch_rounds_matches_the_reference_emulation(config):
    """More routed rows than macrobatch_size: the backward recomputes each round, y included
    (the FP8 router-weight gradient is <d_rows, y> of the FP8 GEMM's y), against the reference's
    FP8 emulation as in one round."""
    problem = problem_of("qwen3-30b-a3b", seed=4)  # 200 tokens x top-8: 1664 rows at least
    rounds = dataclasses.replace(config, macrobatch_size=512)
    layer = Pass(problem, rounds, "cuda", "cuda")
    assert layer.ws.row_capacity > 512  # more than one round
    got = layer(poison=True)
    want = run(problem, rounds, "reference", "cuda")
    for name in NAMES:
        err = relative_error(got[name].float(), want[name].float())
        assert err < FP8_VS_REFERENCE, f"rounds {name}: {err:.2e} from the reference's FP8"


@pytest.mark.parametrize("config", [FP8, FP8_DGRAD], ids=["bf16_backward", "fp8_dgrad"])
def test_fp8_bitwise_run_to_run_and_no_host_sync(config):
    layer = Pass(problem_of("deepseek-v3", seed=3), config, "cuda", "cuda")
    layer()  # warm-up (lazy initialisation may sync)
    first = layer(poison=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    again = layer(poison=True)  # (poisoned_memory itself syncs: outside the sync check)
    layer.ws.check_errors()
    for name in NAMES:
        assert torch.equal(first[name], again[name]), f"{name} differs run to run"


def test_fp8_weight_copies_follow_weight_updates():
    """Scaling W_down by 2 (exact in bf16 and in the block scales) doubles y, so the output
    doubles exactly once the FP8 copy is remade, and stays as it was while it is stale."""
    problem = random_moe_problem([128], 256, 128, 8, 2, seed=5)
    _, _, _, (gate, up, down), _ = problem.local(0, dtype=torch.bfloat16, device="cuda")
    weights = (interleave_gate_up(gate, up), None, down)
    base = run(problem, FP8, "cuda", "cuda", weights=weights)["out"]
    with torch.no_grad():
        down.mul_(2)  # through autograd's version counter: seen
    assert torch.equal(run(problem, FP8, "cuda", "cuda", weights=weights)["out"], 2 * base)
    down.data.mul_(0.5)  # behind the version counter: the copy is stale until invalidated
    assert torch.equal(run(problem, FP8, "cuda", "cuda", weights=weights)["out"], 2 * base)
    F.invalidate_fp8_weight_cache()
    assert torch.equal(run(problem, FP8, "cuda", "cuda", weights=weights)["out"], base)
    down.data.mul_(2)
    param = torch.nn.Parameter(torch.zeros(1, device="cuda"))
    param.grad = torch.zeros_like(param)
    torch.optim.SGD([param], lr=0.0).step()  # any optimizer step makes every copy stale
    assert torch.equal(run(problem, FP8, "cuda", "cuda", weights=weights)["out"], 2 * base)


def test_fp8_needs_the_fused_form_and_128_multiples():
    problem = random_moe_problem([64], 256, 128, 8, 2, seed=6)
    _, _, _, (gate, up, down), _ = problem.local(0, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="fused gate/up"):
        run(problem, FP8, "cuda", "cuda", weights=(gate, up, down))
    odd = random_moe_problem([64], 192, 128, 8, 2, seed=7)
    with pytest.raises(ValueError, match="multiples of 128"):
        run(odd, FP8, "cuda", "cuda")
    auto = dataclasses.replace(FP8, cuda_forward="auto")  # auto: stage 1 for FP8
    assert torch.equal(run(problem, auto, "cuda", "cuda")["out"],
                       run(problem, FP8, "cuda", "cuda")["out"])  # fmt: skip


def test_prequantised_weights_are_used_as_given():
    """(128, 128) FP8BlockTensor weights: the FP8 forward reads them as they are, so its output
    is the one the same weights give when the layer quantises them itself."""
    from mok_megatron.ops.fp8_blockwise import fp8_blockwise_quantize

    problem = random_moe_problem([160], 256, 128, 8, 4, seed=8)
    _, _, _, (gate, up, down), _ = problem.local(0, dtype=torch.bfloat16, device="cuda")
    dense = (interleave_gate_up(gate, up), None, down)
    quantised = (fp8_blockwise_quantize(dense[0], (128, 128)), None,
                 fp8_blockwise_quantize(down, (128, 128)))  # fmt: skip
    want = run(problem, FP8, "cuda", "cuda", weights=dense)
    got = run(problem, FP8, "cuda", "cuda", weights=quantised)
    assert torch.equal(got["out"], want["out"])
    assert got["d_w_routed_gate"].dtype == torch.bfloat16  # the gradients in x's dtype


def test_mxfp8_weights_run_as_their_requantisation():
    """MXFP8 weights (ops.mxfp8_quantize's) in the FP8 forward: the output of their (128, 128)
    requantisation (ops.requantize_mxfp8, the CUDA quantiser) passed as FP8BlockTensors, and
    the reference backend's on the same MXFP8 weights within FP8_VS_REFERENCE."""
    from mok_megatron.ops import mxfp8_quantize, requantize_mxfp8

    problem = random_moe_problem([160], 256, 128, 8, 4, seed=9)
    _, _, _, (gate, up, down), _ = problem.local(0, dtype=torch.bfloat16, device="cuda")
    mx = (mxfp8_quantize(interleave_gate_up(gate, up), rowwise=True, colwise=False), None,
          mxfp8_quantize(down, rowwise=True, colwise=False))  # fmt: skip
    requantised = (requantize_mxfp8(mx[0]), None, requantize_mxfp8(mx[2]))
    got = run(problem, FP8, "cuda", "cuda", weights=mx, poison=True)
    again = run(problem, FP8, "cuda", "cuda", weights=requantised, poison=True)
    assert torch.equal(got["out"], again["out"])
    want = run(problem, FP8, "reference", "cpu", weights=tuple(map(_mxfp8_on_cpu, mx)))["out"]
    assert relative_error(got["out"].cpu().float(), want.float()) < FP8_VS_REFERENCE


def _mxfp8_on_cpu(w):
    """An MXFP8Weight (or None) with its tensors copied to the CPU."""
    if w is None:
        return None
    return type(w)(*(None if t is None else type(t)(t.data.cpu(), t.scales.cpu()) for t in w))
