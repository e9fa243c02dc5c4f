#!/usr/bin/env python3
"""Where the time goes: torch.profiler over the forward, and over forward + backward, of the MoK
layer and the baseline (the same layers, weights and routing as scripts/bench_moe.py): GPU time,
kernel launches per pass and the top kernels, written as JSON per shape.

  torchrun --standalone --nproc-per-node 2 scripts/profile_moe.py --out profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_moe  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3,mixtral-8x7b")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--routing", default="uniform")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--top", type=int, default=25, help="kernels kept per profile")
    p.add_argument("--mok-cuda-forward", default=None, choices=("stage1", "megakernel", "auto"))
    p.add_argument(
        "--host",
        action="store_true",
        help="also the host side of one forward: seconds until the call returns, "
        "and cProfile's top functions",
    )
    p.add_argument(
        "--mok-fp8",
        action="store_true",
        help="also profile MoK with expert_precision='fp8_blockwise' (stage 1) as mok_fp8_fwd "
        "and mok_fp8 (forward + backward)",
    )
    p.add_argument(
        "--mok-fp8-mega",
        action="store_true",
        help="also profile the FP8 megakernel forward (expert_precision='fp8_blockwise', "
        "cuda_forward='megakernel') as mok_fp8_mega_fwd (with --host, its host side too)",
    )
    p.add_argument(
        "--main-grad",
        action="store_true",
        help="as bench_moe's --main-grad: fp32 main_grad buffers and DDP's accumulate hook on the "
        "expert weights, gradient_accumulation_fusion on (MoK's weight-gradient GEMMs add into "
        "main_grad; the baseline's hook adds .grad into it)",
    )
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def profile(layer, sets, iters: int, top: int, backward: bool = True) -> dict:
    import time

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for i in range(2):
        bench_moe.run_layer(layer, sets[i % len(sets)], backward=backward)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for i in range(iters):
            bench_moe.run_layer(layer, sets[i % len(sets)], backward=backward)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events)
    return {
        "gpu_time_us_per_iter": total / iters,
        "wall_us_per_iter": wall * 1e6 / iters,  # under the profiler: launch gaps show here
        "launches_per_iter": sum(e.count for e in events) / iters,
        "kernels": [
            {
                "name": e.key[:160],
                "calls_per_iter": e.count / iters,
                "us_per_iter": e.device_time_total / iters,
                "share": e.device_time_total / total,
            }  # fmt: skip
            for e in events[:top]
        ],
    }


def host_profile(layer, sets, iters: int, top: int) -> dict:
    """The host side of a forward started from an idle GPU (as bench_moe times it): how long the
    call takes to return (host_ms), the event-timed call (call_ms, bench_moe's measure), and
    cProfile's top functions by own time and by cumulative time over ``iters`` calls."""
    import cProfile
    import pstats
    import statistics
    import time

    for i in range(3):
        bench_moe.run_layer(layer, sets[i % len(sets)], backward=False)
    host, call = [], []
    for i in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        bench_moe.run_layer(layer, sets[i % len(sets)], backward=False)
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        call.append(start.elapsed_time(end))
    prof = cProfile.Profile()
    for i in range(iters):
        torch.cuda.synchronize()
        prof.enable()
        bench_moe.run_layer(layer, sets[i % len(sets)], backward=False)
        prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}

    def rows(key: int) -> list[dict]:
        ranked = sorted(stats.items(), key=lambda kv: kv[1][key], reverse=True)[:top]
        return [{"function": f"{os.path.relpath(f) if f.startswith('/') else f}:{line}({name})",
                 "calls_per_iter": nc / iters, "own_us_per_iter": tt * 1e6 / iters,
                 "cum_us_per_iter": ct * 1e6 / iters}
                for (f, line, name), (_, nc, tt, ct, _) in ranked]  # fmt: skip

    return {"host_ms_median": statistics.median(host), "host_ms": host,
            "call_ms_median": statistics.median(call), "call_ms": call,
            "by_own_time": rows(2), "by_cumulative_time": rows(3),
            **host_timeline(layer, sets[0], top)}  # fmt: skip


