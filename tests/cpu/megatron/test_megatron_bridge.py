"""Megatron-Bridge 0.6.2's real ``ConfigContainer.to_yaml`` / ``from_yaml`` keep MoK's settings.

Runs configs/bridge/qwen3_30b_a3b_mok.py's ``pretrain_config()`` (Bridge's own Qwen3-30B-A3B
recipe, with a small Qwen3-MoE-shaped provider in place of the HF download), writes it as
Bridge writes run_config.yaml, loads it back in a fresh process and compares. Bridge comes from
requirements/bridge.txt (``--no-deps``, see mok_megatron.testing.bridge_import for the stubs),
so the round trip runs in a subprocess. Also a script:

    python tests/cpu/megatron/test_megatron_bridge.py save run_config.yaml
    python tests/cpu/megatron/test_megatron_bridge.py load run_config.yaml
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mok_megatron.testing import bridge_import

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "configs" / "bridge" / "qwen3_30b_a3b_mok.py"
#: Non-default knobs next to the two "auto" string knobs, for the second config.
AUTO_KNOBS = {"fwd_num_comm_sms": "auto", "minibatch_size": "auto", "wait_timeout_ms": 1234}

pytestmark = pytest.mark.skipif(
    not (Path(bridge_import.bridge_site()) / "megatron" / "bridge").is_dir(),
    reason=f"Megatron-Bridge not in {bridge_import.bridge_site()} (scripts/setup_env.sh puts it there)",
)


# --------------------------------------------------------------------------- in the subprocess
def _small_provider():
    """What AutoBridge.from_hf_pretrained(Qwen3-30B-A3B).to_megatron_provider() gives, smaller."""
    from megatron.bridge.models import GPTModelProvider

    return GPTModelProvider(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, moe_ffn_hidden_size=32,
        num_attention_heads=4, num_query_groups=2, num_moe_experts=8, moe_router_topk=2,
        vocab_size=128, seq_length=16, moe_token_dispatcher_type="alltoall",
    )  # fmt: skip


class _OfflineAutoBridge:
    @classmethod
    def from_hf_pretrained(cls, *args, **kwargs):
        return cls()

    def to_megatron_provider(self, load_weights=False):
        return _small_provider()


def _configs():
    """The MoK Qwen3 recipe, and a copy with the 'auto' knobs and non-default layer arguments."""
    import copy
    import importlib.util

    import megatron.bridge.recipes.qwen.h100.qwen3_moe as bridge_recipe

    from mok_megatron.megatron.bridge import apply_mok

    bridge_recipe.AutoBridge = _OfflineAutoBridge  # no HF download on the test machine
    spec = importlib.util.spec_from_file_location("qwen3_30b_a3b_mok", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    cfg = recipe.pretrain_config()
    auto = copy.deepcopy(cfg)
    auto.model.transformer_layer_spec = auto.model.transformer_layer_spec.base_spec
    apply_mok(auto, AUTO_KNOBS, fused_experts=False, backend="torch", max_local_tokens=4096)
    return {"recipe": cfg, "auto": auto}


def _describe(spec) -> dict:
    """The MoK layer spec as plain data: its type, knobs and layer arguments."""
    out = {"type": f"{type(spec).__module__}.{type(spec).__qualname__}"}
    if dataclasses.is_dataclass(spec):
        for f in dataclasses.fields(spec):
            value = getattr(spec, f.name)
            if dataclasses.is_dataclass(value):
                value = {"type": type(value).__qualname__, **dataclasses.asdict(value)}
            elif callable(value):
                value = f"{value.__module__}.{value.__qualname__}"
            out[f.name] = value
    return out


def _save(path: str) -> dict:
    result = {}
    for name, cfg in _configs().items():
        cfg.to_yaml(f"{path}.{name}.yaml")
        result[name] = _describe(cfg.model.transformer_layer_spec)
    return result


def _load(path: str) -> dict:
    from megatron.bridge.training.config import ConfigContainer

    from mok_megatron.megatron.bridge import allow_mok_targets

    allow_mok_targets()  # what a process that only loads a saved config calls
    result = {}
    for name in ("recipe", "auto"):
        cfg = ConfigContainer.from_yaml(f"{path}.{name}.yaml")
        result[name] = _describe(cfg.model.transformer_layer_spec)
        result[name]["dispatcher"] = cfg.model.moe_token_dispatcher_type
    return result


# -------------------------------------------------------------------------------------- test
def _pythonpath() -> str:
    """This checkout first (the venv may hold another one, installed editable)."""
    return os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])


def _run(step: str, path: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, step, str(path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": _pythonpath()},
    )  # fmt: skip
    assert proc.returncode == 0, f"{step} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bridge_yaml_round_trip_keeps_mok(tmp_path):
    from mok_megatron.functional import MoKConfig

    saved = _run("save", tmp_path / "run_config")
    loaded = _run("load", tmp_path / "run_config")
    knobs = MoKConfig.from_yaml(ROOT / "configs/examples/qwen3_30b_a3b_hopper8.yaml")
    assert saved["recipe"]["mok_config"] == {"type": "MoKConfig", **knobs.to_dict()}
    assert saved["auto"]["mok_config"] == {"type": "MoKConfig", **MoKConfig(**AUTO_KNOBS).to_dict()}
    for name in ("recipe", "auto"):
        assert loaded[name].pop("dispatcher") == "mok"
        assert loaded[name] == saved[name], name
        assert loaded[name]["type"] == "mok_megatron.megatron.bridge.MoKLayerSpec"
    assert (loaded["auto"]["fused_experts"], loaded["auto"]["backend"]) == (False, "torch")
    assert loaded["auto"]["max_local_tokens"] == 4096


if __name__ == "__main__":
    if not bridge_import.install():
        sys.exit(f"no Megatron-Bridge in {bridge_import.bridge_site()}")
    import logging

    logging.disable(logging.WARNING)
    step, path = sys.argv[1:3]
    print(json.dumps(_save(path) if step == "save" else _load(path)))
