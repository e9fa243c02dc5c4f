"""Megatron-Bridge recipe: Qwen3-30B-A3B pretraining with MoK (one 8-GPU Hopper node, EP 8).

    torchrun --nproc-per-node 8 configs/bridge/qwen3_30b_a3b_mok.py

Bridge's own recipe (flex/HybridEP dispatcher, 16 GPUs) with ``apply_mok``: dispatcher ``mok``,
the recipe's layer spec with MoK MoE layers, and the knobs of configs/examples/qwen3_30b_a3b_hopper8.yaml.
Needs Megatron-Bridge (``pip install megatron-bridge``) on a GPU machine.
"""

from pathlib import Path

from megatron.bridge.recipes.qwen.qwen3_moe import qwen3_30b_a3b_pretrain_config

from mok_megatron.megatron.bridge import apply_mok

KNOBS = Path(__file__).resolve().parents[1] / "examples" / "qwen3_30b_a3b_hopper8.yaml"


def pretrain_config():
    """The Bridge recipe on one node (EP 8) with MoK."""
    cfg = qwen3_30b_a3b_pretrain_config()
    cfg.model.expert_model_parallel_size = 8
    return apply_mok(cfg, mok_config=KNOBS, fused_experts=True)


if __name__ == "__main__":
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    pretrain(pretrain_config(), forward_step)
