"""Long runs (issue 17, item 4): many forward + backward passes on one workspace, each bitwise
equal to the first, with memory flat after a warm-up; and the tiny GPT-MoE configs trained for
many steps with MoK's dispatcher, losses finite and memory flat.

Both functions return plain JSON-able dicts of figures; ``failures`` turns a record into the
rules it breaks (the bounds below), which the tests assert and ``scripts/long_runs.py`` reports.
Memory is sampled after every pass or step: on CUDA the caching allocator's reserved and
allocated bytes (host-side queries, no sync), on CPU the process's resident set from
/proc/self/statm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import time
from dataclasses import dataclass
from unittest import mock

import torch

from mok_megatron import functional as F
from mok_megatron.functional.workspace import backend_path
from mok_megatron.memory import MemorySample, memory_sample, process_rss_bytes
from mok_megatron.ops import interleave_gate_up

from .oracles import random_moe_problem
from .runs import global_d_out, problem_workspace

__all__ = [
    "CPU_RSS_TAIL_DRIFT_BOUND",
    "CUDA_RESERVED_SPREAD_BOUND",
    "PASS_SHAPE",
    "MemorySample",
    "failures",
    "memory_sample",
    "process_rss_bytes",
    "repeat_passes",
    "train_steps",
]

#: The repeated problem: 16 experts of about 128 routed rows each (512 x 4 / 16, one GEMM tile
#: height) and a shared expert, so a pass runs many tiles; 1000 passes take seconds on a GPU.
PASS_SHAPE = {"tokens": 512, "hidden": 256, "inter": 128, "experts": 16, "topk": 4, "shared": 128}

#: NOTE: exactly 0: the spread of the reserved bytes from the warm-up on. Every pass (and every
#: training step) makes the same allocations in the same order on one stream, and the host syncs
#: before a block freed on another stream could be wanted again (the loss read in training;
#: nothing crosses streams in a pass), so once warm the caching allocator serves every request
#: from segments it holds: any new segment is growth.
CUDA_RESERVED_SPREAD_BOUND = 0
#: The resident-set growth allowed over the second half of a CPU run (memory_tail_drift_bytes).
#: RSS is not the program's allocations: glibc keeps freed chunks in per-thread arenas, moves its
#: mmap threshold as large blocks come and go and trims lazily, so RSS fills for a while, then
#: wanders by a few MiB. Measured on 2 CPUs: the CPU demo's ranks grow ~43 MiB over the first
#: ~100 steps, then stay flat to step 200; 40 CPU passes of ``repeat_passes`` wander within
#: 8 MiB. So the rule looks at the second half, where a filling allocator has stopped and a leak
#: still grows: 32 MiB catches a leak of 1.6 MiB a step over the 20 steps of the CI run (a
#: step's activations kept alive), of 128 KiB a step over the 250 of the long run.
CPU_RSS_TAIL_DRIFT_BOUND = 32 << 20


def _memory_figures(values: list[int], warmup: int, prefix: str = "memory") -> dict:
    """The reading after pass / step ``warmup`` (1-based) and at the end, the drift between
    them, the spread (max - min) from that reading on, the tail drift (the end minus the
    reading half-way through the run, or after the warm-up if later) and the largest reading."""
    after, middle = values[warmup - 1 :], values[max(warmup, len(values) // 2) - 1]
    return {
        f"{prefix}_after_warmup": after[0],
        f"{prefix}_end": after[-1],
        f"{prefix}_drift_bytes": after[-1] - after[0],
        f"{prefix}_spread_bytes": max(after) - min(after),
        f"{prefix}_tail_drift_bytes": after[-1] - middle,
        f"max_{prefix}": max(values),
    }


def _check_counts(count: int, warmup: int, what: str) -> None:
    if not 1 <= warmup < count:
        raise ValueError(f"{what}={count} and warmup={warmup}: need 1 <= warmup < {what}")


# -------------------------------------------------------------------------- repeated passes
@dataclass
class _PassInputs:
    """The problem on the device: x [T, H], topk [T, K] int64, rw [T, K] float32, the weights
    in F.forward's order (shared gate, up, down, routed gate or gate_up, up or None, down),
    d_out [T, H]."""

    x: torch.Tensor
    topk: torch.Tensor
    rw: torch.Tensor
    weights: tuple
    d_out: torch.Tensor


def _pass_inputs(problem, device, dtype, fused_gate_up: bool, seed: int) -> _PassInputs:
    x, topk, rw, routed, shared = problem.local(0, dtype=dtype, device=device)
    if fused_gate_up:
        routed = (interleave_gate_up(routed[0], routed[1]), None, routed[2])
    d_out = global_d_out(problem, seed).to(device, dtype).contiguous()
    return _PassInputs(x, topk, rw, (*(shared or (None, None, None)), *routed), d_out)


def _one_pass(config, ws, inp: _PassInputs) -> dict:
    """A training step's MoK work: a fresh schedule, the forward, the backward."""
    sched = F.build_schedule(ws, config, inp.topk, ws.num_local_experts, router_weights=inp.rw)
    out, ctx = F.forward(config, ws, sched, inp.x, inp.rw, *inp.weights)
    grads = F.backward(config, ws, sched, ctx, inp.d_out, inp.x, inp.rw, *inp.weights)
    return {"out": out, **{k: v for k, v in grads._asdict().items() if v is not None}}


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _differs(first: dict, again: dict) -> torch.Tensor:
    """A device bool: whether any tensor of ``again`` differs in a bit from ``first`` (compared
    as integers, so the same NaN twice is equal: a bitwise repeat, not a numeric check)."""
    if first.keys() != again.keys() or any(first[k].shape != again[k].shape for k in first):
        return torch.ones((), dtype=torch.bool, device=first["out"].device)
    diffs = [(first[k].view(_INT_OF_SIZE[first[k].element_size()])
              != again[k].view(_INT_OF_SIZE[again[k].element_size()])).any()
             for k in first]  # fmt: skip
    return torch.stack(diffs).any()


