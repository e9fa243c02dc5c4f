"""Run a function on N local ranks (gloo on CPU, NCCL on GPUs) and collect what each returns."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_ranks"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, backend, fn, args, result_dir) -> None:
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    else:
        # NOTE: gloo (the CPU tests) meets in a file of the run's own directory, not on a port:
        # free_port's port is free only until it returns, and another process on the machine
        # (a second test run, say) can take it before rank 0 binds it. NCCL keeps the TCP store
        # its GPU runs were made with.
        store = os.path.join(result_dir, "rendezvous")
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                world_size=world_size)  # fmt: skip
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": result}, os.path.join(result_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(result_dir, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo"
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return each result.

    ``fn`` must be importable (module level). A failure on any rank re-raises here with that
    rank's traceback. Results travel through ``torch.save``, so tensors come back on CPU.
    """
    with tempfile.TemporaryDirectory() as result_dir:
        try:
            mp.spawn(
                _worker,
                args=(world_size, free_port(), backend, fn, args, result_dir),
                nprocs=world_size,
                join=True,
            )
        except mp.ProcessRaisedException as exc:
            raise RuntimeError(f"a rank failed:\n{exc}") from None
        results = []
        for rank in range(world_size):
            payload = torch.load(
                os.path.join(result_dir, f"{rank}.pt"), map_location="cpu", weights_only=False
            )
            if "error" in payload:
                raise RuntimeError(f"rank {rank} failed:\n{payload['error']}")
            results.append(payload["ok"])
        return results