def host_timeline(layer, inputs, top: int) -> dict:
    """One forward under torch.profiler (CPU and CUDA): the host ops by own CPU time (CUDA runtime
    calls included), and the GPU's kernels and copies on the call's clock (us from the call's
    start: when each starts and ends, so the idle time before and between them shows)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("host_timeline_call"):
            bench_moe.run_layer(layer, inputs, backward=False)
        torch.cuda.synchronize()
    events = prof.events()
    call = next(e for e in events if e.name == "host_timeline_call")
    t0 = call.time_range.start
    gpu = sorted((e for e in events if e.device_type == DeviceType.CUDA),
                 key=lambda e: e.time_range.start)  # fmt: skip
    cpu = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                 key=lambda e: e.self_cpu_time_total, reverse=True)[:top]  # fmt: skip
    return {
        "call_host_us": call.time_range.end - t0,
        "gpu_events": [
            {
                "name": e.name[:120],
                "start_us": e.time_range.start - t0,
                "end_us": e.time_range.end - t0,
            }
            for e in gpu
        ],  # fmt: skip
        "cpu_self": [
            {"name": e.key[:120], "calls": e.count, "self_us": e.self_cpu_time_total} for e in cpu
        ],  # fmt: skip
    }


def print_host(title: str, h: dict) -> None:
    """host_profile's record, printed."""
    print(
        f"{title} forward: host {h['host_ms_median']:.3f} ms until the call returns, "
        f"{h['call_ms_median']:.3f} ms event-timed; top own time:"
    )
    for r in h["by_own_time"][:12]:
        print(f"    {r['own_us_per_iter']:8.1f} us {r['cum_us_per_iter']:8.1f} us "
              f"x{r['calls_per_iter']:.0f} {r['function']}")  # fmt: skip
    print(
        f"  one call under torch.profiler: host {h['call_host_us']:.0f} us; "
        "GPU events (start-end us from the call's start):"
    )
    for e in h["gpu_events"]:
        print(f"    {e['start_us']:8.1f} {e['end_us']:8.1f} {e['name'][:70]}")
    print("  host self time:")
    for e in h["cpu_self"][:30]:
        print(f"    {e['self_us']:8.1f} us x{e['calls']} {e['name'][:70]}")
    print("  top cumulative:")
    for r in h["by_cumulative_time"][:25]:
        print(f"    {r['cum_us_per_iter']:8.1f} us x{r['calls_per_iter']:.0f} {r['function']}")


def main(argv=None) -> None:
    args = parse_args(argv)
    bench_args = bench_moe.parse_args([])
    rank, world = bench_moe.init_distributed("cuda")
    record = {"environment": bench_moe.environment(bench_args), "args": vars(args), "cases": []}
    for name in args.shapes.split(","):
        shape = bench_moe.SHAPES[name]
        config = bench_moe.transformer_config(shape, "cuda", args.main_grad)
        base, layer = bench_moe.build_layers(config, "auto", args.tokens, args.mok_cuda_forward)
        if args.main_grad:
            bench_moe.attach_main_grads(base, layer)
        sets = bench_moe.make_inputs(2, args.tokens, shape, args.routing, "cuda",
                                     config.params_dtype, 1234, rank)  # fmt: skip
        case = {"shape": name, "tokens_per_rank": args.tokens, "routing": args.routing, "ep": world}
        if args.host:
            case["mok_fwd_host"] = host_profile(layer, sets, max(args.iters, 10), args.top)
            case["baseline_fwd_host"] = host_profile(base, sets, max(args.iters, 10), args.top)
            if rank == 0:
                for who in ("mok", "baseline"):
                    print_host(f"{name}: {who}", case[f"{who}_fwd_host"])
        case["mok_fwd"] = profile(layer, sets, args.iters, args.top, backward=False)
        case["baseline_fwd"] = profile(base, sets, args.iters, args.top, backward=False)
        case["mok"] = profile(layer, sets, args.iters, args.top)
        if args.mok_fp8:
            with bench_moe._mok_knobs(layer, **bench_moe.MOK_FP8_KNOBS):
                case["mok_fp8_fwd"] = profile(layer, sets, args.iters, args.top, backward=False)
                case["mok_fp8"] = profile(layer, sets, args.iters, args.top)
            layer.zero_grad(set_to_none=True)
        if args.mok_fp8_mega:
            with bench_moe._mok_knobs(layer, **bench_moe.MOK_FP8_MEGA_KNOBS):
                case["mok_fp8_mega_fwd"] = profile(layer, sets, args.iters, args.top,
                                                   backward=False)  # fmt: skip
                if args.host:
                    case["mok_fp8_mega_fwd_host"] = host_profile(layer, sets, max(args.iters, 10),
                                                                 args.top)  # fmt: skip
                    if rank == 0:
                        print_host(f"{name}: mok_fp8_mega", case["mok_fp8_mega_fwd_host"])
        case["mok_backend"] = bench_moe._backend_name(layer)
        case["baseline"] = profile(base, sets, args.iters, args.top)
        record["cases"].append(case)
        del base, layer, sets
        bench_moe._release_memory()
        if rank == 0:
            fwd, base_fwd = case["mok_fwd"], case["baseline_fwd"]
            print(f"{name}: forward: mok {fwd['gpu_time_us_per_iter'] / 1e3:.2f} ms GPU time in "
                  f"{fwd['launches_per_iter']:.0f} launches, baseline "
                  f"{base_fwd['gpu_time_us_per_iter'] / 1e3:.2f} ms in "
                  f"{base_fwd['launches_per_iter']:.0f}; forward + backward: mok "
                  f"{case['mok']['gpu_time_us_per_iter'] / 1e3:.2f} ms, baseline "
                  f"{case['baseline']['gpu_time_us_per_iter'] / 1e3:.2f} ms")  # fmt: skip
            labels = ("mok_fp8_fwd", "mok_fp8") if args.mok_fp8 else ()
            labels += ("mok_fp8_mega_fwd",) if args.mok_fp8_mega else ()
            for label in labels:
                print(
                    f"  {label}: {case[label]['gpu_time_us_per_iter'] / 1e3:.2f} ms GPU "
                    f"time in {case[label]['launches_per_iter']:.0f} launches; top:"
                )
                for k in case[label]["kernels"][:14]:
                    print(f"    {k['us_per_iter']:9.1f} us x{k['calls_per_iter']:.0f} "
                          f"{k['name'][:90]}")  # fmt: skip
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
