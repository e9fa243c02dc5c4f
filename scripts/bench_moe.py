#!/usr/bin/env python3
"""Benchmark the MoK MoE layer against what Megatron users run today, in one process.

Baseline: Megatron-Core's ``MoELayer`` with the alltoall dispatcher and grouped-GEMM experts on
``torch._grouped_mm`` (``mok_megatron.testing.baselines.TorchGroupedMLP``). MoK: the same layer
built from ``get_mok_moe_module_spec`` (``MoKTokenDispatcher`` + ``MoKExperts``), its backend
picked by ``--backend`` (default auto: the CUDA kernels where they serve the shape). Both get the
same weights (copied), the same inputs and the same routing (the router is bypassed for both,
so only dispatch + experts + combine are timed). Reports forward and forward + backward medians
with their spread, effective expert TFLOP/s, NVLink GB/s, speedup, fraction of the hardware floor
(DESIGN.md, "Performance") and peak memory, plus the relative difference of the two outputs.

``--main-grad`` times the backward as Megatron's DDP runs it with gradient-accumulation fusion:
the expert weights get fp32 ``main_grad`` buffers and DDP's post-accumulate hook, and the config
``gradient_accumulation_fusion``. MoK then adds its weight gradients into main_grad inside the
backward; the baseline's experts (``TorchGroupedMLP``) have no fused path (Megatron's own
``TEGroupedMLP`` has one but needs Transformer Engine), so DDP's hook adds their ``.grad`` in a
separate pass, as it does for any expert module without the fusion.

  torchrun --standalone --nproc-per-node 2 scripts/bench_moe.py --out docs/results/bench.json
  python scripts/bench_moe.py --tiny --device cpu          # CPU sanity run (reference backend)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mok_megatron.functional.cuda.experts import AUTO_ENGINE_STEPS  # noqa: E402
from mok_megatron.ops.grouped_gemm import GemmTuning  # noqa: E402
from mok_megatron.testing.gpu_clocks import ClockSampler, cuda_reader  # noqa: E402
from mok_megatron.testing.timing import moe_pass_cost, time_back_to_back, time_fn  # noqa: E402

SHAPES = {  # hidden, intermediate, experts, top-k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}
TINY_SHAPES = {"tiny": (64, 32, 8, 2)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma list of shape names")
    p.add_argument("--tokens", default="4096,8192,16384", help="tokens per rank, comma list")
    p.add_argument("--routing", default="uniform,skewed", help="uniform and/or skewed")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rotate", type=int, default=3, help="input sets cycled through")
    p.add_argument("--backend", default="auto", choices=("auto", "reference", "cuda"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="one tiny shape (CPU sanity run)")
    p.add_argument("--no-backward", action="store_true")
    p.add_argument(
        "--mok-expert-gemm",
        default="",
        help="comma list of MoKConfig.expert_gemm settings (torch, engine, or engine steps joined "
        "by '+', e.g. l1+wgrad) to also time MoK under, as 'mok_gemm_<setting>', in the same "
        "process: which expert GEMMs win",
    )
    p.add_argument(
        "--mok-cuda-forward",
        default=None,
        choices=("stage1", "megakernel", "auto"),
        help="MoKConfig.cuda_forward of the MoK layer timed as 'mok' (default: MoKConfig's)",
    )
    p.add_argument(
        "--mok-stage1",
        action="store_true",
        help="also time MoK with MoKConfig.cuda_forward='stage1' (the kernel sequence), as "
        "'mok_stage1', in the same process, beside the default (the megakernel where it runs)",
    )
    p.add_argument(
        "--mok-stage1-backward",
        action="store_true",
        help="also time MoK's forward + backward with MoKConfig.cuda_backward='stage1' (stage "
        "1's backward after the same forward), as 'mok_stage1_bwd', in the same process, beside "
        "the default (the backward megakernel where it runs)",
    )
    p.add_argument(
        "--mok-bwd-wgrad",
        action="store_true",
        help="also time MoK's forward + backward with MoKConfig.bwd_wgrad='down' (the down "
        "weight's gradient inside the backward megakernel's launch, after its data-gradient "
        "tasks) and 'down_interleaved' (among them), as 'mok_bwd_wgrad' and "
        "'mok_bwd_wgrad_interleaved', in the same process, beside the default (its grouped GEMM "
        "after the launch)",
    )
    p.add_argument(
        "--mok-pull",
        action="store_true",
        help="also time MoK with MoKConfig.fwd_rows='pull' (the forward megakernel's comm SMs "
        "pull every routed row into the ring, as at several ranks), as 'mok_pull', in the same "
        "process, forward and forward + backward; the default MoK takes its rows as "
        "fwd_rows='auto' does (the tuned table's choice, else in place at one rank)",
    )
    p.add_argument(
        "--mok-cluster2",
        action="store_true",
        help="also time MoK with MoKConfig.megakernel_cluster=2 (the megakernels in clusters of "
        "two CTAs sharing each m-tile's A tile by TMA multicast), as 'mok_cluster2', in the same "
        "process, forward and forward + backward",
    )
    p.add_argument(
        "--mok-chained-ab",
        nargs="?",
        const="chained",
        choices=["chained", "unchained"],
        help="also time MoK with MoKConfig.chained_launches=True ('mok_chained': each kernel of "
        "a pass may start while the one before finishes) and =False ('mok_unchained': plain "
        "stream order), whatever the default, in the same process, forward and forward + "
        "backward; with --mok-graph both forwards replayed too ('<name>_graph'), with "
        "--back-to-back both called back to back too (chained_speedup > 1: chained is faster). "
        "The value names the contender timed first in each pair (default chained), so two "
        "processes can swap the order",
    )
    p.add_argument(
        "--mok-macrobatch",
        type=int,
        default=0,
        metavar="ROWS",
        help="also time MoK with MoKConfig.macrobatch_size=ROWS (a rank's routed rows past ROWS "
        "run in macrobatch rounds), as 'mok_rounds', and its forward + backward with stage 1's "
        "backward after the same forward, as 'mok_rounds_stage1_bwd', in the same process "
        "(rounds_bwd_speedup > 1: the backward megakernel in rounds is ahead)",
    )
    p.add_argument(
        "--mok-wgrad-pingpong",
        action="store_true",
        help="also time MoK's forward + backward with the weight gradients on the expert GEMM "
        "engine in its pingpong schedule (experts.WGRAD_TUNING; expert_gemm = the 'auto' steps "
        "plus 'wgrad', which 'auto' has only when accumulating into main_grad), as "
        "'mok_wgrad_pingpong', in the same process; --mok-expert-gemm with the same steps times "
        "them in the default schedule",
    )
    p.add_argument(
        "--mok-wgrad-cluster2",
        action="store_true",
        help="the same as --mok-wgrad-pingpong in the engine's cooperative_cluster2 schedule (two "
        "CTAs along M share each B tile by TMA multicast), as 'mok_wgrad_cluster2'",
    )
    p.add_argument(
        "--mok-fp8",
        action="store_true",
        help="also time MoK with MoKConfig.expert_precision='fp8_blockwise' (stage 1; weights "
        "quantised once, as between optimizer steps), as 'mok_fp8', and in forward + backward "
        "with its data gradients in FP8 too (fp8_backward='dgrad') as 'mok_fp8_dgrad', in the "
        "same process",
    )
    p.add_argument(
        "--mok-fp8-mega",
        action="store_true",
        help="also time MoK's FP8 megakernel forward (expert_precision='fp8_blockwise', "
        "cuda_forward='megakernel'; its backward is stage 1's) as 'mok_fp8_mega', in the same "
        "process; in forward + backward with --mok-fp8 also with FP8 data gradients "
        "(fp8_backward='dgrad') as 'mok_fp8_mega_dgrad'",
    )
    p.add_argument(
        "--mok-graph",
        action="store_true",
        help="also time MoK's forward replayed from CUDA graphs (one captured per input set, "
        "autograd recording as in the fwd row), as 'mok_graph', in the same process: the GPU's "
        "time for the layer with no host work before its launches (the baseline is not captured); "
        "with --mok-fp8-mega the FP8 megakernel's forward too, as 'mok_fp8_mega_graph', and with "
        "--mok-pull the pulling forward's, as 'mok_pull_graph'",
    )
    p.add_argument(
        "--back-to-back",
        type=int,
        default=0,
        metavar="CALLS",
        help="also time the baseline and MoK with CALLS calls back to back per sample (no host "
        "wait between them, as in a training step: the host queues a call while the GPU runs the "
        "one before; testing.timing.time_back_to_back), as 'baseline_back_to_back' and "
        "'mok_back_to_back', in the same process; 0: not timed",
    )
    p.add_argument(
        "--main-grad",
        action="store_true",
        help="give the expert weights fp32 main_grad buffers and DDP's accumulate hook, with "
        "gradient_accumulation_fusion (MoK adds into main_grad in its backward; the baseline's "
        "experts have no fused path, so the hook adds their .grad)",
    )
    p.add_argument(
        "--live-ceiling",
        action="store_true",
        help="after each pass's contenders, time a dense bf16 GEMM (square matmuls of DENSE_N, "
        "as many as the pass's FLOPs) with the clock sampled, as 'dense_ceiling', and give each "
        "contender's rate over it ('of_dense_ceiling'): the floor's fixed 782 TFLOP/s against a "
        "dense GEMM under the same power cap, in the same process",
    )
    p.add_argument("--out", default=None, help="JSON file to write (rank 0)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--allow-reference-on-gpu",
        action="store_true",
        help="time MoK on GPU even when it resolves to the (slow) reference backend",
    )
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------- set-up
def init_distributed(device: str) -> tuple[int, int]:
    if "RANK" not in os.environ:
        from mok_megatron.testing.spawn import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))  # fmt: skip
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        from mok_megatron.megatron import cpu_shim

        cpu_shim.install()
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=dist.get_world_size())
    return dist.get_rank(), dist.get_world_size()


def transformer_config(shape, device: str, main_grad: bool = False):
    """``main_grad``: gradient_accumulation_fusion on (see ``attach_main_grads``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    hidden, inter, experts, topk = shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=8, ffn_hidden_size=inter,
        moe_ffn_hidden_size=inter, num_moe_experts=experts, moe_router_topk=topk,
        moe_token_dispatcher_type="alltoall", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        pipeline_dtype=dtype, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=dist.get_world_size(), use_cpu_initialization=device == "cpu",
        moe_permute_fusion=False, init_method_std=0.02, gradient_accumulation_fusion=main_grad,
    )  # fmt: skip


