"""Capacity and skew on the CUDA backend (issue 17, item 5; the reference backend's half is
tests/cpu/test_skew_sweep.py): routing swept from uniform to every token's first slot on one
expert, at the default knobs, at EP 1 and on 2 and 4 virtual ranks: stage 1 (the default cuda_forward)
with the separate and the fused gate/up weights, and the megakernel (cuda_forward="megakernel",
every other knob at its default).

Each point either runs, and then every token's output and input gradient is the float64
oracle's within bf16 tolerance token by token (a dropped row would be that token's whole
contribution), or raises MoKCapacityError on every rank naming the knob; and the peak memory of
a pass (a second, unpoisoned one: the poisoning itself fills free memory) above what was
allocated before it does not grow with the skew (the workspace and its saved rows are sized by
the knobs, not by the routing). At EP 1 every point runs (a multiplier >= the EP size never
overflows); on 4 virtual ranks both outcomes occur (asserted); on 2 whatever occurs is checked."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_cuda_backend import Run, VirtualRuns, _check_accuracy, _problem, _virtual_failures

from mok_megatron import functional as F
from mok_megatron.testing.runs import global_d_out, run_oracle

pytestmark = pytest.mark.gpu

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)  # of each rank's tokens whose first slot is expert 0
TOKENS = 192
SHAPE = (128, 64, 8, 2, 0)  # hidden, inter, experts, top-k, shared
#: A token's output or input gradient off the oracle by more than this (relative to the token's
#: own norm) is a failure; bf16 gives ~1e-2, a dropped row of a top-2 token ~0.5 or more.
PER_TOKEN_REL = 0.1
#: Allowed growth of a pass's peak memory over the uniform point's (allocator rounding).
PEAK_SLACK_BYTES = 2 << 20


def _skewed(world: int, fraction: float, seed: int):
    problem = _problem([TOKENS] * world, SHAPE, seed=seed)
    topk = problem.topk_experts.clone()
    for start in range(0, topk.shape[0], TOKENS):
        rows = slice(start, start + int(round(fraction * TOKENS)))
        topk[rows, 1] = torch.where(topk[rows, 1] == 0, 1, topk[rows, 1])  # keep slots distinct
        topk[rows, 0] = 0
    return dataclasses.replace(problem, topk_experts=topk)


def _per_token_failures(problem, results) -> list[str]:
    oracle = run_oracle(problem, global_d_out(problem, 0))
    failures = []
    for name in ("out", "d_x"):
        got = torch.cat([r[name].float().cpu() for r in results]).double()
        want = oracle[name]
        rel = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-30)
        bad = (rel > PER_TOKEN_REL).nonzero().flatten().tolist()
        if bad:
            failures.append(f"{name}: tokens {bad[:8]} off the oracle (rel {rel.max():.2e})")
    return failures


#: name: (the weight form of test_cuda_backend's runs, the config's cuda_forward)
PATHS = {"stage1-split": ("split", "stage1"), "stage1-fused": ("fused_auto", "stage1"),
         "megakernel": ("fused_auto", "megakernel")}  # fmt: skip


def _capacity_errors(workspaces) -> list[str | None]:
    """Each rank's MoKCapacityError message (None: no error) of the passes so far (cleared)."""
    errors = []
    for ws in workspaces:
        try:
            ws.check_errors()
            errors.append(None)
        except F.MoKCapacityError as exc:
            errors.append(str(exc))
    return errors


def _point(world: int, path: str, problem):
    """('ran' | 'raised', peak bytes of a pass above the memory allocated before it, failures)."""
    form, cuda_forward = PATHS[path]
    config = F.MoKConfig(cuda_forward=cuda_forward)
    if world == 1:
        run = Run(problem, "cuda", config=config, form=form)
        workspaces = [run.ws]
    else:
        vruns = VirtualRuns(problem, world, config=config, form=form)
        workspaces = vruns.workspaces
    # the checked pass, outputs poisoned; its errors are read (and cleared) before the next
    if world == 1:  # (EP 1 never overflows: the poisoned pass checks its errors itself)
        results = [run()[1]]
    else:
        scheds, results = vruns(check_errors=False)
    errors = _capacity_errors(workspaces)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    if world == 1:  # the measured pass: the same again, unpoisoned
        run.passes(run.schedule())
    else:
        vruns.passes(vruns.schedules())
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    again = _capacity_errors(workspaces)
    if [e is None for e in again] != [e is None for e in errors]:
        return "?", peak, [f"the same routing raised {errors} once and {again} the next time"]
    if any(errors):
        ok = all(e and "schedule_capacity_multiplier" in e for e in errors)
        return "raised", peak, [] if ok else [f"not every rank raised naming the knob: {errors}"]
    if world == 1:
        failures = _check_accuracy(problem, results[0])
    else:
        failures = _virtual_failures(problem, vruns, scheds, results)
    return "ran", peak, failures + _per_token_failures(problem, results)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("world", [1, 2, 4])
def test_skew_sweep_runs_exactly_or_raises_naming_the_knob_in_the_same_memory(
    world, path, record_property
):
    outcomes, peaks, failures = [], [], []
    for i, fraction in enumerate(FRACTIONS):
        outcome, peak, point_failures = _point(world, path, _skewed(world, fraction, seed=i))
        outcomes.append(outcome)
        peaks.append(peak)
        failures += [f"fraction {fraction}: {f}" for f in point_failures]
    record_property("outcomes", ",".join(outcomes))
    record_property("peak_bytes", ",".join(map(str, peaks)))
    assert not failures, failures
    assert max(peaks) <= peaks[0] + PEAK_SLACK_BYTES, peaks
    if world == 1:  # a multiplier >= the EP size never overflows
        assert outcomes == ["ran"] * len(FRACTIONS), outcomes
    if world == 4:  # every first slot on rank 0 is 4 ranks' load: over 2x a balanced one
        assert outcomes[0] == "ran" and outcomes[-1] == "raised", outcomes
