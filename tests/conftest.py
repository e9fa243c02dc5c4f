"""Skips tests marked ``gpu`` without a CUDA GPU and ``multigpu`` with fewer than 2 GPUs, and
lets each test module's GPU memory go before the next module runs.

Sets CUDA_MODULE_LOADING=EAGER (unless set) before anything starts CUDA: the virtual-rank tests
need it (functional.workspace.VIRTUAL_RANKS_RULE).
"""

import os

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multigpu = pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs, found {num_gpus}")
    for item in items:
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(skip_multigpu)
        elif "gpu" in item.keywords and num_gpus < 1:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True, scope="module")
def _release_gpu_memory_after_module():
    """After each module: the cached workspaces (functional.get_workspace's) and the poisoned
    pools no tensor uses any more are let go. Without it, after tests/gpu/test_cuda_backend.py
    (workspaces for many shapes, cached, their buffers made while poisoned pools were current)
    49.5 GiB stayed allocated in private pools, and the next module's big problems ran out of an
    80 GB H100's memory
    (docs/results/gpu_check_nvidia-h100-x1_2026-12-06_6ba3a9f.json: every failure an
    OutOfMemoryError)."""
    yield
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    from mok_megatron import functional
    from mok_megatron.testing.poison import release_unused_pools

    functional.clear_workspace_cache()
    release_unused_pools()
