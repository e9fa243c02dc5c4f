"""What every result record names (the commit it was measured at), and how a table made from
records is written into its page."""

from __future__ import annotations

import os
import subprocess

__all__ = ["commit", "fill_markdown_table"]


def commit() -> str:
    """``$MOK_COMMIT`` (the device copy has no .git), else ``git rev-parse HEAD``, else
    "unknown"."""
    if os.environ.get("MOK_COMMIT"):
        return os.environ["MOK_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def fill_markdown_table(md_path: str, table: str, begin: str, end: str) -> None:
    """Replace the text between the markers ``begin`` and ``end`` of ``md_path`` with ``table``
    (the markers stay, each on its own line around it)."""
    with open(md_path) as f:
        text = f.read()
    if begin not in text or end not in text:
        raise SystemExit(f"{md_path}: no '{begin}' ... '{end}' markers to fill")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(md_path, "w") as f:
        f.write(f"{head}{begin}\n{table}\n{end}{tail}")
