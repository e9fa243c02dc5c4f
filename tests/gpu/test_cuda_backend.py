"""The CUDA backend (stage 1) against the reference backend and a dense float64 oracle.

One GPU (``-m "gpu and not multigpu"``): EP = 1, no process group. Two GPUs (``-m multigpu``):
run under ``torchrun --standalone --nproc-per-node 2 -m pytest -m multigpu``; the module makes
the NCCL process group from torchrun's environment.

Virtual ranks (``F.create_virtual_workspaces``, MEGAKERNEL.md): W = 2 and 4 ranks of one process
on one GPU, each rank's pass on its own stream, so the cross-rank protocol (pulls, pushes,
barriers, capacity overflow) is tested on one GPU too.

Tolerances (DESIGN.md): relative error against float64 < 1e-2 and no worse than twice PyTorch's
own bf16 pipeline on the same inputs (plus 1e-3 for tiny tensors); NaN never passes. Outputs are
poisoned before every run in their own dtype and size class (``testing.poison``: every allocation
of the pass comes from a pool filled with a pattern that is NaN in every float dtype and
impossible in every integer one, and each output is checked to come from it), and the symmetric
workspace's data regions hold the same pattern (its guards are checked after overflow).
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from mok_megatron import functional as F
from mok_megatron.functional.schedule import build_schedule_from_global
from mok_megatron.functional.workspace import MoKCapacityError
from mok_megatron.ops import deinterleave_gate_up, interleave_gate_up
from mok_megatron.testing import dense_moe, random_moe_problem, relative_error
from mok_megatron.testing.poison import assert_fully_written, poison_, poisoned_memory
from mok_megatron.testing.runs import GRAD_NAMES, global_d_out, run_oracle
from mok_megatron.testing.virtual import rank_streams, run_ranks

# Generous device-wait budget (MoKConfig.wait_timeout_ms): ranks also do CPU-side oracle work
# between passes.
WAIT_TIMEOUT_MS = 60_000
# NOTE: virtual ranks wait for each other on one GPU: a protocol bug shows as a timeout, not as a
# minute-long hang (the 2-GPU tests keep their longer budget)
VIRTUAL_TIMEOUT_MS = 10_000

PER_TOKEN = ("out", "d_x", "d_router_weights")
ROUTED = ("d_w_routed_gate", "d_w_routed_up", "d_w_routed_down")
SHARED = ("d_w_shared_gate", "d_w_shared_up", "d_w_shared_down")

#: Routed-weight forms: separate gate and up; the fused interleaved gate_up (MoKExperts' form)
#: with every engine step (MoKConfig.expert_gemm='engine'), on torch._grouped_mm only ('torch'),
#: and with the default choice ('auto').
FORMS = ("split", "fused", "fused_torch")
EXPERT_GEMM = {"fused": "engine", "fused_torch": "torch", "fused_auto": "auto"}


def cuda_config(config, form="split", wait_timeout_ms=WAIT_TIMEOUT_MS):
    """``config`` (None: the defaults) as the CUDA runs of these tests take it: the expert GEMMs
    of ``form`` and the tests' device-wait budget."""
    return dataclasses.replace(config or F.MoKConfig(), expert_gemm=EXPERT_GEMM.get(form, "auto"),
                               wait_timeout_ms=wait_timeout_ms)  # fmt: skip


# Scaled-down benchmark shapes: (hidden, inter, experts, topk, shared_inter).
SHAPES = {
    "qwen3-30b-a3b": (256, 96, 32, 8, 0),
    "deepseek-v3": (448, 128, 32, 8, 128),
    "mixtral-8x7b": (512, 896, 8, 2, 0),
}


