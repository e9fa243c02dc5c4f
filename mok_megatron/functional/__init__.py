"""Layer 2: the MoK functional API, its config and workspace, and the backends behind them."""

from .api import (
    backward,
    build_schedule,
    check_errors,
    forward,
    poll_errors,
    recompute_forward_context,
)
from .autograd import moe
from .config import MoKConfig
from .fp8_weights import invalidate_fp8_weight_cache
from .schedule import MoKSchedule
from .types import ExpertWeights, FusedExpertWeights, MoKGradients
from .workspace import (
    MoKCapacityError,
    MoKWorkspace,
    clear_workspace_cache,
    create_virtual_workspaces,
    create_workspace,
    get_workspace,
    workspace_bytes,
)

__all__ = [
    "MoKConfig",
    "MoKWorkspace",
    "MoKSchedule",
    "MoKGradients",
    "MoKCapacityError",
    "ExpertWeights",
    "FusedExpertWeights",
    "create_workspace",
    "create_virtual_workspaces",
    "get_workspace",
    "clear_workspace_cache",
    "workspace_bytes",
    "build_schedule",
    "forward",
    "backward",
    "recompute_forward_context",
    "check_errors",
    "poll_errors",
    "moe",
    "invalidate_fp8_weight_cache",
]
