#!/usr/bin/env python3
"""The GPU's idle time between the kernels of MoK's pass, from torch.profiler's kernel
timestamps: the forward called back to back and replayed from a CUDA graph, and forward +
backward back to back, with MoKConfig.chained_launches off and on (CHAINED=0,1, the default
both). Per pass (split at each routing_to_topk, the first and last pass dropped): its span from
the first kernel's start to the last one's end, the kernels' summed durations ('busy': a chained
kernel's includes its wait for the one before) and the summed gaps between consecutive kernels;
the medians over passes, and one forward + backward's kernels (start offset, duration, name).
A diagnosis under the profiler, not a timing (scripts/bench_moe.py --mok-chained-ab times).

    OUT=docs/results python3 scripts/launch_gaps.py qwen3-30b-a3b 8192
    (writes $OUT/gaps.json; bench_moe.py's layers, weights and routing)
"""

import json
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_moe as b  # noqa: E402


def kernels(p):
    ev = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in ev)


def passes(ks, first="routing_to_topk"):
    out, cur = [], []
    for k in ks:
        if first in k[2] and cur:
            out.append(cur)
            cur = []
        cur.append(k)
    if cur:
        out.append(cur)
    return out


def summarize(ps):
    ps = ps[1:-1] if len(ps) > 2 else ps
    spans = [ks[-1][1] - ks[0][0] for ks in ps]
    busy = [sum(e - s for s, e, _ in ks) for ks in ps]
    gaps = [sum(max(0, ks[i + 1][0] - ks[i][1]) for i in range(len(ks) - 1)) for ks in ps]
    return {
        "passes": len(ps),
        "kernels": len(ps[0]),
        "span_us": statistics.median(spans),
        "busy_us": statistics.median(busy),
        "gaps_us": statistics.median(gaps),
    }


def profiled(fn, warmup: int, calls: int) -> list:
    """``fn`` called ``warmup`` times, then ``calls`` times under the profiler: their passes."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return passes(kernels(p))


def one(layer, inp):
    r = {"fwd_b2b": summarize(profiled(lambda: b.run_layer(layer, inp, False), 3, 8))}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        b.run_layer(layer, inp, False)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        b.run_layer(layer, inp, False)
    r["fwd_graph"] = summarize(profiled(g.replay, 3, 8))
    del g
    ks = profiled(lambda: b.run_layer(layer, inp, True), 2, 6)
    r["fwdbwd_b2b"] = summarize(ks)
    r["fwdbwd_kernels"] = [
        [round(s - ks[2][0][0], 1), round(e - s, 1), n[:70]] for s, e, n in ks[2]
    ]
    layer.zero_grad(set_to_none=True)
    return r


def main() -> None:
    b.init_distributed("cuda")
    res = {}
    for name in sys.argv[1].split(","):
        for tokens in [int(t) for t in sys.argv[2].split(",")]:
            shape = b.SHAPES[name]
            cfg = b.transformer_config(shape, "cuda")
            base, layer = b.build_layers(cfg, "auto", tokens, "megakernel")
            del base
            inp = b.make_inputs(1, tokens, shape, "uniform", "cuda", cfg.params_dtype, 0, 0)[0]
            for chained in [c == "1" for c in os.environ.get("CHAINED", "0,1").split(",")]:
                key = f"{name}:{tokens}:chained={int(chained)}"
                with b._mok_knobs(layer, chained_launches=chained):
                    res[key] = one(layer, inp)
                print(
                    key,
                    json.dumps({k: v for k, v in res[key].items() if k != "fwdbwd_kernels"}),
                    flush=True,
                )
            del layer, inp
            b._release_memory()
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "gaps.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