# --------------------------------------------------------------------------------- fixtures
def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@pytest.fixture(scope="module")
def dist_group():
    """NCCL over torchrun's ranks (multigpu tests only)."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        pytest.skip("run under torchrun --nproc-per-node 2")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if not dist.is_initialized():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", timeout=timedelta(seconds=120))
    yield dist.group.WORLD
    F.clear_workspace_cache()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


#: The symmetric workspace's data regions (poisoned before a run); the counters region keeps the
#: epochs and flags the megakernel carries from pass to pass.
DATA_REGIONS = ("routing_topk", "routing_weights", "tokens", "combine", "slot_values", "slot_rows")


def _poison_workspace(*workspaces) -> None:
    """The poison pattern in every data region of each workspace; guards refilled."""
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    for ws in workspaces:
        if ws.buffers is None:
            continue
        for name in DATA_REGIONS:
            region = ws.buffers.region(name)
            if region.numel():
                poison_(region)
        ws.buffers.fill_guards()
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()


def _assert_outputs_poisoned(mem, ws, sched, result) -> None:
    """Every output (and, on the CUDA backend, every schedule tensor) came from poisoned memory."""
    outputs = {k: v for k, v in result.items() if isinstance(v, torch.Tensor)}
    if ws.backend.name == "cuda":
        outputs.update({f"sched.{f}": getattr(sched, f) for f in sched.INTEGER_FIELDS})
    mem.assert_covers(**outputs)


# ------------------------------------------------------------------------------------ runs
class Run:
    """One rank's share of a problem on a workspace: inputs on the GPU and the pass's results.

    ``ws`` (a virtual rank's workspace) gives the rank and the workspace; by default they are
    torch.distributed's rank and a new workspace on its group."""

    def __init__(self, problem, backend, config=None, num_local_tokens=None, seed=0, form="split",
                 ws=None):  # fmt: skip
        self.rank, self.world = (ws.rank, ws.num_ranks) if ws is not None else _world()
        if ws is not None:
            config = ws.config
        elif backend == "cuda":
            config = cuda_config(config, form)
        self.problem, self.config, self.form = problem, config or F.MoKConfig(), form
        x, topk, rw, routed, shared = problem.local(self.rank, torch.bfloat16, _device())
        if form != "split":
            routed = (interleave_gate_up(routed[0], routed[1]), None, routed[2])
        self.x, self.topk, self.rw, self.routed, self.shared = x, topk, rw, routed, shared
        self.weights = (*(shared or (None, None, None)), *routed)
        d_out = global_d_out(problem, seed)[problem.token_slice(self.rank)]
        self.d_out = d_out.to(_device(), torch.bfloat16).contiguous()
        self.ws = ws or F.create_workspace(
            self.config, dist.group.WORLD if dist.is_initialized() else None, device=_device(),
            num_local_tokens=num_local_tokens or max(max(problem.tokens_per_rank), 1),
            hidden_size=x.shape[1], topk=topk.shape[1], num_experts=problem.w_gate.shape[0],
            intermediate_size=problem.w_gate.shape[1],
            shared_intermediate_size=shared[0].shape[0] if shared else 0,
            dtype=torch.bfloat16, backend=backend,
        )  # fmt: skip

    def schedule(self):
        return F.build_schedule(self.ws, self.config, self.topk, self.ws.num_local_experts,
                                router_weights=self.rw)  # fmt: skip

    def passes(self, sched, accumulators=None):
        """out and every gradient; ``accumulators``: F.backward's wgrad_accumulators (the
        routed-weight gradients go into them and come back None)."""
        out, ctx = F.forward(self.config, self.ws, sched, self.x, self.rw, *self.weights)
        self.rounds = ctx.rounds.count if self.ws.backend.name == "cuda" else None
        grads = F.backward(
            self.config, self.ws, sched, ctx, self.d_out, self.x, self.rw, *self.weights,
            wgrad_accumulators=accumulators,
        )._asdict()  # fmt: skip
        if self.form != "split" and accumulators is None:  # the fused gradient, split
            assert grads["d_w_routed_up"] is None
            gate_up = grads["d_w_routed_gate"]
            grads["d_w_routed_gate"], grads["d_w_routed_up"] = deinterleave_gate_up(gate_up, -2)
        return {"out": out, **grads}

    def make_accumulators(self, kind="zeros", seed=0):
        """float32 buffers in the routed weights' form (None in the fused form's up slot):
        "zeros" or "random" (N(0, 1)); made outside any poisoned pool (they are inputs)."""
        gen = torch.Generator(device=_device()).manual_seed(seed)

        def make(w):
            if kind == "zeros":
                return torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            return torch.randn(w.shape, generator=gen, dtype=torch.float32, device=w.device)

        return tuple(None if w is None else make(w) for w in self.routed)

    def split_accumulators(self, buffers) -> dict:
        """Accumulators as the split routed-gradient names (fused gate_up de-interleaved)."""
        gate, up, down = buffers
        if self.form != "split":
            gate, up = deinterleave_gate_up(gate, -2)
        return dict(zip(ROUTED, (gate, up, down)))

    def __call__(self, poison=True, accumulators=None):
        if not poison:
            sched = self.schedule()
            return sched, self.passes(sched, accumulators)
        _poison_workspace(self.ws)
        # the reference backend computes in float32: its passes need a larger pool
        size = (12 if self.ws.backend.name == "reference" else 4) << 30
        with poisoned_memory(large_bytes=size) as mem:
            sched = self.schedule()
            result = self.passes(sched, accumulators)
        _assert_outputs_poisoned(mem, self.ws, sched, result)
        torch.cuda.synchronize()
        self.ws.check_errors()
        return sched, result


class VirtualRuns:
    """W virtual ranks of one problem on one GPU: one ``Run`` per rank, each on its stream."""

    def __init__(self, problem, world, config=None, num_local_tokens=None, seed=0, form="split"):
        config = cuda_config(config, form, VIRTUAL_TIMEOUT_MS)
        shared = problem.shared[0].shape[0] if problem.shared else 0
        self.workspaces = F.create_virtual_workspaces(
            config, world, device=_device(),
            num_local_tokens=num_local_tokens or max(max(problem.tokens_per_rank), 1),
            hidden_size=problem.x.shape[1], topk=problem.topk_experts.shape[1],
            num_experts=problem.w_gate.shape[0], intermediate_size=problem.w_gate.shape[1],
            shared_intermediate_size=shared, dtype=torch.bfloat16,
        )  # fmt: skip
        self.runs = [Run(problem, "cuda", config, seed=seed, form=form, ws=ws)
                     for ws in self.workspaces]  # fmt: skip
        self.streams = rank_streams(world)

    def schedules(self):
        return run_ranks(lambda r: self.runs[r].schedule(), self.streams)

    def passes(self, scheds, accumulators=None):
        acc = accumulators or [None] * len(self.runs)
        return run_ranks(lambda r: self.runs[r].passes(scheds[r], acc[r]), self.streams)

    def __call__(self, check_errors=True, accumulators=None):
        """(schedules, results) of one poisoned pass on every rank; ``accumulators``: one
        wgrad_accumulators tuple per rank, or None."""
        _poison_workspace(*self.workspaces)
        with poisoned_memory(streams=self.streams) as mem:
            scheds = self.schedules()
            results = self.passes(scheds, accumulators)
        for ws, sched, result in zip(self.workspaces, scheds, results):
            _assert_outputs_poisoned(mem, ws, sched, result)
        torch.cuda.synchronize()
        if check_errors:
            for ws in self.workspaces:
                ws.check_errors()
        return scheds, results


def _torch_bf16(problem, d_out64: torch.Tensor) -> dict:
    """PyTorch's own bf16 pipeline (dense, autograd) on the same inputs, on the GPU."""
    dev = _device()
    leaves = [problem.x, problem.router_weights, problem.w_gate, problem.w_up, problem.w_down]
    leaves += list(problem.shared or ())
    leaves = [t.to(dev, torch.bfloat16).requires_grad_() for t in leaves]
    shared = tuple(leaves[5:]) if problem.shared else None
    out = dense_moe(leaves[0], problem.topk_experts.to(dev), leaves[1], *leaves[2:5], shared=shared)
    out.backward(d_out64.to(dev, torch.bfloat16))
    grads = [leaf.grad for leaf in leaves] + [None] * (8 - len(leaves))
    return {"out": out.detach(), **dict(zip(GRAD_NAMES, grads))}


def _local_slice(problem, name: str, rank: int, value: torch.Tensor | None):
    """The part of a global (oracle) tensor that rank ``rank`` returns."""
    if value is None:
        return None
    if name in PER_TOKEN:
        return value[problem.token_slice(rank)]
    if name in ROUTED:
        return value[problem.expert_slice(rank)]
    return value


def _summed_shared(result: dict) -> dict:
    """Shared-expert gradients cover local tokens: sum them over ranks for the global check."""
    out = dict(result)
    for name in SHARED:
        if out.get(name) is not None and dist.is_initialized():
            total = out[name].float()
            dist.all_reduce(total)
            out[name] = total
    return out


def _check_accuracy(problem, result: dict, seed=0, oracle_device="cpu", rank=None) -> list[str]:
    """Every output against float64 and PyTorch bf16; returns failure messages (empty = pass).
    ``rank``: a virtual rank (whose shared-weight gradients the caller summed over ranks)."""
    d_out64 = global_d_out(problem, seed).to(oracle_device)
    oracle = run_oracle(problem.to(oracle_device), d_out64)
    torch_bf16 = _torch_bf16(problem, d_out64)
    if rank is None:
        rank, _ = _world()
        result = _summed_shared(result)
    failures = []
    for name in ("out", *GRAD_NAMES):
        got = result.get(name)
        want = _local_slice(problem, name, rank, oracle[name])
        if want is None:
            if got is not None:
                failures.append(f"{name}: expected None")
            continue
        if want.numel() == 0:
            if got.numel() != 0:
                failures.append(f"{name}: expected empty, got {tuple(got.shape)}")
            continue
        base = _local_slice(problem, name, rank, torch_bf16[name])
        err = relative_error(got.to(want.device), want)
        err_torch = relative_error(base.to(want.device), want)
        if not (err < 1e-2 and err <= 2 * err_torch + 1e-3):
            failures.append(f"{name}: rel err {err:.3e} (torch bf16 {err_torch:.3e})")
    return failures


def _assert_schedule_equal(sched, problem, ws) -> None:
    """Every integer field bitwise equal to build_schedule_from_global on the same routing
    (bool fields compared as bytes, so a poisoned byte that is neither 0 nor 1 shows)."""
    t_max = ws.num_local_tokens
    padded = torch.full((ws.num_ranks, t_max, ws.topk), -1, dtype=torch.int64)
    for r in range(ws.num_ranks):
        part = problem.topk_experts[problem.token_slice(r)]
        padded[r, : part.shape[0]] = part
    expected = build_schedule_from_global(
        padded, rank=ws.rank, num_tokens=sched.num_tokens, num_experts=ws.num_experts,
        num_local_experts=ws.num_local_experts, row_capacity=ws.row_capacity,
        token_capacity=ws.token_capacity,
    )  # fmt: skip
    for name in sched.INTEGER_FIELDS:
        got, want = getattr(sched, name).cpu(), getattr(expected, name)
        assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        if got.dtype == torch.bool:
            got, want = got.view(torch.uint8), want.view(torch.uint8)
        assert torch.equal(got, want), f"{name} differs:\n{got}\n{want}"


def _bitwise_equal(a: dict, b: dict) -> list[str]:
    bad = []
    for name, v in a.items():
        if v is None:
            continue
        if not torch.equal(
            v.view(torch.uint8) if v.dtype != torch.bool else v,
            b[name].view(torch.uint8) if v.dtype != torch.bool else b[name],
        ):
            bad.append(name)
    return bad


def _assert_repeats_bitwise(run, first: dict, repeats: int) -> None:
    """Run ``repeats`` more passes (inputs re-poisoned each time); each must equal ``first``."""
    who = f"rank {dist.get_rank()}: " if dist.is_initialized() else ""
    for i in range(repeats):
        _, again = run()
        bad = _bitwise_equal(first, again)
        assert not bad, f"{who}run {i + 2} differs from run 1 in {bad}"


def _problem(tokens, shape, seed, **kw):
    hidden, inter, experts, topk, shared = shape
    kw.setdefault("shared_inter", shared)
    return random_moe_problem(tokens, hidden, inter, experts, topk, seed=seed, **kw)


# ========================================================================== one GPU (EP = 1)
def _check_against_reference(problem, got, config=None, form="split") -> list[str]:
    _, ref = Run(problem, "reference", config=config, form=form)()
    failures = []
    for name in ("out", *GRAD_NAMES):
        if ref[name] is not None and ref[name].numel():
            err = relative_error(got[name].float(), ref[name].float())
            if not err < 1e-2:
                failures.append(f"{name}: vs reference rel err {err:.3e}")
    return failures


def _schedule_failures(sched, problem, ws) -> list[str]:
    try:
        _assert_schedule_equal(sched, problem, ws)
    except AssertionError as exc:
        return [f"schedule: {str(exc)[:2000]}"]
    return []


@pytest.mark.gpu
@pytest.mark.parametrize("form", [*FORMS, "fused_auto"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_shapes_match_oracle_and_reference(shape, form):
    problem = _problem([300], SHAPES[shape], seed=11)
    run = Run(problem, "cuda", form=form)
    sched, got = run()
    failures = _schedule_failures(sched, problem, run.ws)
    failures += _check_accuracy(problem, got)
    failures += _check_against_reference(problem, got, form=form)
    assert not failures, failures


EDGE_CASES = {
    # name: (tokens, (hidden, inter, experts, topk, shared), problem kwargs, num_local_tokens)
    "topk1": ([77], (128, 64, 8, 1, 0), {}, None),
    "topk8_shared": ([129], (128, 64, 16, 8, 64), {}, None),
    "empty_slots": ([100], (128, 64, 8, 4, 0), {"empty_slot_fraction": 0.3}, None),
    "experts_without_tokens": ([5], (128, 64, 64, 2, 0), {}, None),
    "all_to_one_expert": ([150], (128, 64, 8, 2, 0), {"routing": "one_expert"}, None),
    "skewed": ([257], (256, 128, 16, 4, 0), {"routing": "skewed"}, None),
    "fewer_tokens_than_workspace": ([33], (128, 64, 8, 2, 32), {}, 200),
    "one_token": ([1], (128, 64, 8, 2, 0), {}, None),
}


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["split", "fused"])
@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_edge_cases(case, form):
    tokens, shape, kwargs, t_max = EDGE_CASES[case]
    problem = _problem(tokens, shape, seed=5, **kwargs)
    run = Run(problem, "cuda", num_local_tokens=t_max, form=form)
    sched, got = run()
    _assert_schedule_equal(sched, problem, run.ws)
    failures = _check_accuracy(problem, got)
    assert not failures, failures


# Routings the schedule tests run, with the fraction of slots set to -1.
SCHEDULE_ROUTINGS = (("uniform", 0.0), ("skewed", 0.2), ("one_expert", 0.0))


def _check_schedule(tokens, shape, seed, routing, empty, **run_kw) -> None:
    """The device schedule from poisoned memory equals the Python one, every output written."""
    problem = _problem(tokens, shape, seed=seed, routing=routing, empty_slot_fraction=empty)
    run = Run(problem, "cuda", **run_kw)
    _poison_workspace(run.ws)
    with poisoned_memory() as mem:
        sched = run.schedule().ensure_built()  # the megakernel path's is lazy
    _assert_outputs_poisoned(mem, run.ws, sched, {})
    _assert_schedule_equal(sched, problem, run.ws)


@pytest.mark.gpu
def test_schedule_bitwise_many_routings():
    for seed in range(6):
        for routing, empty in SCHEDULE_ROUTINGS:
            _check_schedule([173], (64, 32, 24, 3, 0), seed, routing, empty, num_local_tokens=190)


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [96, 128, 256, 1100])
def test_schedule_bitwise_many_experts_and_chunks(experts):
    # scan_chunks splits the chunks between groups of threads as wide as E_l in whole warps: 96
    # experts give 10 groups (and idle threads), 128 and 256 the benchmark shapes' 8 and 4, 1100
    # one group in two passes of 1024 experts; 2048 tokens of top-8 are 64 chunks of slots.
    for seed, (routing, empty) in enumerate(SCHEDULE_ROUTINGS):
        _check_schedule([2048], (64, 32, experts, 8, 0), seed, routing, empty)


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
def test_bitwise_repeatable_over_10_runs(form):
    problem = _problem([211], SHAPES["deepseek-v3"], seed=3)
    run = Run(problem, "cuda", form=form)
    _, first = run()
    _assert_repeats_bitwise(run, first, 9)


def _graph_check(run: Run) -> None:
    sched, eager = run()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on the capture stream
        run.passes(sched)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run.passes(sched)
    for _ in range(3):
        for v in captured.values():
            if v is not None and v.is_floating_point():
                v.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        bad = _bitwise_equal(eager, captured)
        assert not bad, f"graph replay differs from eager in {bad}"


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
def test_cuda_graph_replay_matches_eager(form):
    problem = _problem([190], SHAPES["qwen3-30b-a3b"], seed=8, shared_inter=64)
    _graph_check(Run(problem, "cuda", form=form))


def _no_sync_check(run: Run) -> None:
    run()  # warm up (lazy initialisation may sync)
    torch.cuda.set_sync_debug_mode("error")
    try:
        sched = run.schedule()
        run.passes(sched)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    run.ws.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
def test_no_host_sync(form):
    _no_sync_check(Run(_problem([128], SHAPES["mixtral-8x7b"], seed=4), "cuda", form=form))


@pytest.mark.gpu
def test_bad_expert_id_raises_at_next_check():
    problem = _problem([40], (64, 32, 8, 2, 0), seed=2)
    problem.topk_experts[3, 1] = 8  # == num_experts: out of range
    run = Run(problem, "cuda")
    run.schedule().ensure_built()
    with pytest.raises(ValueError, match="outside"):
        run.ws.check_errors()


@pytest.mark.gpu
def test_workspace_bytes_matches_allocation():
    problem = _problem([64], (128, 64, 8, 2, 0), seed=1)
    run = Run(problem, "cuda")
    expected = F.workspace_bytes(
        run.config, num_ranks=1, num_local_tokens=64, hidden_size=128, topk=2, num_experts=8,
        intermediate_size=64, backend="cuda",
    )  # fmt: skip
    assert run.ws.buffers.buffer.numel() == expected
    mega = F.MoKConfig(cuda_forward="megakernel")  # + the slot_rows and counters regions
    run = Run(problem, "cuda", config=mega)
    expected = F.workspace_bytes(
        mega, num_ranks=1, num_local_tokens=64, hidden_size=128, topk=2, num_experts=8,
        intermediate_size=64, backend="cuda",
    )  # fmt: skip
    assert run.ws.buffers.buffer.numel() == expected > run.ws.buffers.layout.offsets["slot_rows"]


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["split", "fused"])
def test_full_width_qwen3(form):
    """Qwen3-30B-A3B's hidden / intermediate / top-k at 2000 tokens (64 experts)."""
    problem = _problem([2000], (2048, 768, 64, 8, 0), seed=17)
    run = Run(problem, "cuda", form=form)
    sched, got = run()
    failures = _schedule_failures(sched, problem, run.ws)
    failures += _check_accuracy(problem, got, oracle_device=_device())
    failures += _check_against_reference(problem, got, form=form)
    assert not failures, failures


