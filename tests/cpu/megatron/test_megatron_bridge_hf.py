"""Megatron-Bridge 0.6.2's HF checkpoint conversion with MoK: a tiny Qwen3-MoE, HF -> MoK -> HF.

Writes a local Qwen3-MoE checkpoint (config.json + model.safetensors, per-expert HF names),
imports it with ``AutoBridge`` into a GPT with MoK layers (dispatcher ``mok``, ``MoKExperts``,
the reference backend) and into one with Megatron's own experts (SequentialMLP, alltoall), then
exports the MoK model back. Checks: every exported tensor equals the checkpoint's bitwise, and
both models give the same logits (float32). One rank, gloo, CPU; no network. Bridge and the HF
packages come from requirements/bridge.txt (``--no-deps``, see mok_megatron.testing.bridge_import),
so the conversion runs in a subprocess. Also a script:

    python tests/cpu/megatron/test_megatron_bridge_hf.py <scratch dir>
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mok_megatron.testing import bridge_import

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "configs" / "bridge" / "qwen3_30b_a3b_mok.py"
SITE = Path(bridge_import.bridge_site())
#: The tiny Qwen3-MoE: 2 layers, hidden 64, 4 experts (top 2) of width 32.
HF_CONFIG = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], tie_word_embeddings=False, max_position_embeddings=64,
    rope_theta=10000.0, rms_norm_eps=1e-6, architectures=["Qwen3MoeForCausalLM"],
)  # fmt: skip

pytestmark = pytest.mark.skipif(
    not all((SITE / p).is_dir() for p in ("megatron/bridge", "transformers", "safetensors")),
    reason=f"Megatron-Bridge / transformers not in {SITE} (scripts/setup_env.sh puts them there)",
)


# --------------------------------------------------------------------------- in the subprocess
def _hf_weights(seed: int = 0) -> dict:
    """Random float32 weights under the names of an HF Qwen3-MoE checkpoint."""
    import torch

    c = HF_CONFIG
    h, hd, v, e, i = c["hidden_size"], c["head_dim"], c["vocab_size"], c["num_experts"], 32
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {
        "model.embed_tokens.weight": (v, h),
        "lm_head.weight": (v, h),
        "model.norm.weight": (h,),
    }
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h)}
        shapes |= {p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)}
        shapes[p + "mlp.gate.weight"] = (e, h)
        for x in range(e):
            for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                shapes[f"{p}mlp.experts.{x}.{name}.weight"] = shape
    gen = torch.Generator().manual_seed(seed)
    return {
        name: (1 + 0.1 * torch.randn(s, generator=gen)) if len(s) == 1 else 0.1 * torch.randn(s, generator=gen)
        for name, s in shapes.items()
    }  # fmt: skip


def _write_checkpoint(path: Path) -> dict:
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    path.mkdir(parents=True, exist_ok=True)
    Qwen3MoeConfig(**HF_CONFIG, dtype="float32").save_pretrained(path)
    weights = _hf_weights()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return weights


def _local_spec(config, vp_stage=None):
    """Megatron's local (non-TE) decoder block spec: this machine has no TE."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)


def _cpu_provider(bridge):
    """The bridge's provider, float32, without the fusions and TE a CPU run lacks."""
    import torch

    provider = bridge.to_megatron_provider(load_weights=False)
    provider.transformer_layer_spec = _local_spec
    for name in (
        "bf16", "fp16", "moe_grouped_gemm", "moe_permute_fusion", "gradient_accumulation_fusion",
        "bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
        "persist_layer_norm", "apply_rope_fusion", "cross_entropy_loss_fusion",
    ):  # fmt: skip
        setattr(provider, name, False)
    provider.params_dtype = provider.pipeline_dtype = provider.autocast_dtype = torch.float32
    provider.use_cpu_initialization = True
    return provider


def _build(bridge, mok: bool):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from mok_megatron.megatron.bridge import apply_mok

    provider = _cpu_provider(bridge)
    if mok:
        apply_mok(provider, backend="reference")
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()  # as Bridge's
    model = provider.provide()  # provide_distributed_model sets it (that one needs a GPU)
    bridge.load_hf_weights([model])
    return model.eval()


def _logits(model, tokens):
    import torch

    seq = tokens.shape[1]
    mask = torch.ones(seq, seq).triu(1).bool()[None, None]
    with torch.no_grad():
        return model(tokens, torch.arange(seq).expand_as(tokens), mask)


def _convert(scratch: str) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.bridge import AutoBridge

    from mok_megatron.megatron import parity
    from mok_megatron.megatron.bridge import enable_mok_hf_conversion
    from mok_megatron.testing.spawn import free_port

    # Imports (so registers) Bridge's Qwen3-MoE bridge: bridge_import's lazy package __init__s
    # do not import every model bridge as the real ones do.
    assert enable_mok_hf_conversion()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parity.init_megatron_parallel(1)
    weights = _write_checkpoint(Path(scratch) / "qwen3_moe_tiny")
    bridge = AutoBridge.from_hf_pretrained(str(Path(scratch) / "qwen3_moe_tiny"))
    mok, ref = _build(bridge, mok=True), _build(bridge, mok=False)
    exported = {n: t for n, t in bridge.export_hf_weights([mok], cpu=True, show_progress=False)}
    tokens = torch.randint(
        0, HF_CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1)
    )
    out_mok, out_ref = _logits(mok, tokens), _logits(ref, tokens)
    return {
        "experts": [type(layer.mlp.experts).__name__ for layer in (*mok.decoder.layers, *ref.decoder.layers)],
        "missing": sorted(set(weights) - set(exported)),
        "extra": sorted(set(exported) - set(weights)),
        "unequal": sorted(n for n in weights.keys() & exported.keys() if not torch.equal(weights[n], exported[n])),
        "max_abs_diff": (out_mok - out_ref).abs().max().item(),
        "close": torch.allclose(out_mok, out_ref, rtol=1e-4, atol=1e-5),
        "scale": out_ref.abs().max().item(),
        "recipe": _recipe_on(Path(scratch) / "qwen3_moe_tiny"),
    }  # fmt: skip


def _recipe_on(hf_dir: Path) -> dict:
    """configs/bridge/qwen3_30b_a3b_mok.py's pretrain_config with a local HF directory."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("qwen3_30b_a3b_mok", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    cfg = recipe.pretrain_config(hf_path=hf_dir)
    model = cfg.model
    return {
        "shape": [model.num_layers, model.hidden_size, model.num_moe_experts],
        "dispatcher": model.moe_token_dispatcher_type,
        "tokenizer": str(cfg.tokenizer.tokenizer_model),
    }


# -------------------------------------------------------------------------------------- test
def test_hf_qwen3_moe_round_trip_through_mok(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, __file__, str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, f"failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["experts"] == ["MoKExperts"] * 2 + ["SequentialMLP"] * 2
    assert (result["missing"], result["extra"], result["unequal"]) == ([], [], [])
    assert result["close"], f"MoK vs SequentialMLP logits differ by {result['max_abs_diff']}"
    assert result["recipe"] == {
        "shape": [2, 64, 4], "dispatcher": "mok", "tokenizer": str(tmp_path / "qwen3_moe_tiny")
    }  # fmt: skip


if __name__ == "__main__":
    if not bridge_import.install(hf=True):
        sys.exit(f"no Megatron-Bridge in {bridge_import.bridge_site()}")
    import logging

    logging.disable(logging.WARNING)
    print(json.dumps(_convert(sys.argv[1])))