def build_layers(config, backend: str, max_tokens: int, cuda_forward: str | None = None):
    """(baseline MoELayer, MoK layer), the MoK layer holding the baseline's weights;
    ``cuda_forward``: its MoKConfig.cuda_forward (None: the default)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from mok_megatron.megatron import get_mok_moe_module_spec
    from mok_megatron.ops import interleave_gate_up
    from mok_megatron.testing.baselines import TorchGroupedMLP

    pg = get_default_pg_collection()
    stock = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts)
    submodules = dataclasses.replace(stock.keywords["submodules"], experts=TorchGroupedMLP)
    baseline = functools.partial(
        stock.func, *stock.args, **{**stock.keywords, "submodules": submodules}
    )
    base = baseline(config=config, pg_collection=pg)
    from mok_megatron.functional import MoKConfig

    mok_config = MoKConfig() if cuda_forward is None else MoKConfig(cuda_forward=cuda_forward)
    mok = get_mok_moe_module_spec(use_te=False, backend=backend, max_local_tokens=max_tokens,
                                  mok_config=mok_config)  # fmt: skip
    layer = mok(
        config=dataclasses.replace(config, moe_token_dispatcher_type="mok"), pg_collection=pg
    )
    with torch.no_grad():
        gate, up = base.experts.weight_fc1.chunk(2, dim=1)  # [E_l, 2I, H]: [gate; up] per expert
        layer.experts.weight_gate_up.copy_(interleave_gate_up(gate, up))
        layer.experts.weight_down.copy_(base.experts.weight_fc2)
    return base, layer


def attach_main_grads(base, layer) -> None:
    """What Megatron's DDP (grad_reduce_in_fp32) gives the expert weights: an fp32 ``main_grad``,
    the ``grad_added_to_main_grad`` flag and a hook that adds ``.grad`` into main_grad unless the
    layer already added its gradient there, then drops ``.grad``. The two layers share one set of
    buffers (same shapes; the values are never read): two sets of fp32 expert gradients would not
    fit in memory at the largest shapes."""
    pairs = ((base.experts.weight_fc1, layer.experts.weight_gate_up),
             (base.experts.weight_fc2, layer.experts.weight_down))  # fmt: skip
    for params in pairs:
        main_grad = torch.zeros(params[0].shape, dtype=torch.float32, device=params[0].device)
        for p in params:
            p.main_grad = main_grad
            p.grad_added_to_main_grad = False
            p.register_post_accumulate_grad_hook(_ddp_grad_hook)


def _ddp_grad_hook(p) -> None:
    """DistributedDataParallel's backward hook (megatron/core/distributed), without the reduce."""
    added = p.grad_added_to_main_grad and not getattr(p, "zero_out_wgrad", False)
    if p.grad is not None and not added:
        p.main_grad.add_(p.grad)
    p.grad = None


