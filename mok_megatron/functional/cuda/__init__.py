"""The CUDA backend: compiled kernels over symmetric memory, by concern.

buffers.py   the workspace: the C++ layout in (symmetric) device memory, peer tables, ``comm``;
             virtual ranks (W workspaces of one process on one GPU) for protocol tests
plan.py      stage 1's padded row layout and macrobatch rounds, from the schedule
experts.py   the routed expert MLP on one round's rows: the GEMM engine or torch._grouped_mm
fp8.py       its blockwise-FP8 forward (expert_precision="fp8_blockwise") and the FP8 weights
stage1.py    the stage-1 pass: a sequence of sync-free kernels driven from Python
backend.py   ``CudaBackend``, what ``functional`` calls
"""

from .backend import CudaBackend
from .stage1 import CudaContext

__all__ = ["CudaBackend", "CudaContext"]
