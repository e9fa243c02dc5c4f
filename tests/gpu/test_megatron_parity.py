"""MoK against Megatron's alltoall dispatcher on GPUs (NCCL): layer parity and GPT training.

    python -m pytest tests/gpu/test_megatron_parity.py                      # EP 1, one GPU
    torchrun --nproc-per-node 2 -m pytest tests/gpu/test_megatron_parity.py  # EP 1 and EP 2

Set MOK_RESULTS_DIR to write the measured errors as JSON (rank 0), e.g. for docs/results/.
MOK_PARITY_DEVICE=cpu runs the same file on CPU over gloo (a dry run of this test's plumbing).
float32 runs the reference backend on the GPU (the CUDA backend takes bf16): relative error
< 1e-5 against Megatron. bf16 runs backend 'auto' (the CUDA kernels where built): against a
float32 Megatron layer on the same weights, its error is < 1e-2 and at most twice Megatron's own
bf16 error plus 1e-3.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

DEVICE = os.environ.get("MOK_PARITY_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"
)

ROOT = Path(__file__).resolve().parents[2]
TOPKS = (1, 2, 4)
SHARED = (None, 40)
KINDS = ("mok_fused", "mok_unfused")
RESULTS: dict[str, dict] = {}


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@pytest.fixture(scope="module", autouse=True)
def nccl_world():
    """One NCCL process group per test process (torchrun's, or a world of one)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    created = not dist.is_initialized()  # another GPU test module may have made it already
    if created:
        if DEVICE == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    yield
    _write_results()
    if created:
        dist.destroy_process_group()


def _shared_dir() -> str:
    path = [tempfile.mkdtemp(prefix="mok_gpu_parity_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _tokens(case, seed: int):
    gen = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    shape = (64 - 8 * dist.get_rank(), 4, case.hidden)  # a different token count per rank
    x = torch.randn(shape, generator=gen)
    return x.to(DEVICE, case.dtype), torch.randn(shape, generator=gen).to(DEVICE, case.dtype)


def _layer_errors(ep: int, kind: str, case, seed: int) -> dict[str, float]:
    from mok_megatron.megatron import parity

    ref = parity.build_moe_layer(case, "alltoall", ep)
    mok = parity.build_moe_layer(case, kind, ep)
    parity.share_weights(ref, mok, os.path.join(_shared_dir(), "w"))
    parity.assert_same_weights(mok, ref)
    x, d_out = _tokens(case, seed)
    return parity.relative_errors(
        parity.layer_step(mok, x, d_out), parity.layer_step(ref, x, d_out)
    )


def _ep_sizes():
    return [pytest.param(1, marks=pytest.mark.gpu), pytest.param(2, marks=pytest.mark.multigpu)]


def _require(ep: int) -> None:
    if _world() % ep:
        pytest.skip(f"EP {ep} needs a multiple of {ep} ranks: torchrun --nproc-per-node {ep}")


@pytest.mark.parametrize("ep", _ep_sizes())
def test_layer_parity_float32(ep):
    from mok_megatron.megatron import parity

    _require(ep)
    parity.init_megatron_parallel(ep, device=DEVICE)
    bad = []
    cases = itertools.product(KINDS, TOPKS, SHARED)
    for i, (kind, topk, shared) in enumerate(cases):
        case = parity.LayerCase(topk=topk, shared_ffn=shared, device=DEVICE, backend="reference")
        errors = _layer_errors(ep, kind, case, seed=i)
        RESULTS[f"float32 ep={ep} {kind} topk={topk} shared={shared}"] = max(errors.values())
        bad += [
            f"{kind} topk={topk} shared={shared} {n}: {e:.2e}"
            for n, e in errors.items()
            if not e < 1e-5
        ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("ep", _ep_sizes())
def test_layer_parity_bf16(ep):
    from mok_megatron.megatron import parity

    _require(ep)
    parity.init_megatron_parallel(ep, device=DEVICE)
    bad = []
    for i, (topk, shared) in enumerate(itertools.product(TOPKS, SHARED)):
        bf16 = parity.LayerCase(topk=topk, shared_ffn=shared, device=DEVICE, dtype=torch.bfloat16)
        mok_err, ref_err, backend = _bf16_errors(ep, bf16, seed=100 + i)
        RESULTS[f"bf16 ep={ep} topk={topk} shared={shared}"] = {
            "mok": mok_err,
            "megatron": ref_err,
            "mok_backend": backend,
        }
        if DEVICE == "cuda" and _cuda_backend_built():
            assert backend == "cuda", f"bf16 on GPU ran the {backend} backend, not the CUDA one"
        for name, err in mok_err.items():
            if not (err < 1e-2 and err <= 2 * ref_err[name] + 1e-3):
                ref = ref_err[name]
                bad.append(f"topk={topk} shared={shared} {name}: mok {err:.2e} megatron {ref:.2e}")
    assert not bad, "\n".join(bad)


def _bf16_errors(ep: int, bf16, seed: int):
    """Errors of MoK bf16 and Megatron bf16 against Megatron float32 on the same bf16-exact
    weights and tokens (routing from fp32 logits in all three, so the same experts are picked)."""
    from mok_megatron.megatron import parity

    fp32 = dataclasses.replace(bf16, dtype=torch.float32, backend="reference")
    oracle = parity.build_moe_layer(fp32, "alltoall", ep)
    with torch.no_grad():
        for p in oracle.parameters():
            p.copy_(p.bfloat16().float())
    layers = [parity.build_moe_layer(bf16, kind, ep) for kind in ("mok_fused", "alltoall")]
    for j, layer in enumerate(layers):
        parity.share_weights(oracle, layer, os.path.join(_shared_dir(), f"w{j}"))
        parity.assert_same_weights(layer, oracle)
    x, d_out = (t.bfloat16() for t in _tokens(fp32, seed))
    expected = parity.layer_step(oracle, x.float(), d_out.float())
    mok, ref = (
        parity.relative_errors(parity.layer_step(layer, x, d_out), expected) for layer in layers
    )
    return mok, ref, layers[0].experts._layer_runtime.last_workspace.backend.name


def _cuda_backend_built() -> bool:
    from mok_megatron.ops import has_op
    from mok_megatron.ops.moe import CUDA_OPS

    return all(has_op(op) for op in CUDA_OPS)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("ep", _ep_sizes())
def test_main_grad_fusion_under_ddp_bf16(ep, overlap):
    """gradient_accumulation_fusion under Megatron's DDP (grad_reduce_in_fp32, two micro-batches,
    with and without overlapped reduction), bf16 on the CUDA backend: MoKExperts adds its weight
    gradients into main_grad (grad_added_to_main_grad set on every backward) and the reduced
    main_grads match the unfused layer's (whose bf16 .grad DDP's hook adds) within the bf16 rule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from mok_megatron.megatron import parity

    _require(ep)
    parity.init_megatron_parallel(ep, device=DEVICE)
    case = parity.LayerCase(topk=2, device=DEVICE, dtype=torch.bfloat16)
    weights, main_grads, fused_path = None, {}, []
    for fusion in (False, True):
        layer = parity.build_moe_layer(case, "mok_fused", ep)
        if weights is None:
            weights = {k: v.clone() for k, v in layer.state_dict().items() if v is not None}
        else:
            layer.load_state_dict(weights, strict=False)
        layer.config.gradient_accumulation_fusion = fusion
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                   overlap_grad_reduce=overlap)  # fmt: skip
        model = DistributedDataParallel(config=layer.config, ddp_config=ddp_config, module=layer)
        model.zero_grad_buffer()
        for micro in range(2):
            x, d_out = _tokens(case, seed=200 + micro)
            out, _ = model(x)
            out.backward(d_out)
            experts = (layer.experts.weight_gate_up, layer.experts.weight_down)
            fused_path += [p.grad_added_to_main_grad for p in experts] if fusion else []
        model.finish_grad_sync()
        main_grads[fusion] = {n: p.main_grad.clone() for n, p in layer.named_parameters()}
    if DEVICE == "cuda" and _cuda_backend_built():
        assert layer.experts._layer_runtime.last_workspace.backend.name == "cuda"
    assert fused_path and all(fused_path), "the fused path was not taken"
    bad = []
    for name, want in main_grads[False].items():
        err = parity.relative_errors({name: main_grads[True][name]}, {name: want})[name]
        RESULTS[f"main_grad fusion bf16 ep={ep} overlap={overlap} {name}"] = err
        if not err < 1e-2:
            bad.append(f"{name}: fused vs unfused main_grad rel err {err:.2e}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("ep", _ep_sizes())
def test_moe_recompute_is_bitwise_the_plain_layer(ep):
    """Megatron's ``--recompute-granularity selective --recompute-modules moe`` (the MoE layer's
    forward checkpointed: run without gradients, rerun in the backward) with the mok dispatcher,
    bf16 on the CUDA backend: output and every gradient bitwise equal to the same layer's
    without recompute, on the same weights and tokens."""
    from mok_megatron.megatron import parity

    _require(ep)
    parity.init_megatron_parallel(ep, device=DEVICE)
    case = parity.LayerCase(topk=2, shared_ffn=40, device=DEVICE, dtype=torch.bfloat16)
    plain = parity.build_moe_layer(case, "mok_fused", ep)
    recomputed = parity.build_moe_layer(case, "mok_fused", ep, recompute_granularity="selective",
                                        recompute_modules=["moe"])  # fmt: skip
    assert recomputed.moe_layer_recompute and not plain.moe_layer_recompute
    parity.share_weights(plain, recomputed, os.path.join(_shared_dir(), "w"))
    parity.assert_same_weights(recomputed, plain)
    x, d_out = _tokens(case, seed=300)
    want, got = (parity.layer_step(layer, x, d_out) for layer in (plain, recomputed))
    if DEVICE == "cuda" and _cuda_backend_built():
        assert recomputed.experts._layer_runtime.last_workspace.backend.name == "cuda"
    bad = [name for name in want if not torch.equal(got[name], want[name])]
    assert not bad, f"recompute differs from the plain layer in {bad}"


@pytest.mark.gpu
def test_gpt_full_recompute_trains_bitwise_like_no_recompute():
    """Megatron's ``--recompute-granularity full`` with the mok dispatcher at EP 1, bf16, on the
    CUDA backend: a 2-layer GPT-MoE (configs/tiny_gpu_ep1.yaml) trains from the same weights and
    data to bitwise the same losses as without recompute; the MoK layers' forwards (the
    megakernel's, and so the backward megakernel's backward) ran twice per pass."""
    from mok_megatron.megatron.parity import full_recompute_losses
    from mok_megatron.megatron.training import replace_training
    from mok_megatron.megatron.yaml_config import load_run_config

    if _world() != 1 or DEVICE != "cuda" or not _cuda_backend_built():
        pytest.skip("one CUDA rank with the CUDA backend built")
    run = replace_training(load_run_config(ROOT / "configs" / "tiny_gpu_ep1.yaml"), train_iters=3)
    # NOTE: MoKConfig.cuda_forward defaults to 'stage1'; the megakernel is asked for here.
    run = dataclasses.replace(run, mok=dataclasses.replace(run.mok, cuda_forward="megakernel"))
    got = full_recompute_losses(run, os.path.join(_shared_dir(), "gpt_recompute"))
    calls, rerun_calls = got["calls"]
    assert calls["megakernel"] == calls["layer"] > 0, got["calls"]
    assert rerun_calls["megakernel"] == rerun_calls["layer"] == 2 * calls["layer"], got["calls"]
    assert got["plain"][-1] < got["plain"][0]
    assert got["recomputed"] == got["plain"], got


@pytest.mark.multigpu
def test_gpt_training_matches_alltoall():
    from mok_megatron.megatron.training import replace_training, train
    from mok_megatron.megatron.yaml_config import load_run_config

    _require(2)
    run = replace_training(
        load_run_config(ROOT / "configs" / "tiny_cpu.yaml"), train_iters=10, device=DEVICE
    )
    ckpt = os.path.join(_shared_dir(), "gpt")
    mok = train(run, "mok", save_initial_to=ckpt, progress=False).losses
    ref = train(run, "alltoall", load_from=ckpt, progress=False).losses
    gap = max(abs(a - b) for a, b in zip(mok, ref))
    RESULTS["gpt tiny ep=2 float32 max |loss gap| over 10 steps"] = gap
    assert gap < 1e-4 and mok[-1] < mok[0]


def _write_results() -> None:
    out = os.environ.get("MOK_RESULTS_DIR")
    if not out or dist.get_rank() != 0 or not RESULTS:
        return
    import megatron.core

    record = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "world_size": _world(),
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "max_relative_error": RESULTS,
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    path = Path(out) / f"megatron_parity_gpu_world{_world()}.json"
    path.write_text(json.dumps(record, indent=2, default=str))