def make_inputs(n_sets, tokens, shape, routing, device, dtype, seed, rank):
    """Per set: hidden [T, 1, H] (requires grad), probs [T, E] (requires grad), routing_map."""
    hidden, _, experts, topk = shape
    gen = torch.Generator(device="cpu").manual_seed(seed + 7919 * rank)
    sets = []
    for _ in range(n_sets):
        x = torch.randn(tokens, 1, hidden, generator=gen).to(device, dtype).requires_grad_()
        scores = torch.rand(tokens, experts, generator=gen)
        if routing == "skewed":  # Zipf-like preference for low expert ids
            pref = 1.0 / torch.arange(1, experts + 1, dtype=torch.float32) ** 1.2
            scores = pref.log()[None] - (-scores.clamp_min(1e-9).log()).log()
        idx = scores.topk(topk, dim=-1).indices
        weights = torch.rand(tokens, topk, generator=gen) + 0.1
        weights = weights / weights.sum(-1, keepdim=True)
        probs = torch.zeros(tokens, experts).scatter(1, idx, weights).to(device).requires_grad_()
        routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, idx, True)
        grad = torch.randn(tokens, 1, hidden, generator=gen).to(device, dtype)
        sets.append({"x": x, "probs": probs, "routing_map": routing_map.to(device), "grad": grad,
                     "idx": idx})  # fmt: skip
    return sets


def route_with(layer, inputs):
    """Bypass the router: the layer routes as ``inputs`` says (same for baseline and MoK)."""
    layer.route = lambda hidden_states, padding_mask=None: (inputs["probs"], inputs["routing_map"])


def run_layer(layer, inputs, backward: bool):
    route_with(layer, inputs)
    out, _ = layer(inputs["x"])
    if backward:
        out.backward(inputs["grad"])
    return out


# -------------------------------------------------------------------------------- measuring
def traffic(sets, shape, rank, world):
    """Rows this rank's experts compute and (token, remote rank) pairs, from the real routing."""
    _, _, experts, _ = shape
    e_l = experts // world
    idx = sets[0]["idx"].to(torch.int64)
    mine = torch.zeros(world, dtype=torch.int64)
    dest = idx // e_l
    for d in range(world):
        mine[d] = (dest == d).sum()
    rows = mine.clone()
    if world > 1:
        rows = rows.to("cuda" if torch.cuda.is_available() else "cpu")
        dist.all_reduce(rows)
        rows = rows.cpu()
    visits = torch.zeros(idx.shape[0], world, dtype=torch.bool).scatter(1, dest, True)
    remote = int(visits.sum() - visits[:, rank].sum())
    return int(rows[rank]), remote


