"""What every result record names: the commit it was measured at."""

from __future__ import annotations

import os
import subprocess

__all__ = ["commit"]


def commit() -> str:
    """``$MOK_COMMIT`` (the device copy has no .git), else ``git rev-parse HEAD``, else
    "unknown"."""
    if os.environ.get("MOK_COMMIT"):
        return os.environ["MOK_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