def _all_finite(result: dict) -> torch.Tensor:
    return torch.stack([torch.isfinite(t).all() for t in result.values()]).all()


def _pass_workspace(problem, *, device, backend, dtype, cuda_forward):
    config = F.MoKConfig() if cuda_forward is None else F.MoKConfig(cuda_forward=cuda_forward)
    ws = problem_workspace(problem, dtype=dtype, config=config, device=device, backend=backend)
    return config, ws


def _resolve_form(ws, fused_gate_up: bool | None) -> tuple[bool, str]:
    """(fused, path): the fused gate/up form where the workspace runs the megakernel unless
    told otherwise; separate gate and up weights take stage 1 there (CudaBackend.forward)."""
    path = backend_path(ws)
    fused = path.endswith("/megakernel") if fused_gate_up is None else fused_gate_up
    if not fused and path.endswith("/megakernel"):
        path = path.removesuffix("/megakernel") + "/stage1"
    return fused, path


def repeat_passes(num_passes: int, *, device: str = "cuda", backend: str = "cuda",
                  warmup: int = 10, seed: int = 0, cuda_forward: str | None = None,
                  fused_gate_up: bool | None = None, shape: dict | None = None) -> dict:  # fmt: skip
    """``num_passes`` forward + backward passes of one random problem (``PASS_SHAPE``, with the
    keys of ``shape`` replaced; bfloat16 on CUDA, float32 on CPU) on one workspace, each
    compared bitwise with the first.

    cuda_forward: MoKConfig.cuda_forward (None: its default, what a training run gets);
    fused_gate_up: the routed gate/up weights as one interleaved ``[E, 2I, H]`` tensor
    (MoKExperts' form, which the megakernel needs); None: where the workspace runs the
    megakernel. The comparison stays on the device (one flag per pass, read at the end) and
    memory is read after every pass. Returns figures: mismatching passes, the first one, the
    memory readings after the warm-up (``warmup`` passes) and at the end, the time.
    """
    _check_counts(num_passes, warmup, "num_passes")
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    s = {**PASS_SHAPE, **(shape or {})}
    problem = random_moe_problem([s["tokens"]], s["hidden"], s["inter"], s["experts"], s["topk"],
                                 shared_inter=s["shared"], seed=seed)  # fmt: skip
    config, ws = _pass_workspace(problem, device=device, backend=backend, dtype=dtype,
                                 cuda_forward=cuda_forward)  # fmt: skip
    fused, path = _resolve_form(ws, fused_gate_up)
    inp = _pass_inputs(problem, ws.device, dtype, fused, seed)
    gc.collect()  # earlier garbage freed now, not in the middle of the passes
    mismatch = torch.zeros(num_passes, dtype=torch.bool, device=ws.device)
    samples, start = [], time.perf_counter()
    first = _one_pass(config, ws, inp)
    first_finite = _all_finite(first)
    samples.append(memory_sample(ws.device))
    for i in range(1, num_passes):
        mismatch[i] = _differs(first, _one_pass(config, ws, inp))
        ws.monitor.poll()  # never blocks: raises for what earlier passes' flags brought back
        samples.append(memory_sample(ws.device))
    F.check_errors(ws)  # waits for the device: every pass's error flags
    seconds = time.perf_counter() - start
    bad = mismatch.nonzero().flatten().tolist()
    record = {
        "kind": "repeat_passes", "passes": num_passes, "warmup": warmup, "device": str(ws.device),
        "backend": ws.backend.name, "path": path, "cuda_forward": config.cuda_forward,
        "gate_up": "fused" if fused else "split", "dtype": str(dtype).removeprefix("torch."),
        "shape": s, "seed": seed, "first_pass_finite": bool(first_finite),
        "mismatching_passes": len(bad), "first_mismatch": bad[0] if bad else None,
        "memory_kind": samples[0].kind,
        **_memory_figures([m.bytes for m in samples], warmup),
        "seconds": seconds, "seconds_per_pass": seconds / num_passes,
    }  # fmt: skip
    if samples[0].allocated_bytes is not None:
        record.update(_memory_figures([m.allocated_bytes for m in samples], warmup, "allocated"))
    return record