def _sampled(device: str, run):
    """``run()`` (a timing) with the GPU's SM clock and power sampled meanwhile:
    (timing, ``gpu_during``: testing.gpu_clocks' summary, None off CUDA or without NVML)."""
    with ClockSampler(cuda_reader() if device == "cuda" else None) as clocks:
        timing = run()
    return timing, clocks.summary()


def measure(layer, sets, args, backward: bool, calls: int = 0) -> dict:
    """The layer's pass timed call by call from an idle GPU (time_fn), or ``calls`` calls back to
    back per sample (time_back_to_back); its peak memory; the SM clock and power while it was
    timed (``gpu_during``: testing.gpu_clocks, None where NVML cannot say)."""
    device = args.device
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()

    def fn(i):
        return run_layer(layer, sets[i % len(sets)], backward)

    def run():
        if calls:
            return time_back_to_back(fn, warmup=args.warmup, iters=args.iters, calls=calls,
                                     device=device)  # fmt: skip
        return time_fn(fn, warmup=args.warmup, iters=args.iters, device=device)

    timing, during = _sampled(device, run)
    peak = (torch.cuda.max_memory_allocated() - base_mem) if device == "cuda" else 0
    return {**_measured(timing, peak, device), "gpu_during": during}


def _measured(timing, peak: int, device: str) -> dict:
    """A contender's entry: the timing, its median over ranks' worst (the slowest rank sets the
    step time) and the peak memory."""
    worst = torch.tensor([timing.median_ms], device=device if device == "cuda" else "cpu")
    if dist.get_world_size() > 1:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {**timing.as_dict(), "median_ms_all_ranks_max": float(worst.item()),
            "peak_mem_bytes": int(peak)}  # fmt: skip