# ------------------------------------------------------------------------ macrobatch rounds
#: Rounds of 256 rows: every case below runs in several rounds (asserted).
ROUNDS = F.MoKConfig(minibatch_size=128, macrobatch_size=256)

ROUND_CASES = {
    # name: (tokens, (hidden, inter, experts, topk, shared), problem kwargs)
    "qwen3-30b-a3b": ([300], SHAPES["qwen3-30b-a3b"], {}),
    "deepseek-v3_shared": ([211], SHAPES["deepseek-v3"], {}),
    "mixtral-8x7b": ([190], SHAPES["mixtral-8x7b"], {}),
    "all_to_one_expert_topk1": ([700], (128, 64, 8, 1, 0), {"routing": "one_expert"}),
    "experts_without_tokens": ([300], (128, 64, 256, 2, 0), {}),  # ~10% of experts empty
    "empty_slots_skewed": ([333], (256, 128, 16, 4, 0),
                           {"routing": "skewed", "empty_slot_fraction": 0.3}),
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", list(ROUND_CASES))
def test_macrobatch_rounds_match_oracle_and_reference(case, form):
    tokens, shape, kwargs = ROUND_CASES[case]
    problem = _problem(tokens, shape, seed=23, **kwargs)
    run = Run(problem, "cuda", config=ROUNDS, form=form)
    sched, got = run()
    assert run.rounds > 1, f"{case}: expected several rounds, got {run.rounds}"
    failures = _schedule_failures(sched, problem, run.ws)
    failures += _check_accuracy(problem, got)
    failures += _check_against_reference(problem, got, ROUNDS, form=form)
    assert not failures, failures


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["split", "fused"])
def test_macrobatch_rounds_bitwise_repeatable_and_graph_safe(form):
    problem = _problem([260], SHAPES["deepseek-v3"], seed=29)
    run = Run(problem, "cuda", config=ROUNDS, form=form)
    _, first = run()
    assert run.rounds > 1
    _assert_repeats_bitwise(run, first, 4)
    _graph_check(run)
    _no_sync_check(run)