# ---------------------------------------------------------------------------- training runs
def _train_rank(rank: int, world: int, run) -> dict:
    """One rank of ``train_steps``: MoK's dispatcher, no progress bar."""
    from mok_megatron.megatron.training import train

    del rank, world
    result = train(run, "mok", progress=False)
    return dataclasses.asdict(result)


def train_steps(config_path: str, steps: int, *, warmup: int = 20) -> dict:
    """Train the YAML run ``config_path`` for ``steps`` steps with MoK's dispatcher on its world
    of spawned ranks (NCCL on CUDA, gloo on CPU). Returns figures: whether every loss is
    finite, the first and final loss, each rank's memory after ``warmup`` steps and at the end,
    the time; and rank 0's losses and memory readings, step by step."""
    from mok_megatron.megatron.training import replace_training
    from mok_megatron.megatron.yaml_config import load_run_config

    from .spawn import run_ranks

    _check_counts(steps, warmup, "steps")
    run = replace_training(load_run_config(config_path), train_iters=steps)
    world, device = run.parallelism.world_size(), run.training.resolved_device()
    start = time.perf_counter()
    with _gpus_hidden(device == "cpu"):
        per_rank = run_ranks(
            _train_rank, world, run, backend="nccl" if device == "cuda" else "gloo"
        )
    seconds = time.perf_counter() - start
    losses = per_rank[0]["losses"]
    figures = [_memory_figures(r["memory_bytes"], warmup) for r in per_rank]
    record = {
        "kind": "train_steps", "config": str(config_path), "steps": steps, "warmup": warmup,
        "world": world, "device": device,
        "all_losses_finite": all(math.isfinite(x) for r in per_rank for x in r["losses"]),
        "first_loss": losses[0], "final_loss": losses[-1],
        "memory_kind": per_rank[0]["memory_kind"],
        **{key: [f[key] for f in figures] for key in figures[0]},
        "train_seconds": [r["seconds"] for r in per_rank], "seconds": seconds,
        "losses": losses, "memory_bytes": per_rank[0]["memory_bytes"],
    }  # fmt: skip
    if per_rank[0]["memory_allocated_bytes"]:
        allocated = [_memory_figures(r["memory_allocated_bytes"], warmup, "allocated")
                     for r in per_rank]  # fmt: skip
        record.update({key: [f[key] for f in allocated] for key in allocated[0]})
    return record


def _gpus_hidden(hide: bool):
    """A CPU config's ranks see no GPU, as on a CPU machine (the spawned ranks read
    CUDA_VISIBLE_DEVICES when they start): Megatron's CPU path (``megatron.cpu_shim``) stands in
    for torch.cuda only where CUDA is unavailable, and a GPU machine's demo trains the GPU config."""
    if not hide:
        return contextlib.nullcontext()
    return mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": ""})


# ---------------------------------------------------------------------------------- checks
def _memory_failures(record: dict) -> list[str]:
    """CUDA: the reserved bytes flat from the warm-up on (their spread within the bound); CPU:
    the RSS growth over the second half of the run within the bound (see the bounds)."""
    cuda = record["memory_kind"] == "cuda_reserved"
    key = "memory_spread_bytes" if cuda else "memory_tail_drift_bytes"
    bound = CUDA_RESERVED_SPREAD_BOUND if cuda else CPU_RSS_TAIL_DRIFT_BOUND
    values = record[key] if isinstance(record[key], list) else [record[key]]
    return [f"{record['memory_kind']} {key}={value} after the warm-up on rank {rank} (bound "
            f"{bound})" for rank, value in enumerate(values) if value > bound]  # fmt: skip


def failures(record: dict) -> list[str]:
    """The rules a ``repeat_passes`` or ``train_steps`` record breaks (empty: it passed):
    passes bitwise equal to a finite first pass; finite losses that fell; memory within
    ``CUDA_RESERVED_SPREAD_BOUND`` or ``CPU_RSS_TAIL_DRIFT_BOUND`` (``_memory_failures``)."""
    bad = []
    if record["kind"] == "repeat_passes":
        if not record["first_pass_finite"]:
            bad.append("the first pass has a NaN or Inf")
        if record["mismatching_passes"]:
            bad.append(f"{record['mismatching_passes']} passes differ from the first (the "
                       f"earliest: pass {record['first_mismatch']}, 0-based)")  # fmt: skip
    elif not record["all_losses_finite"]:
        bad.append("a loss is NaN or Inf")
    elif not record["final_loss"] < record["first_loss"]:
        bad.append(f"the loss did not fall: {record['first_loss']} -> {record['final_loss']}")
    return bad + _memory_failures(record)
