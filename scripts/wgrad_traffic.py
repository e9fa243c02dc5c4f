#!/usr/bin/env python3
"""What the weight gradients' accumulation costs beyond the floor of a forward + backward.

The floor model (testing.timing.moe_pass_cost) counts the three passes' FLOPs and, for memory,
each weight read or written once per pass. A training step also accumulates the new weight
gradients into what the step before left, and scripts/bench_moe.py times repeated passes
without clearing the gradients in between, so both layers do:

- ``grad``: the bench's default. Autograd adds each new bf16 weight gradient into the
  parameter's ``.grad`` in a pass of its own after the backward: it reads both and writes one,
  3 x 2 bytes per expert weight, HBM-bound, after the weight-gradient GEMMs.
- ``main_grad``: Megatron's gradient-accumulation fusion (``bench_moe.py --main-grad``). The
  weight-gradient GEMMs read and write fp32 ``main_grad`` (8 bytes per expert weight instead of
  the 2 of a bf16 gradient the floor counts). Those GEMMs then take at least the longer of their
  FLOPs at the floor's rate (a third of the forward + backward's) and that traffic at the HBM
  ceiling. A GEMM whose warpgroups run each tile's mainloop and then its epilogue together
  (the engine's cooperative kernel) overlaps the two only across SMs, not within one: at EP 1's
  short K (a few k-tiles per tile against 256 KB of main_grad per 128 x 256 tile) it takes
  about their sum ('serial'); the pingpong kernel, one warpgroup's epilogue beside the other's
  mainloop, aims at the longer of the two. The same holds for the plain weight gradients of
  ``grad`` mode, whose epilogue stores the bf16 gradient (2 bytes per expert weight): in serial,
  their FLOPs at the floor's rate plus that store at the HBM ceiling ('plain serial').

For each benchmark shape at EP 1 this writes the traffic, its time at the HBM ceiling of the
floor model, and the most of the floor a forward + backward could reach with everything else at
the floor: ``floor / (floor + add pass)`` for ``grad``; ``floor / (2/3 floor + max(1/3 floor,
main_grad traffic))`` for ``main_grad``, and ``floor / (floor + main_grad traffic)`` for
``main_grad`` in serial. 'fused': the weight gradients inside the backward launch, their
main_grad traffic beside the whole backward's FLOPs (the data gradients' as well: the backward
megakernel's dgrad tiles are compute-bound, the weight gradients' epilogues HBM-bound), so
``floor / (1/3 floor + max(2/3 floor, main_grad traffic))``. A model computed on the CPU, not a
measurement.

The same record holds the forward's weight stream: each expert weight read once (2 bytes, bf16)
at the HBM ceiling, against the forward's FLOPs at the floor's rate. Its ``fwd_weight_share`` is
the fraction of the HBM ceiling the weights alone take while the forward's GEMMs run at that
rate: the floor counts the larger of the two, and the forward's GEMMs run beside that stream.

    python3 scripts/wgrad_traffic.py --out docs/results/wgrad_traffic_<commit>.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe  # noqa: E402

from mok_megatron.testing.timing import H200_CEILINGS, moe_pass_cost  # noqa: E402

PLAIN_STORE_BYTES = 2  # the bf16 weight gradient the plain GEMM's epilogue stores
GRAD_ADD_BYTES = 3 * 2  # bf16: read the new gradient and .grad, write .grad
MAIN_GRAD_BYTES = 2 * 4  # fp32 main_grad read and written by the weight-gradient GEMM
WEIGHT_READ_BYTES = 2  # the forward reads each bf16 expert weight at least once


def case(shape_name: str, tokens: int) -> dict:
    hidden, inter, experts, topk = bench_moe.SHAPES[shape_name]
    cost = moe_pass_cost(routed_rows=tokens * topk, remote_pairs=0, hidden=hidden, inter=inter,
                         local_experts=experts, backward=True)  # fmt: skip
    floor = cost["floor_ms"]
    params = 3 * experts * hidden * inter  # the routed experts' weights (EP 1: all local)
    hbm = H200_CEILINGS.hbm_tbps * 1e12
    add_ms = params * GRAD_ADD_BYTES / hbm * 1e3
    main_ms = params * MAIN_GRAD_BYTES / hbm * 1e3
    plain_ms = params * PLAIN_STORE_BYTES / hbm * 1e3
    wgrad_flops_ms = floor / 3  # the weight-gradient GEMMs' FLOPs at the floor's rate
    forward = moe_pass_cost(routed_rows=tokens * topk, remote_pairs=0, hidden=hidden, inter=inter,
                            local_experts=experts, backward=False)  # fmt: skip
    fwd_flops_ms = forward["flops"] / (H200_CEILINGS.bf16_tflops * 1e12) * 1e3
    fwd_weight_ms = params * WEIGHT_READ_BYTES / hbm * 1e3
    return {
        "shape": shape_name, "tokens_per_rank": tokens, "ep": 1, "expert_params": params,
        "floor_ms": floor, "grad_add_bytes": params * GRAD_ADD_BYTES, "grad_add_ms": add_ms,
        "grad_bound": floor / (floor + add_ms), "main_grad_bytes": params * MAIN_GRAD_BYTES,
        "main_grad_ms": main_ms,
        "main_grad_bound": floor / (floor - wgrad_flops_ms + max(wgrad_flops_ms, main_ms)),
        "plain_serial_ms": wgrad_flops_ms + plain_ms,
        "main_grad_serial_ms": wgrad_flops_ms + main_ms,
        "main_grad_serial_bound": floor / (floor + main_ms),
        "main_grad_fused_bound": floor / (floor / 3 + max(2 * floor / 3, main_ms)),
        "fwd_flops_ms": fwd_flops_ms, "fwd_weight_read_ms": fwd_weight_ms,
        "fwd_weight_share": fwd_weight_ms / fwd_flops_ms,
    }  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(bench_moe.SHAPES))
    p.add_argument("--tokens", default="8192,16384")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    cases = [case(s, int(t)) for s in args.shapes.split(",") for t in args.tokens.split(",")]
    for c in cases:
        print(f"{c['shape']} T={c['tokens_per_rank']}: floor {c['floor_ms']:.2f} ms; .grad add "
              f"{c['grad_add_ms']:.2f} ms (bound {c['grad_bound']:.2f}; plain weight-gradient "
              f"GEMMs in serial {c['plain_serial_ms']:.2f} ms); main_grad "
              f"{c['main_grad_ms']:.2f} ms (bound {c['main_grad_bound']:.2f}; in serial, "
              f"weight-gradient GEMMs {c['main_grad_serial_ms']:.2f} ms, bound "
              f"{c['main_grad_serial_bound']:.2f}; inside the backward launch, bound "
              f"{c['main_grad_fused_bound']:.2f}); forward: weights read once "
              f"{c['fwd_weight_read_ms']:.2f} ms beside {c['fwd_flops_ms']:.2f} ms of FLOPs "
              f"({c['fwd_weight_share']:.2f} of the HBM ceiling)")  # fmt: skip
    bench_moe.write_model_record("wgrad_traffic", args, cases, ceilings=vars(H200_CEILINGS))


if __name__ == "__main__":
    main()