def _saved_bytes(run: Run) -> int:
    """Device memory the forward leaves allocated (its output and its backward context)."""
    sched = run.schedule()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out, ctx = F.forward(run.config, run.ws, sched, run.x, run.rw, *run.weights)
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - before
    del out, ctx
    return saved


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["split", "fused"])
def test_macrobatch_rounds_bound_saved_memory(form):
    """Qwen3 widths, 2000 tokens: one round keeps gate|up and act for every routed row, y only
    for the engine's fused L2 dgrad + dSwiGLU ('fused' form), and not the routed rows (the
    backward dispatches x again: test_forward_keeps_neither_the_rows_nor_y_unless_read); rounds
    of 2048 rows keep only the received tokens (the rows are recomputed)."""
    problem = _problem([2000], (2048, 768, 64, 8, 0), seed=31)
    one = Run(problem, "cuda", form=form)
    rounds = Run(problem, "cuda", config=F.MoKConfig(macrobatch_size=2048), form=form)
    one_bytes, rounds_bytes = _saved_bytes(one), _saved_bytes(rounds)
    rows = one.ws.row_capacity
    per_row = 2 * (2 * 768 + 768 + (2048 if form == "fused" else 0))  # gu, a, y
    assert one_bytes >= rows * per_row, (one_bytes, rows * per_row)
    # what else stays (the output, the plan) is far below half of a [rows, H] bf16 tensor
    assert one_bytes < rows * (per_row + 2048), (one_bytes, "x_rows [rows, H] kept?")
    tokens_bytes = 2000 * 2048 * 2
    assert rounds_bytes < 3 * tokens_bytes, (rounds_bytes, one_bytes)
    _, got = rounds()
    assert rounds.rounds == 8
    failures = _check_accuracy(problem, got, oracle_device=_device())
    assert not failures, failures


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", [(128, 64, 16, 4, 0), (128, 256, 16, 4, 0), (128, 64, 16, 1, 0)],
                         ids=["inter<hidden", "inter>hidden", "top1"])  # fmt: skip
