"""Megatron-Bridge recipe: Qwen3-30B-A3B pretraining with MoK (one 8-GPU Hopper node, EP 8).

    torchrun --nproc-per-node 8 configs/bridge/qwen3_30b_a3b_mok.py [HF_DIR]

Bridge's own recipe (flex/HybridEP dispatcher, 16 GPUs) with ``apply_mok``: dispatcher ``mok``,
the recipe's layer spec with MoK MoE layers, and the knobs of configs/examples/qwen3_30b_a3b_hopper8.yaml.
The model config and tokenizer come from the Hub id Bridge's recipe names (Qwen/Qwen3-30B-A3B at a
pinned revision), or from ``HF_DIR``, a local HF checkpoint directory (config.json, tokenizer).
Needs Megatron-Bridge (``pip install megatron-bridge``) on a GPU machine.
"""

import contextlib
import sys
from pathlib import Path

import megatron.bridge.recipes.qwen.h100.qwen3_moe as bridge_recipe
from megatron.bridge.recipes.qwen.qwen3_moe import qwen3_30b_a3b_pretrain_config

from mok_megatron.megatron.bridge import apply_mok

KNOBS = Path(__file__).resolve().parents[1] / "examples" / "qwen3_30b_a3b_hopper8.yaml"


def pretrain_config(hf_path: str | Path | None = None):
    """The Bridge recipe on one node (EP 8) with MoK; ``hf_path``: a local HF directory in
    place of the recipe's Hub id (model config and tokenizer)."""
    with _hf_source(hf_path):
        cfg = qwen3_30b_a3b_pretrain_config()
    cfg.model.expert_model_parallel_size = 8
    return apply_mok(cfg, mok_config=KNOBS, fused_experts=True)


@contextlib.contextmanager
def _hf_source(hf_path):
    """Point Bridge 0.6.2's recipe module (its Hub id and revision constants) at ``hf_path``."""
    if hf_path is None:
        yield
        return
    if not Path(hf_path, "config.json").is_file():
        raise FileNotFoundError(
            f"hf_path={hf_path!s} must be an HF checkpoint directory (config.json)"
        )
    names = ("_QWEN3_30B_A3B_MODEL_ID", "_QWEN3_30B_A3B_MODEL_REVISION")
    saved = {name: getattr(bridge_recipe, name) for name in names}
    bridge_recipe._QWEN3_30B_A3B_MODEL_ID = str(hf_path)
    bridge_recipe._QWEN3_30B_A3B_MODEL_REVISION = None  # a local directory has no revisions
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(bridge_recipe, name, value)


if __name__ == "__main__":
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    pretrain(pretrain_config(sys.argv[1] if len(sys.argv) > 1 else None), forward_step)
