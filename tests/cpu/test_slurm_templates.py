"""The SLURM templates: valid bash, and NVLink multicast is not switched off by default (a rack
has it and NCCL uses it; docs/MULTINODE.md)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

TEMPLATES = sorted((Path(__file__).resolve().parents[2] / "scripts" / "slurm").glob("*.sbatch"))
MULTICAST_OFF = re.compile(r"^\s*export\s+(NCCL_NVLS_ENABLE=0|TORCH_SYMM_MEM_DISABLE_MULTICAST=1)",
                           re.MULTILINE)  # fmt: skip


def test_there_are_templates():
    assert {p.name for p in TEMPLATES} >= {"hopper8.sbatch", "nvl72.sbatch"}


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_template_is_valid_bash_and_keeps_multicast(template):
    done = subprocess.run(["bash", "-n", str(template)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text = template.read_text()
    assert not MULTICAST_OFF.search(text), f"{template.name} switches NVLink multicast off"
    assert "# export NCCL_NVLS_ENABLE=0" in text, "the site switch is documented in place"