def test_forward_keeps_neither_the_rows_nor_y_unless_read(form, shape):
    """A one-round forward keeps the L2 output rows y only where the backward reads them
    (Experts.backward_reads_y: the engine's L2 dgrad with the SwiGLU backward fused, which the
    'fused' form runs; elsewhere the router-weight gradient is <d_rows @ W_down, a>), and never
    the routed rows x_rows or the received tokens: the backward dispatches x again and gathers
    them. Every output and gradient matches the float64 oracle; a second backward on the same
    context (F.backward leaves it as it was) gives the same bits."""
    problem = _problem([300], shape, seed=13)
    run = Run(problem, "cuda", form=form)
    sched = run.schedule()
    _, ctx = F.forward(run.config, run.ws, sched, run.x, run.rw, *run.weights)
    assert ctx.rounds.count == 1
    assert (ctx.saved.y is not None) == (form == "fused")
    assert ctx.saved.x_rows is None and ctx.x_recv is None
    first, again = (
        F.backward(run.config, run.ws, sched, ctx, run.d_out, run.x, run.rw, *run.weights)
        for _ in range(2)
    )
    for name, a in first._asdict().items():
        b = getattr(again, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    del ctx
    _, got = run()
    failures = _check_accuracy(problem, got, oracle_device=_device())
    assert not failures, failures


_TIMEOUT_SCRIPT = """
import os, sys, time, torch, torch.distributed as dist
from mok_megatron import functional as F
from mok_megatron.ops import moe
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
ws = F.create_workspace(F.MoKConfig(wait_timeout_ms=1500), dist.group.WORLD, device="cuda",
                        num_local_tokens=16,
                        hidden_size=64, topk=2, num_experts=4, intermediate_size=32,
                        backend="cuda")
if rank == 1:  # never enters the dispatch barrier
    time.sleep(10)
    os._exit(0)
x = torch.zeros(16, 64, dtype=torch.bfloat16, device="cuda")
src = torch.full((ws.token_capacity,), -1, dtype=torch.int64, device="cuda")
moe.moe_dispatch(x, src, ws.buffers.comm)
try:
    torch.cuda.synchronize()
    print("NO-TIMEOUT", flush=True)
except Exception as exc:
    print("LAUNCH-FAILED", type(exc).__name__, exc, flush=True)
os._exit(3)
"""


@pytest.mark.gpu
def test_device_wait_times_out_with_rank_phase_and_flag(tmp_path):
    """A peer that never arrives: the wait gives up after MoKConfig.wait_timeout_ms, says who and
    where (device printf), and the launch fails instead of hanging."""
    import subprocess
    import sys

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (run in a child torchrun)")
    script = tmp_path / "timeout_script.py"
    script.write_text(_TIMEOUT_SCRIPT)
    env = dict(os.environ, TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NCCL_NVLS_ENABLE="0",
               PYTHONUNBUFFERED="1")  # fmt: skip
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    output = proc.stdout + proc.stderr
    assert "LAUNCH-FAILED" in output, output[-4000:]
    assert "mok: rank 0 timed out after 1500 ms in phase 'dispatch/tokens staged'" in output, (
        output[-4000:]
    )
    assert "peer 1" in output, output[-4000:]


# ============================================== virtual ranks: W ranks of one process, one GPU
VIRTUAL_CASES = {
    # name: (tokens per rank, shape, problem kwargs)
    "qwen3-30b-a3b": ([256, 200], SHAPES["qwen3-30b-a3b"], {}),
    "deepseek-v3": ([200, 160], SHAPES["deepseek-v3"], {}),
    "uneven_skewed": ([97, 3], (128, 64, 8, 4, 32), {"routing": "skewed"}),
    "rank_without_tokens": ([61, 0], (128, 64, 8, 2, 0), {}),
    "all_to_one_expert": ([120, 90], (128, 64, 8, 2, 0), {"routing": "one_expert"}),
    "four_ranks": ([70, 0, 33, 81], (128, 64, 16, 4, 0), {"empty_slot_fraction": 0.2}),
}


def _virtual_run_failures(problem, vruns: VirtualRuns) -> list[str]:
    """Two passes of the virtual ranks: the first checked as ``_virtual_failures`` checks it, the
    second bitwise equal to the first, rank by rank."""
    scheds, results = vruns()
    failures = _virtual_failures(problem, vruns, scheds, results)
    _, again = vruns()
    failures += [f"repeat differs in {n}" for a, b in zip(results, again)
                 for n in _bitwise_equal(a, b)]  # fmt: skip
    return failures


def _virtual_failures(problem, vruns: VirtualRuns, scheds, results) -> list[str]:
    """Every rank's schedule and outputs against the plain-Python schedule and the oracle."""
    total = {}
    for name in SHARED:  # shared-expert gradients cover local tokens: their sum is global
        parts = [r[name] for r in results if r[name] is not None]
        total[name] = torch.stack([p.float() for p in parts]).sum(0) if parts else None
    failures = []
    for run, sched, result in zip(vruns.runs, scheds, results):
        failures += _schedule_failures(sched, problem, run.ws)
        failures += [f"rank {run.rank}: {f}" for f in
                     _check_accuracy(problem, {**result, **total}, rank=run.rank)]  # fmt: skip
    return failures


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["split", "fused"])
@pytest.mark.parametrize("case", list(VIRTUAL_CASES))
def test_virtual_ranks_match_oracle(case, form):
    tokens, shape, kwargs = VIRTUAL_CASES[case]
    problem = _problem(tokens, shape, seed=41, **kwargs)
    config = F.MoKConfig(schedule_capacity_multiplier=float(len(tokens)))  # never overflows
    vruns = VirtualRuns(problem, len(tokens), config=config, form=form)
    failures = _virtual_run_failures(problem, vruns)
    assert not failures, failures


