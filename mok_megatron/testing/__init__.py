"""Helpers shared by tests, scripts and users: spawning ranks, oracles, tolerances."""

from .oracles import dense_moe, random_moe_problem, relative_error
from .spawn import free_port, run_ranks

__all__ = ["dense_moe", "random_moe_problem", "relative_error", "free_port", "run_ranks"]