def measure_graphed(layer, sets, args) -> dict:
    """The MoK layer's forward on each input set captured in a CUDA graph (after a warm-up pass
    on the capture stream), then the replays timed as ``measure`` times calls: each replay is one
    forward's kernels with no host work between them; then each graph is replayed once more into
    its output filled with NaN, which must equal the eager output bit for bit. Peak memory: the
    graphs' pools."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = [run_layer(layer, inputs, backward=False).detach() for inputs in sets]
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base_mem = torch.cuda.memory_allocated()
    graphs, outs = [], []
    for inputs in sets:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(run_layer(layer, inputs, backward=False).detach())
        graphs.append(graph)
    timing, during = _sampled("cuda", lambda: time_fn(
        lambda i: graphs[i % len(graphs)].replay(), warmup=args.warmup, iters=args.iters,
        device="cuda"))  # fmt: skip
    peak = torch.cuda.max_memory_allocated() - base_mem
    for graph, out in zip(graphs, outs):  # one more replay of each, into a poisoned output
        out.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    layer.experts._layer_runtime.last_workspace.check_errors()
    for i, (a, b) in enumerate(zip(outs, eager)):
        if not torch.equal(a, b):
            raise AssertionError(f"--mok-graph: input set {i}'s replay differs from eager")
    graphs.clear()  # the graphs and their pools go before the next contender
    outs.clear()
    return {**_measured(timing, peak, "cuda"), "gpu_during": during}


#: The dense GEMM of ``--live-ceiling``: square bf16 matmuls of this size (CPU: a small one).
DENSE_N = {"cuda": 8192, "cpu": 256}


def measure_dense_ceiling(flops: float, args) -> dict:
    """A dense bf16 GEMM's rate now, on this GPU in its present power state: square matmuls of
    DENSE_N (into one preallocated output) back to back, as many as do the pass's ``flops``
    (at least one), timed as ``measure`` times a contender, with the clock sampled. The floor's
    782 TFLOP/s is a fixed ceiling measured once; this one is taken in the same process, after
    the contenders, at whatever clock the power cap leaves, so a contender's rate over it says
    how far it is from a dense GEMM under the same conditions."""
    device = args.device
    n = DENSE_N[device]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    a = torch.randn(n, n, generator=gen, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, generator=gen, device=device).to(torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    per_matmul = 2.0 * n**3
    matmuls = max(1, round(flops / per_matmul))

    def fn(_):
        for _ in range(matmuls):
            torch.mm(a, b, out=c)

    timing, during = _sampled(device, lambda: time_fn(fn, warmup=args.warmup, iters=args.iters,
                                                      device=device))  # fmt: skip
    t = {**timing.as_dict(), "n": n, "matmuls": matmuls, "gpu_during": during}
    t["tflops"] = matmuls * per_matmul / (timing.median_ms * 1e-3) / 1e12
    return t


def _rates(t: dict, cost: dict) -> dict:
    """``t`` with its TFLOP/s, NVLink GB/s and fraction of the floor added."""
    ms = t["median_ms_all_ranks_max"]
    t["tflops"] = cost["flops"] / (ms * 1e-3) / 1e12
    t["nvlink_gbps"] = cost["link_bytes"] / (ms * 1e-3) / 1e9
    t["fraction_of_floor"] = cost["floor_ms"] / ms
    return t


def compare_outputs(base, layer, inputs) -> float:
    from mok_megatron.testing import relative_error

    with torch.no_grad():
        a = run_layer(base, inputs, backward=False)
        b = run_layer(layer, inputs, backward=False)
    return relative_error(b.float().cpu(), a.float().cpu())


def _backend_name(layer) -> str:
    """The backend (and CUDA path) the MoK layer's workspace resolved to (after its first call):
    "reference", "cuda/stage1" or "cuda/megakernel"."""
    from mok_megatron.functional.workspace import backend_path

    return backend_path(layer.experts._layer_runtime.last_workspace)


def bench_case(name, shape, tokens, routing, args, rank, world) -> dict:
    config = transformer_config(shape, args.device, args.main_grad)
    base, layer = build_layers(config, args.backend, tokens, args.mok_cuda_forward)
    if args.main_grad:
        attach_main_grads(base, layer)
    dtype = config.params_dtype
    sets = make_inputs(args.rotate, tokens, shape, routing, args.device, dtype, args.seed, rank)
    rows, remote = traffic(sets, shape, rank, world)
    hidden, inter, experts, _ = shape
    diff = compare_outputs(base, layer, sets[0])  # the first call also resolves the backend
    case = {"shape": name, "hidden": hidden, "intermediate": inter, "experts": experts,
            "topk": shape[3], "tokens_per_rank": tokens, "routing": routing, "ep": world,
            "routed_rows_rank": rows, "remote_pairs_rank": remote,
            "output_rel_diff": diff, "mok_backend": _backend_name(layer)}  # fmt: skip
    if (
        case["mok_backend"] == "reference"
        and args.device == "cuda"
        and not args.allow_reference_on_gpu
    ):
        # The reference is an oracle, not a contender: say so instead of timing it as MoK.
        case["skipped"] = "MoK resolved to the reference backend on GPU (CUDA backend missing)"
        return case
    passes = [("fwd", False)] + ([] if args.no_backward else [("fwd_bwd", True)])
    for label, backward in passes:
        cost = moe_pass_cost(routed_rows=rows, remote_pairs=remote, hidden=hidden, inter=inter,
                             local_experts=experts // world, backward=backward)  # fmt: skip
        result = {"cost": cost}
        variants = [v for v in args.mok_expert_gemm.split(",") if v]
        contenders = [("baseline", base, {}), ("mok", layer, {})]
        contenders += [(f"mok_gemm_{v}", layer, {"expert_gemm": v}) for v in variants]
        if args.mok_stage1:
            contenders.append(("mok_stage1", layer, {"cuda_forward": "stage1"}))
        if args.mok_stage1_backward and backward:
            contenders.append(("mok_stage1_bwd", layer, {"cuda_backward": "stage1"}))
        if args.mok_bwd_wgrad and backward:
            contenders.append(("mok_bwd_wgrad", layer, {"bwd_wgrad": "down"}))
            contenders.append(
                ("mok_bwd_wgrad_interleaved", layer, {"bwd_wgrad": "down_interleaved"})
            )
        if args.mok_pull:
            contenders.append(("mok_pull", layer, {"fwd_rows": "pull"}))
        if args.mok_cluster2:
            contenders.append(("mok_cluster2", layer, {"megakernel_cluster": 2}))
        if args.mok_chained_ab:
            contenders += [(name, layer, knobs) for name, knobs in chain_ab(args)]
        if args.mok_wgrad_pingpong and backward:
            contenders.append(("mok_wgrad_pingpong", layer, WGRAD_PINGPONG_KNOBS))
        if args.mok_wgrad_cluster2 and backward:
            contenders.append(("mok_wgrad_cluster2", layer, WGRAD_CLUSTER2_KNOBS))
        if args.mok_macrobatch:
            rounds = {"macrobatch_size": args.mok_macrobatch}
            contenders.append(("mok_rounds", layer, rounds))
            if backward:
                contenders.append(
                    ("mok_rounds_stage1_bwd", layer, {**rounds, "cuda_backward": "stage1"})
                )
        if args.mok_fp8:
            contenders.append(("mok_fp8", layer, MOK_FP8_KNOBS))
            if backward:  # the forward is mok_fp8's
                contenders.append(
                    ("mok_fp8_dgrad", layer, {**MOK_FP8_KNOBS, "fp8_backward": "dgrad"})
                )
        if args.mok_fp8_mega:
            contenders.append(("mok_fp8_mega", layer, MOK_FP8_MEGA_KNOBS))
            if backward and args.mok_fp8:  # the FP8 megakernel's forward, FP8 data gradients
                contenders.append(
                    ("mok_fp8_mega_dgrad", layer, {**MOK_FP8_MEGA_KNOBS, "fp8_backward": "dgrad"})
                )
        for who, module, knobs in contenders:
            with _mok_knobs(module, **knobs):
                t = measure(module, sets, args, backward)
            module.zero_grad(set_to_none=True)  # one layer's gradients in memory at a time
            result[who] = _rates(t, cost)
        if args.back_to_back:
            b2b = [("baseline", base, {}), ("mok", layer, {})]
            b2b += [(n, layer, k) for n, k in chain_ab(args)] if args.mok_chained_ab else []
            for who, module, knobs in b2b:
                with _mok_knobs(module, **knobs):
                    t = measure(module, sets, args, backward, calls=args.back_to_back)
                module.zero_grad(set_to_none=True)
                result[f"{who}_back_to_back"] = _rates(t, cost)
            result["back_to_back_speedup"] = _ratio(result, "baseline_back_to_back",
                                                    "mok_back_to_back")  # fmt: skip
            if args.mok_chained_ab:  # > 1: chained launches are faster back to back
                result["chained_back_to_back_speedup"] = _ratio(
                    result, "mok_unchained_back_to_back", "mok_chained_back_to_back"
                )
        if args.mok_graph and not backward:
            result["mok_graph"] = _rates(measure_graphed(layer, sets, args), cost)
            layer.zero_grad(set_to_none=True)
            if args.mok_pull:
                with _mok_knobs(layer, fwd_rows="pull"):
                    result["mok_pull_graph"] = _rates(measure_graphed(layer, sets, args), cost)
                layer.zero_grad(set_to_none=True)
            if args.mok_chained_ab:
                for name, knobs in chain_ab(args):
                    with _mok_knobs(layer, **knobs):
                        graphed = measure_graphed(layer, sets, args)
                    result[f"{name}_graph"] = _rates(graphed, cost)
                    layer.zero_grad(set_to_none=True)
                result["chained_graph_speedup"] = _ratio(result, "mok_unchained_graph",
                                                         "mok_chained_graph")  # fmt: skip
            if args.mok_fp8_mega:
                with _mok_knobs(layer, **MOK_FP8_MEGA_KNOBS):
                    graphed = measure_graphed(layer, sets, args)
                result["mok_fp8_mega_graph"] = _rates(graphed, cost)
                layer.zero_grad(set_to_none=True)
                result["fp8_mega_graph_speedup"] = _ratio(result, "mok_graph", "mok_fp8_mega_graph")
        if args.live_ceiling:  # after every contender of the pass
            dense = measure_dense_ceiling(cost["flops"], args)
            result["dense_ceiling"] = dense
            for entry in result.values():
                if isinstance(entry, dict) and "fraction_of_floor" in entry:
                    entry["of_dense_ceiling"] = entry["tflops"] / dense["tflops"]
        result["speedup"] = _ratio(result, "baseline", "mok")
        if args.mok_fp8:  # > 1: the FP8 experts beat MoK's default (BF16) layer
            result["fp8_speedup"] = _ratio(result, "mok", "mok_fp8")
            if backward:
                result["fp8_dgrad_speedup"] = _ratio(result, "mok", "mok_fp8_dgrad")
        if args.mok_fp8_mega:  # > 1: the FP8 megakernel beats MoK's default (BF16) layer
            result["fp8_mega_speedup"] = _ratio(result, "mok", "mok_fp8_mega")
            if "mok_fp8_mega_dgrad" in result:
                result["fp8_mega_dgrad_speedup"] = _ratio(result, "mok", "mok_fp8_mega_dgrad")
            if args.mok_fp8:  # > 1: the FP8 megakernel beats the FP8 stage 1
                result["fp8_mega_over_stage1"] = _ratio(result, "mok_fp8", "mok_fp8_mega")
        if args.mok_stage1:  # > 1: the default forward (the megakernel) beats stage 1
            result["stage1_speedup"] = _ratio(result, "mok_stage1", "mok")
        if args.mok_pull:  # > 1: the default rows (fwd_rows='auto') beat the pull
            result["pull_speedup"] = _ratio(result, "mok_pull", "mok")
            if "mok_pull_graph" in result:
                result["pull_graph_speedup"] = _ratio(result, "mok_pull_graph", "mok_graph")
        if args.mok_cluster2:  # > 1: clusters of two beat the megakernels without clusters
            result["cluster2_speedup"] = _ratio(result, "mok", "mok_cluster2")
        if args.mok_chained_ab:  # > 1: chained launches beat plain stream order
            result["chained_speedup"] = _ratio(result, "mok_unchained", "mok_chained")
        if "mok_wgrad_pingpong" in result:  # > 1: the pingpong weight gradients beat the default
            result["wgrad_pingpong_speedup"] = _ratio(result, "mok", "mok_wgrad_pingpong")
        if "mok_wgrad_cluster2" in result:  # > 1: the clustered weight gradients beat the default
            result["wgrad_cluster2_speedup"] = _ratio(result, "mok", "mok_wgrad_cluster2")
        if "mok_rounds_stage1_bwd" in result:  # > 1: the backward megakernel in rounds wins
            result["rounds_bwd_speedup"] = _ratio(result, "mok_rounds_stage1_bwd", "mok_rounds")
        if "mok_bwd_wgrad" in result:  # > 1: the down weight's gradient in the launch wins
            result["bwd_wgrad_speedup"] = _ratio(result, "mok", "mok_bwd_wgrad")
            result["bwd_wgrad_interleaved_speedup"] = _ratio(
                result, "mok", "mok_bwd_wgrad_interleaved"
            )
        if "mok_stage1_bwd" in result:  # > 1: the backward megakernel beats stage 1's
            result["stage1_bwd_speedup"] = _ratio(result, "mok_stage1_bwd", "mok")
        # > 1: MoK's default expert GEMMs beat this setting
        result["default_gemm_speedup"] = {
            v: _ratio(result, f"mok_gemm_{v}", "mok") for v in variants
        }
        case[label] = result
    if args.device == "cuda":  # what the clocks were, for reading the spread
        case["gpu_state_after"] = _gpu_state()
    if args.main_grad and not args.no_backward:  # did MoK's backward take the fused path?
        experts = layer.experts
        case["mok_into_main_grad"] = all(
            p.grad_added_to_main_grad for p in (experts.weight_gate_up, experts.weight_down)
        )
    return case


def _ratio(result: dict, slower: str, faster: str) -> float:
    """``slower``'s time over ``faster``'s (their slowest-rank medians): > 1 where ``faster`` is."""
    return (result[slower]["median_ms_all_ranks_max"]
            / result[faster]["median_ms_all_ranks_max"])  # fmt: skip


#: The contenders of ``--mok-chained-ab``: MoK's kernels chained, and in plain stream order.
CHAIN_AB = {"mok_chained": {"chained_launches": True},
            "mok_unchained": {"chained_launches": False}}  # fmt: skip


def chain_ab(args) -> list:
    """CHAIN_AB's (name, knobs) pairs in the order ``--mok-chained-ab`` names: its value first."""
    pairs = list(CHAIN_AB.items())
    return pairs if args.mok_chained_ab != "unchained" else pairs[::-1]


