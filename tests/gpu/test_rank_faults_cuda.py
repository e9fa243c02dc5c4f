"""A rank that fails mid-pass, on the CUDA backend (issue 17, item 1; the reference backend's half
is tests/cpu/test_reference_timeouts.py).

Rank 1 of two stops at the start of a step (its schedule, its forward or its backward) while rank
0 goes on: rank 0's next device-side wait gives up after ``MoKConfig.wait_timeout_ms``, prints
the rank, the phase and the peer it waited on, and traps; the launch fails, the host gets the
error at its next sync, and the process exits on its own (``os._exit``: a trapped context cannot
be torn down, so interpreter teardown would abort). Both forward paths (stage 1 and the
megakernel; the backward is stage 1's on both).

On one GPU the two ranks are *virtual ranks* (one process, MEGAKERNEL.md): "rank 1 stops" means
its work is never enqueued. A trap ends the whole CUDA context, so no process outlives the
failure here (as with NCCL's watchdog, the job restarts); the reference backend's test checks
the later passes of surviving processes. With two GPUs the same script runs as two real ranks
under torchrun, rank 1 stalling (sleeping) or exiting (``os._exit``) at that step.

Each test records the seconds from rank 0's step to the error (``record_property``: the junit
file that scripts/reliability_run.py reads for docs/RELIABILITY.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.gpu

TIMEOUT_MS = 1500
#: Upper bound on the seconds from rank 0's step to the host-visible error: the wait's own
#: timeout plus the time the child takes to launch the remaining steps and sync.
ERROR_WITHIN_S = 20.0

#: The phase rank 0's first unanswered wait names, by the step rank 1 stopped at: a forward or a
#: backward (either path's) first restages the tokens region, after the barrier that says every
#: rank is done reading its previous contents (launch/moe_mega.cu, moe_stage_tokens).
PHASE = {
    "schedule": "schedule/routing staged",
    "forward": "dispatch/previous tokens read",
    "backward": "dispatch/previous tokens read",
}

_SCRIPT = """
import os, sys, time
import torch
from mok_megatron import functional as F
from mok_megatron.ops import interleave_gate_up
from mok_megatron.testing import random_moe_problem
from mok_megatron.testing.runs import global_d_out

STEPS = ("schedule", "forward", "backward")
path, stop_at, how, timeout_ms = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
knobs = {"fwd_num_comm_sms": 4} if path == "megakernel" else {}
config = F.MoKConfig(cuda_forward=path, wait_timeout_ms=timeout_ms, **knobs)
dims = dict(num_local_tokens=64, hidden_size=128, topk=2, num_experts=8, intermediate_size=64)
p = random_moe_problem([64, 64], 128, 64, 8, 2, seed=1)
if "WORLD_SIZE" in os.environ:  # two real ranks (torchrun)
    import torch.distributed as dist
    me = int(os.environ["RANK"])
    torch.cuda.set_device(me)
    dist.init_process_group("nccl")
    wss = {me: F.create_workspace(config, dist.group.WORLD, device="cuda", backend="cuda", **dims)}
    streams = {me: torch.cuda.current_stream()}
else:  # two virtual ranks of this process
    from mok_megatron.testing.virtual import rank_streams
    wss = dict(enumerate(F.create_virtual_workspaces(config, 2, device="cuda", **dims)))
    streams = dict(enumerate(rank_streams(2)))
state = {}
for r in wss:
    x, topk, rw, (g, u, d), _ = p.local(r, torch.bfloat16, "cuda")
    d_out = global_d_out(p, 0)[p.token_slice(r)].to("cuda", torch.bfloat16).contiguous()
    state[r] = {"x": x, "topk": topk, "rw": rw, "d_out": d_out,
                "w": (None, None, None, interleave_gate_up(g, u), None, d)}
torch.cuda.synchronize()
assert all(ws.backend.path(ws) == path for ws in wss.values()), path


def step(r, name):
    s, ws = state[r], wss[r]
    if name == "schedule":
        s["sched"] = F.build_schedule(ws, config, s["topk"], router_weights=s["rw"]).ensure_built()
    elif name == "forward":
        s["out"], s["ctx"] = F.forward(config, ws, s["sched"], s["x"], s["rw"], *s["w"])
    else:
        s["grads"] = F.backward(config, ws, s["sched"], s["ctx"], s["d_out"], s["x"], s["rw"],
                                *s["w"])


started = None
try:
    for name in STEPS:
        if name == stop_at:
            started = time.monotonic()
            if 1 in wss and len(wss) == 1:  # the real rank 1 stops here
                if how == "exit":
                    os._exit(0)
                time.sleep(4 * timeout_ms / 1000)
                os._exit(0)
        for r in wss:
            if r == 1 and started is not None:  # the virtual rank 1 never launches it
                continue
            with torch.cuda.stream(streams[r]):
                step(r, name)
    torch.cuda.synchronize()
    print("NO-TIMEOUT", flush=True)
except Exception as exc:
    print("LAUNCH-FAILED", type(exc).__name__, flush=True)
    print(f"SECONDS-TO-ERROR {time.monotonic() - started:.3f}", flush=True)
# NOTE: os._exit, not sys.exit: after a trap the CUDA context cannot be torn down (torch's
# destructors abort on the sticky error), so the process leaves without running them.
os._exit(3)
"""


def _child(tmp_path, path: str, stop_at: str, how: str, nproc: int = 0):
    script = tmp_path / "rank_fault.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_MODULE_LOADING="EAGER",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NCCL_NVLS_ENABLE="0")  # fmt: skip
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    args = [str(script), path, stop_at, how, str(TIMEOUT_MS)]
    if nproc:
        args = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                *args]  # fmt: skip
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=180)  # fmt: skip


def _check(proc, stop_at: str, record_property) -> None:
    output = proc.stdout + proc.stderr
    assert "LAUNCH-FAILED" in output, output[-4000:]
    want = f"mok: rank 0 timed out after {TIMEOUT_MS} ms in phase '{PHASE[stop_at]}'"
    assert want in output, output[-4000:]
    assert "peer 1" in output, output[-4000:]
    seconds = float(output.split("SECONDS-TO-ERROR ")[1].split()[0])
    record_property("seconds_to_error", seconds)
    assert TIMEOUT_MS / 1000 <= seconds <= ERROR_WITHIN_S, seconds


@pytest.mark.parametrize("stop_at", list(PHASE))
@pytest.mark.parametrize("path", ["stage1", "megakernel"])
def test_a_virtual_rank_that_stops_fails_the_other_naming_rank_and_phase(
    tmp_path, path, stop_at, record_property
):
    proc = _child(tmp_path, path, stop_at, "stall")
    _check(proc, stop_at, record_property)
    assert proc.returncode == 3, (proc.returncode, (proc.stdout + proc.stderr)[-3000:])


@pytest.mark.multigpu
@pytest.mark.parametrize("how", ["stall", "exit"])
@pytest.mark.parametrize("stop_at", list(PHASE))
@pytest.mark.parametrize("path", ["stage1", "megakernel"])
def test_a_real_rank_that_stalls_or_exits_fails_the_other(tmp_path, path, stop_at, how,
                                                          record_property):  # fmt: skip
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (two real ranks under torchrun)")
    proc = _child(tmp_path, path, stop_at, how, nproc=2)
    _check(proc, stop_at, record_property)
