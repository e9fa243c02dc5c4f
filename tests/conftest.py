"""Skips tests marked ``gpu`` without a CUDA GPU and ``multigpu`` with fewer than 2 GPUs.

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