# FP8 experts: H and I multiples of 128 (tokens per rank, shape, problem kwargs)
FP8_VIRTUAL_CASES = {
    "deepseek-v3": ([200, 160], (512, 256, 16, 8, 128), {}),
    "rank_without_tokens": ([61, 0], (128, 128, 8, 2, 0), {}),
    "four_ranks": ([70, 0, 33, 81], (256, 128, 16, 4, 0), {"empty_slot_fraction": 0.2}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(FP8_VIRTUAL_CASES))
def test_virtual_ranks_fp8_token_dispatch_equals_quantising_after_a_bf16_dispatch(
    case, monkeypatch
):
    """FP8 experts dispatch the tokens quantised at their source (packed FP8 rows over the
    peers' memory): forward and every gradient bit for bit those of the bf16 dispatch with the
    rows quantised after the gather, on every virtual rank (a rank with no tokens, unused slots
    included); both passes from poisoned memory."""
    from mok_megatron.functional.cuda import stage1
    from mok_megatron.ops.grouped_gemm_fp8 import grouped_gemm_fp8_available

    if not grouped_gemm_fp8_available():
        pytest.skip("FP8 grouped GEMMs not built")
    tokens, shape, kwargs = FP8_VIRTUAL_CASES[case]
    problem = _problem(tokens, shape, seed=43, **kwargs)
    config = F.MoKConfig(expert_precision="fp8_blockwise",
                         schedule_capacity_multiplier=float(len(tokens)))  # fmt: skip
    vruns = VirtualRuns(problem, len(tokens), config=config, form="fused")
    calls = []
    chosen = stage1.dispatches_fp8_tokens
    monkeypatch.setattr(stage1, "dispatches_fp8_tokens",
                        lambda *a: calls.append(chosen(*a)) or calls[-1])  # fmt: skip
    _, fp8_tokens = vruns()
    assert calls and all(calls), "the FP8 forward did not dispatch FP8 tokens"
    for r, result in enumerate(fp8_tokens):  # every element written (NaN poison in each dtype)
        for name, value in result.items():
            if value is not None and value.is_floating_point():
                assert_fully_written(f"rank {r} {name}", value)
    monkeypatch.setattr(stage1, "dispatches_fp8_tokens", lambda *a: False)
    _, bf16_tokens = vruns()
    failures = [f"rank {r}: {n}" for r, (a, b) in enumerate(zip(fp8_tokens, bf16_tokens))
                for n in _bitwise_equal(a, b)]  # fmt: skip
    assert not failures, failures


def _overflowing_problem(tokens=(256, 256)):
    # every token on expert 0 of rank 0: rank 0 gets 2x its balanced load, its capacity is 1x
    return _problem(list(tokens), (128, 64, 8, 2, 0), seed=7, routing="one_expert")


@pytest.mark.gpu
def test_virtual_ranks_capacity_overflow_raises_and_writes_in_bounds():
    """Routing over the schedule's capacity: the pass finishes, MoKCapacityError names the knob,
    and no kernel wrote past any workspace region (every guard intact)."""
    vruns = VirtualRuns(_overflowing_problem(), 2,
                        config=F.MoKConfig(schedule_capacity_multiplier=1.0))  # fmt: skip
    vruns(check_errors=False)
    for ws in vruns.workspaces:
        assert ws.buffers.damaged_guards() == [], ws.buffers.damaged_guards()
        with pytest.raises(MoKCapacityError, match="schedule_capacity_multiplier"):
            ws.check_errors()


@pytest.mark.gpu
def test_guards_show_a_write_past_a_region():
    """The guard check can fail: one byte written past the tokens region is reported."""
    run = Run(_problem([16], (64, 32, 4, 2, 0), seed=1), "cuda")
    bufs = run.ws.buffers
    assert bufs.damaged_guards() == []
    end = bufs.layout.guards["tokens"]
    bufs.buffer[end + 3] = 0
    assert bufs.damaged_guards() == ["tokens"]
    bufs.fill_guards()


@pytest.mark.gpu
def test_overflow_in_a_replayed_cuda_graph_is_reported():
    """A pass captured in a CUDA graph (one graph per virtual rank) and replayed on routing that
    overflows: the next host-visible points (``poll_errors``, the next eager schedule) raise
    MoKCapacityError, with no extra sync; before the replay nothing is pending."""
    problem = _overflowing_problem()
    balanced = _problem([256, 256], (128, 64, 8, 2, 0), seed=8)
    # exactly a balanced load (each rank gets half the slots = its capacity), so no overflow
    balanced.topk_experts.copy_(torch.arange(balanced.topk_experts.numel()).view(-1, 2) % 8)
    vruns = VirtualRuns(balanced, 2, config=F.MoKConfig(schedule_capacity_multiplier=1.0))
    scheds, _ = vruns()  # eager warm-up: no overflow
    graphs = [torch.cuda.CUDAGraph() for _ in vruns.runs]
    for r, (run, graph) in enumerate(zip(vruns.runs, graphs)):
        with torch.cuda.graph(graph, stream=vruns.streams[r]):
            captured = run.passes(run.schedule())
    del captured
    torch.cuda.synchronize()
    F.poll_errors()  # nothing recorded yet, on any live workspace
    for r, run in enumerate(vruns.runs):  # the graphs' input: overflowing routing
        run.topk.copy_(problem.local(r, torch.bfloat16, _device())[1])
    for graph, stream in zip(graphs, vruns.streams):
        with torch.cuda.stream(stream):
            graph.replay()
    torch.cuda.synchronize()  # the test's own wait, standing in for the trainer's loss sync
    with pytest.raises(MoKCapacityError, match="schedule_capacity_multiplier"):
        vruns.workspaces[0].monitor.poll()  # reads pinned host memory only
    with pytest.raises(MoKCapacityError, match="schedule_capacity_multiplier"):
        F.poll_errors()  # the trainers' hook: rank 1's workspace
    for graph, stream in zip(graphs, vruns.streams):  # once more: the next eager call raises
        with torch.cuda.stream(stream):
            graph.replay()
    torch.cuda.synchronize()
    with pytest.raises(MoKCapacityError):
        vruns.runs[1].schedule()


# ========================================================================= two GPUs (EP = 2)
EP_CASES = {
    # name: (tokens per rank, shape, problem kwargs)
    "qwen3-30b-a3b": ([256, 256], SHAPES["qwen3-30b-a3b"], {}),
    "deepseek-v3": ([200, 160], SHAPES["deepseek-v3"], {}),
    "mixtral-8x7b": ([150, 190], SHAPES["mixtral-8x7b"], {}),
    "uneven": ([97, 3], (128, 64, 8, 4, 32), {"routing": "skewed"}),
    "rank_without_tokens": ([61, 0], (128, 64, 8, 2, 0), {}),
    "topk1_empty_slots": ([80, 70], (128, 64, 8, 1, 0), {"empty_slot_fraction": 0.2}),
    "topk8_empty_slots": ([80, 70], (128, 64, 16, 8, 0), {"empty_slot_fraction": 0.3}),
    "experts_without_tokens": ([3, 4], (128, 64, 64, 2, 0), {}),
    "all_to_one_expert": ([120, 90], (128, 64, 8, 2, 0), {"routing": "one_expert"}),
}


@pytest.mark.multigpu
@pytest.mark.parametrize("form", ["split", "fused"])
@pytest.mark.parametrize("case", list(EP_CASES))
def test_ep2_matches_oracle(dist_group, case, form):
    # NOTE: failures are collected, not raised early, so both ranks run the same collectives.
    tokens, shape, kwargs = EP_CASES[case]
    problem = _problem(tokens, shape, seed=21, **kwargs)
    config = F.MoKConfig(schedule_capacity_multiplier=2.0)  # = EP size: never overflows
    run = Run(problem, "cuda", config=config, form=form)
    sched, got = run()
    failures = _schedule_failures(sched, problem, run.ws)
    failures += _check_accuracy(problem, got)
    failures += _check_against_reference(problem, got, config, form=form)
    assert not failures, f"rank {dist.get_rank()}: {failures}"


@pytest.mark.multigpu
@pytest.mark.parametrize("form", ["split", "fused"])
def test_ep2_bitwise_repeatable_over_10_runs(dist_group, form):
    problem = _problem([170, 130], SHAPES["qwen3-30b-a3b"], seed=9, shared_inter=64)
    run = Run(problem, "cuda", form=form)
    _, first = run()
    _assert_repeats_bitwise(run, first, 9)


@pytest.mark.multigpu
@pytest.mark.parametrize("form", ["split", "fused"])
def test_ep2_cuda_graph_replay_matches_eager(dist_group, form):
    _graph_check(Run(_problem([150, 110], SHAPES["deepseek-v3"], seed=13), "cuda", form=form))


@pytest.mark.multigpu
@pytest.mark.parametrize("form", ["split", "fused"])
def test_ep2_no_host_sync(dist_group, form):
    problem = _problem([128, 100], SHAPES["qwen3-30b-a3b"], seed=6)
    _no_sync_check(Run(problem, "cuda", form=form))


@pytest.mark.multigpu
def test_ep2_capacity_overflow_raises(dist_group):
    run = Run(_overflowing_problem(), "cuda", config=F.MoKConfig(schedule_capacity_multiplier=1.0))
    _poison_workspace(run.ws)
    run.passes(run.schedule())  # must finish, writing nothing out of bounds (guards intact)
    torch.cuda.synchronize()
    dist.barrier()
    assert run.ws.buffers.damaged_guards() == [], run.ws.buffers.damaged_guards()
    with pytest.raises(MoKCapacityError, match="schedule_capacity_multiplier"):
        run.ws.check_errors()


@pytest.mark.multigpu
@pytest.mark.parametrize("form", ["split", "fused"])
@pytest.mark.parametrize("case", ["all_to_one_expert", "uneven", "qwen3-30b-a3b"])
def test_ep2_macrobatch_rounds_match_oracle(dist_group, case, form):
    """Rounds of 256 rows with a capacity that never overflows (multiplier = EP size)."""
    tokens, shape, kwargs = EP_CASES[case]
    problem = _problem(tokens, shape, seed=37, **kwargs)
    config = F.MoKConfig(schedule_capacity_multiplier=2.0, minibatch_size=128,
                         macrobatch_size=256)  # fmt: skip
    run = Run(problem, "cuda", config=config, form=form)
    sched, got = run()
    failures = [] if run.rounds > 1 else [f"expected several rounds, got {run.rounds}"]
    failures += _schedule_failures(sched, problem, run.ws)
    failures += _check_accuracy(problem, got)
    failures += _check_against_reference(problem, got, config, form=form)
    _, again = run()
    failures += [f"repeat differs in {name}" for name in _bitwise_equal(got, again)]
    assert not failures, f"rank {dist.get_rank()}: {failures}"


@pytest.mark.multigpu
@pytest.mark.parametrize("form", ["split", "fused"])
def test_ep2_full_width_qwen3(dist_group, form):
    """Qwen3-30B-A3B's hidden / intermediate / top-k, 64 experts, uneven 1500 / 1100 tokens."""
    problem = _problem([1500, 1100], (2048, 768, 64, 8, 0), seed=19)
    config = F.MoKConfig(schedule_capacity_multiplier=2.0)
    run = Run(problem, "cuda", config=config, form=form)
    sched, got = run()
    failures = _schedule_failures(sched, problem, run.ws)
    failures += _check_accuracy(problem, got, oracle_device=_device())
    failures += _check_against_reference(problem, got, config, form=form)
    assert not failures, f"rank {dist.get_rank()}: {failures}"


# ================================== weight gradients into caller buffers (Megatron's main_grad)
#: Forms whose accumulating weight gradient is the same GEMM as the returned one, so the sum over
#: a zero buffer, rounded to bf16, is bitwise the returned gradient: the engine for every step
#: ("fused": expert_gemm='engine') or torch for every step ("fused_torch": the torch fallback adds
#: torch._grouped_mm's bf16 result). "split" and "fused_auto" return torch's weight gradient but
#: accumulate on the engine (expert_gemm 'auto' adds its "wgrad" step when accumulating).
SAME_WGRAD_GEMM = ("fused", "fused_torch")
ACCUMULATE_FORMS = (*FORMS, "fused_auto")
OTHER_OUTPUTS = ("out", "d_x", "d_router_weights", *SHARED)


def _clone(buffers):
    return tuple(None if b is None else b.clone() for b in buffers)


def _old_buffers(run, sums, seed):
    """Random starting buffers at the scale of ``sums`` (the sums into zero buffers), so that
    float32 rounding of old + sum stays ~1e-7 of the sum and a lost or doubled round shows."""
    rand = run.make_accumulators("random", seed)
    return tuple(None if r is None else r * s.pow(2).mean().sqrt() for r, s in zip(rand, sums))


def _accumulation_failures(run, plain, zeros, got, old=None, acc=None, exact=True) -> list[str]:
    """An accumulating pass against the plain one: no routed gradient returned, every other
    output bitwise the plain pass's; ``zeros`` (summed from zero buffers) bitwise the returned
    gradient where the GEMM is the same; ``acc`` (summed onto ``old``) bitwise old + zeros when
    ``exact`` (one round), else within float32 rounding of it (rounds add in another order)."""
    failures = [f"{n}: returned with accumulators" for n in ROUTED if got[n] is not None]
    failures += [f"{n}: differs from the plain pass" for n in OTHER_OUTPUTS
                 if plain[n] is not None and not torch.equal(got[n], plain[n])]  # fmt: skip
    summed = run.split_accumulators(zeros)
    if run.form in SAME_WGRAD_GEMM and exact:
        failures += [f"{n}: bf16(sum into zeros) is not the returned gradient" for n in ROUTED
                     if not torch.equal(summed[n].bfloat16(), plain[n])]  # fmt: skip
    if acc is not None:
        for i, (a, o, z) in enumerate(zip(acc, old, zeros)):
            if a is None:
                continue
            if exact and not torch.equal(a, o + z):
                failures.append(f"accumulator {i}: not bitwise old + the sum into zeros")
            err = relative_error(a.double() - o.double(), z.double())
            if not err < 1e-4:
                failures.append(f"accumulator {i}: (acc - old) vs the sum into zeros {err:.2e}")
    return failures


@pytest.mark.gpu
@pytest.mark.parametrize("form", ACCUMULATE_FORMS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_wgrad_accumulation_matches_own_gradient_oracle_and_reference(shape, form):
    problem = _problem([300], SHAPES[shape], seed=11)
    run = Run(problem, "cuda", form=form)
    _, plain = run()
    zeros = run.make_accumulators("zeros")
    _, got = run(accumulators=zeros)
    old = _old_buffers(run, zeros, seed=1)
    acc = _clone(old)
    run(accumulators=acc)
    failures = _accumulation_failures(run, plain, zeros, got, old, acc)
    summed = {**plain, **run.split_accumulators(zeros)}
    failures += _check_accuracy(problem, summed)
    failures += _check_against_reference(problem, summed, form=form)
    again = _clone(old)
    run(accumulators=again)
    failures += [f"accumulator {i}: repeat differs" for i, (a, b) in enumerate(zip(acc, again))
                 if a is not None and not torch.equal(a, b)]  # fmt: skip
    assert not failures, failures


@pytest.mark.gpu
@pytest.mark.parametrize("form", ACCUMULATE_FORMS)
@pytest.mark.parametrize("case", ["qwen3-30b-a3b", "deepseek-v3_shared", "experts_without_tokens",
                                  "all_to_one_expert_topk1"])  # fmt: skip
def test_wgrad_accumulation_over_macrobatch_rounds(case, form):
    """Each round adds its partial weight gradient into the buffer, in round order."""
    tokens, shape, kwargs = ROUND_CASES[case]
    problem = _problem(tokens, shape, seed=23, **kwargs)
    run = Run(problem, "cuda", config=ROUNDS, form=form)
    _, plain = run()
    assert run.rounds > 1, f"{case}: expected several rounds, got {run.rounds}"
    zeros = run.make_accumulators("zeros")
    _, got = run(accumulators=zeros)
    old = _old_buffers(run, zeros, seed=2)
    acc = _clone(old)
    run(accumulators=acc)
    failures = _accumulation_failures(run, plain, zeros, got, old, acc, exact=False)
    summed = {**plain, **run.split_accumulators(zeros)}
    failures += _check_accuracy(problem, summed)
    failures += _check_against_reference(problem, summed, ROUNDS, form=form)
    for repeat in range(2):
        again = _clone(old)
        run(accumulators=again)
        failures += [f"repeat {repeat}: accumulator {i} differs"
                     for i, (a, b) in enumerate(zip(acc, again))
                     if a is not None and not torch.equal(a, b)]  # fmt: skip
    assert not failures, failures


def _used_experts(problem, run) -> torch.Tensor:
    """[E_l] bool on the GPU: this rank's experts that any token routes to."""
    topk = problem.topk_experts
    used = torch.zeros(problem.w_gate.shape[0], dtype=torch.bool)
    used[topk[topk >= 0]] = True
    return used[problem.expert_slice(run.rank)].to(_device())


@pytest.mark.gpu
@pytest.mark.parametrize("form", ACCUMULATE_FORMS)
@pytest.mark.parametrize("rounds", [False, True], ids=["one_round", "rounds"])
def test_wgrad_accumulation_leaves_experts_without_rows_untouched(form, rounds):
    """Experts no token routes to keep their buffer bits: NaN and -0.0 (which adding +0.0 would
    turn into +0.0) survive; the others get a finite sum."""
    if rounds:
        tokens, shape, kwargs = ROUND_CASES["experts_without_tokens"]
        problem = _problem(tokens, shape, seed=23, **kwargs)
    else:
        problem = _problem([5], (128, 64, 64, 2, 0), seed=5)
    run = Run(problem, "cuda", config=ROUNDS if rounds else None, form=form)
    used = _used_experts(problem, run)
    assert (~used).any() and used.any()
    old = run.make_accumulators("random", seed=3)
    for buf in old:
        if buf is not None:
            buf[~used] = -0.0
            buf[~used, 0, :5] = float("nan")
    acc = _clone(old)
    run(accumulators=acc)
    assert (run.rounds > 1) == rounds
    for i, (a, o) in enumerate(zip(acc, old)):
        if a is None:
            continue
        assert torch.equal(a[~used].view(torch.int32), o[~used].view(torch.int32)), (
            f"accumulator {i}: an expert without rows changed"
        )
        assert torch.isfinite(a[used]).all(), f"accumulator {i}: a used expert is not finite"


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["split", "fused", "fused_torch"])
@pytest.mark.parametrize("rounds", [False, True], ids=["one_round", "rounds"])
def test_wgrad_accumulation_graph_replay_and_no_host_sync(form, rounds):
    """Captured in a CUDA graph, each replay adds the same sum: two replays give the buffers two
    eager passes give, bit for bit; eager passes do not sync the host."""
    problem = _problem([190], SHAPES["qwen3-30b-a3b"], seed=8, shared_inter=64)
    run = Run(problem, "cuda", config=ROUNDS if rounds else None, form=form)
    sched, _ = run()
    old = run.make_accumulators("random", seed=4)
    eager = _clone(old)
    for _ in range(2):
        run.passes(sched, eager)
    replayed = _clone(old)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on the capture stream (into scratch buffers)
        run.passes(sched, _clone(old))
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run.passes(sched, replayed)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(replayed, eager)):
        assert a is None or torch.equal(a, b), f"accumulator {i}: graph replays differ from eager"
    torch.cuda.set_sync_debug_mode("error")
    try:
        run.passes(run.schedule(), _clone(old))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    run.ws.check_errors()