#: The 'mok_wgrad_pingpong' contender (``--mok-wgrad-pingpong``): the weight gradients on the
#: engine (in '.grad' mode too, where 'auto' leaves them to torch) in the pingpong schedule.
WGRAD_PINGPONG_KNOBS = {
    "expert_gemm": ",".join((*AUTO_ENGINE_STEPS, "wgrad")),
    "wgrad_tuning": GemmTuning(schedule="pingpong"),
}
#: The 'mok_wgrad_cluster2' contender (``--mok-wgrad-cluster2``): the same in the engine's
#: cooperative_cluster2 schedule.
WGRAD_CLUSTER2_KNOBS = {
    "expert_gemm": WGRAD_PINGPONG_KNOBS["expert_gemm"],
    "wgrad_tuning": GemmTuning(schedule="cooperative_cluster2"),
}

#: The MoK knobs of the FP8-experts contenders: stage 1 (``--mok-fp8``; profile_moe.py's too)
#: and the FP8 megakernel forward (``--mok-fp8-mega``).
MOK_FP8_KNOBS = {"cuda_forward": "stage1", "expert_precision": "fp8_blockwise"}
MOK_FP8_MEGA_KNOBS = {"cuda_forward": "megakernel", "expert_precision": "fp8_blockwise"}


@contextlib.contextmanager
def _mok_knobs(layer, wgrad_tuning=None, **knobs):
    """The MoK layer runs with its MoKConfig's fields set to ``knobs`` inside (None: unchanged),
    e.g. cuda_forward="stage1" or expert_gemm="torch"; ``wgrad_tuning`` (a GemmTuning, not a
    MoKConfig knob) replaces the engine's weight-gradient tile order, experts.WGRAD_TUNING."""
    from mok_megatron.functional.cuda import experts

    knobs = {k: v for k, v in knobs.items() if v is not None}
    if not knobs and wgrad_tuning is None:  # the baseline too: it has no MoK runtime
        yield
        return
    runtime = layer.experts._layer_runtime
    old, old_tuning = runtime.mok_config, experts.WGRAD_TUNING
    if knobs:
        runtime.mok_config = dataclasses.replace(old, **knobs)
    if wgrad_tuning is not None:
        experts.WGRAD_TUNING = wgrad_tuning
    try:
        yield
    finally:
        runtime.mok_config, experts.WGRAD_TUNING = old, old_tuning