@pytest.mark.gpu
def test_wgrad_accumulation_bad_buffers_raise():
    """The CUDA backend goes through the functional API's checks (shape, dtype, alignment)."""
    run = Run(_problem([40], (128, 64, 8, 2, 0), seed=2), "cuda", form="fused")
    gate_up, _, down = run.make_accumulators("zeros")
    sched = run.schedule()
    for buffers, error, match in [
        ((gate_up.bfloat16(), None, down), TypeError, "pass a float32 buffer"),
        ((gate_up, None, down[:, :-8].contiguous()), ValueError, "its weight's shape"),
        ((gate_up, None, torch.zeros(down.numel() + 1, device=down.device)[1:].view(down.shape)),
         ValueError, "16-byte aligned"),
        ((gate_up.cpu(), None, down), ValueError, "is on cpu but the workspace is on cuda"),
    ]:  # fmt: skip
        with pytest.raises(error, match=match):
            run.passes(sched, buffers)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["split", "fused"])
def test_virtual_ranks_wgrad_accumulation(form):
    """EP 2 and 4 on one GPU: each rank adds its own experts' gradients (over every rank's rows)
    into its buffers."""
    for case in ("uneven_skewed", "four_ranks"):
        tokens, shape, kwargs = VIRTUAL_CASES[case]
        problem = _problem(tokens, shape, seed=41, **kwargs)
        config = F.MoKConfig(schedule_capacity_multiplier=float(len(tokens)))
        vruns = VirtualRuns(problem, len(tokens), config=config, form=form)
        _, plain = vruns()
        zeros = [run.make_accumulators("zeros") for run in vruns.runs]
        _, got = vruns(accumulators=zeros)
        old = [_old_buffers(run, z, seed=run.rank) for run, z in zip(vruns.runs, zeros)]
        acc = [_clone(o) for o in old]
        vruns(accumulators=acc)
        oracle = run_oracle(problem, global_d_out(problem, 0))  # VirtualRuns' d_out (seed 0)
        failures = []
        for r, run in enumerate(vruns.runs):
            failures += [f"{case} rank {r}: {f}" for f in _accumulation_failures(
                run, plain[r], zeros[r], got[r], old[r], acc[r])]  # fmt: skip
            for name, value in run.split_accumulators(zeros[r]).items():
                want = _local_slice(problem, name, r, oracle[name]).to(value.device)
                if not relative_error(value, want) < 1e-2:
                    err = relative_error(value, want)
                    failures.append(f"{case} rank {r} {name}: rel err {err:.2e} vs float64")
        assert not failures, failures


@pytest.mark.multigpu
@pytest.mark.parametrize("form", ["split", "fused", "fused_torch"])
@pytest.mark.parametrize("rounds", [False, True], ids=["one_round", "rounds"])
def test_ep2_wgrad_accumulation(dist_group, form, rounds):
    problem = _problem([170, 130], SHAPES["qwen3-30b-a3b"], seed=9, shared_inter=64)
    config = F.MoKConfig(schedule_capacity_multiplier=2.0)
    if rounds:
        config = dataclasses.replace(config, minibatch_size=128, macrobatch_size=256)
    run = Run(problem, "cuda", config=config, form=form)
    _, plain = run()
    zeros = run.make_accumulators("zeros")
    _, got = run(accumulators=zeros)
    old = _old_buffers(run, zeros, seed=5 + run.rank)
    acc = _clone(old)
    run(accumulators=acc)
    failures = [] if (run.rounds > 1) == rounds else [f"rounds: got {run.rounds}"]
    failures += _accumulation_failures(run, plain, zeros, got, old, acc, exact=not rounds)
    failures += _check_accuracy(problem, {**plain, **run.split_accumulators(zeros)})
    again = _clone(old)
    run(accumulators=again)
    failures += [f"accumulator {i}: repeat differs" for i, (a, b) in enumerate(zip(acc, again))
                 if a is not None and not torch.equal(a, b)]  # fmt: skip
    assert not failures, f"rank {dist.get_rank()}: {failures}"