def _release_memory() -> None:
    """Drop cached workspaces (symmetric buffers included) and cached blocks between cases."""
    from mok_megatron import functional

    functional.clear_workspace_cache()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def environment(args) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": args.device,
            "world_size": dist.get_world_size(), "python": sys.version.split()[0],
            "commit": os.environ.get("MOK_COMMIT") or _git_commit(),
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["driver"] = _driver_version()
    return info


def _git_commit() -> str | None:
    import subprocess

    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


def _query_gpu(fields, index: str | None = None) -> list[str] | None:
    """nvidia-smi's values of ``fields`` (no units) for GPU ``index`` (the first if None), or
    None where nvidia-smi is missing, refuses a field or answers in another shape."""
    import subprocess

    where = [] if index is None else ["-i", index]
    try:
        out = subprocess.check_output(
            ["nvidia-smi", *where, f"--query-gpu={','.join(fields)}",
             "--format=csv,noheader,nounits"], text=True, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    values = [v.strip() for v in out.splitlines()[0].split(",")] if out.strip() else []
    return values if len(values) == len(fields) else None


def _driver_version() -> str | None:
    values = _query_gpu(["driver_version"])
    return values[0] if values else None


#: nvidia-smi fields sampled after each case (the last is dropped where the driver lacks it).
GPU_STATE_FIELDS = ("clocks.sm", "clocks.max.sm", "power.draw", "temperature.gpu",
                    "clocks_event_reasons.active")  # fmt: skip


def _gpu_state() -> dict | None:
    """This GPU's SM clock, its maximum, power draw, temperature and active clock-event
    (throttle) reasons from nvidia-smi, or None where nvidia-smi cannot say."""
    index = str(torch.cuda.current_device())
    for fields in (GPU_STATE_FIELDS, GPU_STATE_FIELDS[:-1]):
        values = _query_gpu(fields, index)
        if values is not None:
            return dict(zip(fields, values))
    return None


def _report(case, name, tokens, routing) -> None:
    from tqdm import tqdm

    if "skipped" in case:
        tqdm.write(f"{name} T={tokens} {routing}: skipped: {case['skipped']}")
        return
    fb = case.get("fwd_bwd", case["fwd"])
    engine = "".join(
        f", default vs expert_gemm={v}: fwd {x:.2f}x fwd+bwd {fb['default_gemm_speedup'][v]:.2f}x"
        for v, x in case["fwd"].get("default_gemm_speedup", {}).items()
    )
    if "wgrad_pingpong_speedup" in fb:
        engine += f", pingpong weight gradients: fwd+bwd {fb['wgrad_pingpong_speedup']:.2f}x"
    if "wgrad_cluster2_speedup" in fb:
        engine += f", clustered weight gradients: fwd+bwd {fb['wgrad_cluster2_speedup']:.2f}x"
    if "bwd_wgrad_speedup" in fb:
        engine += f", down weight's gradient in the launch: fwd+bwd {fb['bwd_wgrad_speedup']:.2f}x"
        if "bwd_wgrad_interleaved_speedup" in fb:
            engine += f" ({fb['bwd_wgrad_interleaved_speedup']:.2f}x interleaved)"
    if "chained_speedup" in fb:
        f = case["fwd"]
        engine += f", chained launches: fwd {f['chained_speedup']:.2f}x fwd+bwd " + (
            f"{fb['chained_speedup']:.2f}x"
        )
        if "chained_graph_speedup" in f:
            engine += f" (fwd replayed {f['chained_graph_speedup']:.2f}x)"
    if "rounds_bwd_speedup" in fb:
        engine += (
            f", in rounds the backward megakernel vs stage 1's: {fb['rounds_bwd_speedup']:.2f}x"
        )
    stage1 = ""
    if "stage1_speedup" in case["fwd"]:
        stage1 = (f", vs stage 1: fwd {case['fwd']['stage1_speedup']:.2f}x fwd+bwd "
                  f"{fb['stage1_speedup']:.2f}x")  # fmt: skip
    floor = f", fwd at {case['fwd']['mok']['fraction_of_floor']:.2f} of the floor"
    if "mok_graph" in case["fwd"]:
        floor += f" ({case['fwd']['mok_graph']['fraction_of_floor']:.2f} replayed from a graph)"
    if "back_to_back_speedup" in case["fwd"]:
        b2b = {label: case[label] for label in ("fwd", "fwd_bwd") if label in case}
        floor += "; back to back: " + ", ".join(
            f"{label.replace('_', '+')} speedup {r['back_to_back_speedup']:.2f}x, mok at "
            f"{r['mok_back_to_back']['fraction_of_floor']:.2f} of the floor"
            for label, r in b2b.items()
        )
    tqdm.write(
        f"{name} T={tokens} {routing}: fwd speedup {case['fwd']['speedup']:.2f}x, "
        f"fwd+bwd speedup {fb['speedup']:.2f}x, out rel diff {case['output_rel_diff']:.1e}"
        + floor
        + stage1
        + engine
    )


def _write(record, path) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)


def write_model_record(benchmark: str, args, cases: list, **fields) -> None:
    """A CPU model's JSON record (scripts/tile_padding.py, scripts/wgrad_traffic.py) at
    ``args.out``: its name, where it was computed, its arguments, ``fields`` and its cases."""
    env = {"torch": torch.__version__, "python": sys.version.split()[0], "device": "cpu",
           "commit": os.environ.get("MOK_COMMIT") or _git_commit(),
           "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    _write({"benchmark": benchmark, "environment": env, "args": vars(args), **fields,
            "cases": cases}, args.out)  # fmt: skip
    print(f"wrote {args.out}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.mok_graph and args.device != "cuda":
        raise SystemExit("--mok-graph captures CUDA graphs: it needs --device cuda")
    if args.mok_pull and args.mok_cuda_forward != "megakernel":
        # MoKConfig's default forward is stage 1's, which fwd_rows does not change: both
        # contenders would time the same path
        raise SystemExit("--mok-pull compares the megakernel's forward rows: it needs "
                         "--mok-cuda-forward megakernel")  # fmt: skip
    if args.mok_bwd_wgrad and args.mok_cuda_forward != "megakernel":
        # MoKConfig refuses bwd_wgrad='down' after stage 1's forward (no backward megakernel)
        raise SystemExit("--mok-bwd-wgrad times the backward megakernel's down-weight tasks: it "
                         "needs --mok-cuda-forward megakernel")  # fmt: skip
    rank, world = init_distributed(args.device)
    shapes = TINY_SHAPES if args.tiny else {k: SHAPES[k] for k in args.shapes.split(",")}
    tokens = [64] if args.tiny else [int(t) for t in args.tokens.split(",")]
    routings = args.routing.split(",")
    cases = [(n, s, t, r) for n, s in shapes.items() for t in tokens for r in routings]
    from tqdm import tqdm

    results = []
    record = {"benchmark": "bench_moe", "environment": environment(args), "args": vars(args),
              "cases": results}  # fmt: skip
    for name, shape, t, routing in tqdm(cases, disable=rank != 0, desc="bench_moe"):
        try:
            results.append(bench_case(name, shape, t, routing, args, rank, world))
        except torch.cuda.OutOfMemoryError as exc:  # say so in the record, go on with the rest
            results.append({"shape": name, "tokens_per_rank": t, "routing": routing, "ep": world,
                            "mok_backend": None, "skipped": f"out of GPU memory: {exc}"[:300]})  # fmt: skip
        _release_memory()
        if rank == 0:
            _report(results[-1], name, t, routing)
            _write(record, args.out)  # after every case: a run cut short keeps what it measured
    if rank == 0 and args.out:
        print(f"wrote {args.out}")
    dist.destroy_process_group()
    return record


if __name__ == "__main__":
    main()
