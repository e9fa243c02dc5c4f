"""Layer specs, the Megatron-LM ``--spec`` path, the launcher and Megatron-Bridge's ``apply_mok``.

``apply_mok`` is tested here on a stand-in with the attributes Bridge 0.6.2's
``GPTModelProvider`` / ``ConfigContainer`` have and the same spec resolution as its
``provide()`` (it builds a GPT); test_megatron_bridge.py runs the real Bridge's YAML round trip.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
)
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec, import_module
from megatron.core.transformer.transformer_config import TransformerConfig

from mok_megatron.functional import MoKConfig
from mok_megatron.megatron import (
    MoKExperts,
    MoKMoELayer,
    get_gpt_decoder_block_mok_spec,
    get_gpt_layer_mok_spec,
    get_mok_moe_module_spec,
    mokify_spec,
)
from mok_megatron.megatron.bridge import MoKLayerSpec, apply_mok
from mok_megatron.testing import run_ranks

ROOT = Path(__file__).resolve().parents[3]


def _config(**overrides) -> TransformerConfig:
    values = dict(
        num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        moe_ffn_hidden_size=48, num_moe_experts=4, moe_router_topk=2, moe_layer_freq=[0, 1, 1],
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        moe_token_dispatcher_type="mok", use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0,
    )  # fmt: skip
    values.update(overrides)
    return TransformerConfig(**values)


def _mlp_builders(spec) -> list[Any]:
    layers = spec.layer_specs if hasattr(spec, "layer_specs") else [spec]
    return [layer.submodules.mlp for layer in layers]


def test_moe_module_spec():
    fused = get_mok_moe_module_spec(use_te=False, mok_config=MoKConfig(minibatch_size=512))
    assert fused.func is MoKMoELayer and fused.keywords["submodules"].experts is MoKExperts
    assert fused.keywords["mok_config"] == MoKConfig(minibatch_size=512)
    unfused = get_mok_moe_module_spec(use_te=False, fused_experts=False)
    assert unfused.keywords["submodules"].experts.func is SequentialMLP


def test_mokify_keeps_dense_layers_and_inputs():
    stock = get_gpt_decoder_layer_specs(_config(), use_transformer_engine=False)
    dense, *moe = (layer.submodules.mlp for layer in mokify_spec(stock))
    assert getattr(dense, "func", None) is not MoKMoELayer  # moe_layer_freq: layer 0 is dense
    assert all(b.func is MoKMoELayer for b in moe)
    assert stock[1].submodules.mlp.func is MoELayer  # inputs are not modified


def test_gpt_layer_mok_spec_is_a_spec_and_a_factory():
    assert isinstance(get_gpt_layer_mok_spec, ModuleSpec)  # what Megatron-LM's --spec gets
    assert (
        import_module(("mok_megatron.megatron", "get_gpt_layer_mok_spec")) is get_gpt_layer_mok_spec
    )
    assert get_gpt_layer_mok_spec.submodules.mlp.func is MoKMoELayer
    made = get_gpt_layer_mok_spec(use_te=False, qk_layernorm=True, backend="reference")
    assert type(made) is ModuleSpec and made.submodules.mlp.keywords["backend"] == "reference"


# --------------------------------------------------------------------- Megatron-Bridge stand-in
def _stand_in_default_spec(config, vp_stage=None):
    """Like Bridge's default_layer_spec: Megatron's decoder block spec for the provider."""
    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)


@dataclasses.dataclass
class _GPTModelProviderStandIn(TransformerConfig):
    """What apply_mok uses of Megatron-Bridge 0.6.2's GPTModelProvider."""

    transformer_layer_spec: Any = _stand_in_default_spec
    vocab_size: int = 128
    seq_length: int = 16
    moe_flex_dispatcher_backend: Any = "hybridep"
    cuda_graph_modules: Any = dataclasses.field(
        default_factory=lambda: ["moe_router", "moe_preprocess"]
    )

    def resolved_spec(self, vp_stage=None):
        """GPTModelProvider.provide()'s spec resolution (Megatron-Bridge 0.6.2)."""
        spec = self.transformer_layer_spec
        if not isinstance(spec, ModuleSpec):
            if "vp_stage" in inspect.signature(spec).parameters:
                return spec(self, vp_stage=vp_stage)
            return spec(self)
        return spec


def _stand_in_container(**model_overrides):
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    base = {k: v for k, v in dataclasses.asdict(_config()).items() if k in fields}
    base.update(
        moe_token_dispatcher_type="flex", moe_shared_expert_overlap=False, **model_overrides
    )
    model = _GPTModelProviderStandIn(**base)
    model.cuda_graph_modules = ["moe_router", "moe_preprocess"]  # as a recipe sets it
    return SimpleNamespace(
        model=model, comm_overlap=SimpleNamespace(overlap_moe_expert_parallel_comm=True)
    )


def test_apply_mok_on_a_bridge_config(tmp_path):
    cfg = _stand_in_container()
    knobs = tmp_path / "knobs.yaml"
    MoKConfig(minibatch_size=512).to_yaml(knobs)
    assert apply_mok(cfg, mok_config=knobs) is cfg
    model = cfg.model
    assert model.moe_token_dispatcher_type == "mok" and model.moe_flex_dispatcher_backend is None
    assert (
        model.cuda_graph_modules == ["moe_router"]
        and not cfg.comm_overlap.overlap_moe_expert_parallel_comm
    )
    assert isinstance(model.transformer_layer_spec, MoKLayerSpec)  # a dataclass: Bridge's YAML
    assert model.transformer_layer_spec.mok_config == MoKConfig(minibatch_size=512)


def test_apply_mok_rejects_what_mok_cannot_do():
    with pytest.raises(ValueError, match="no MoE layers"):
        apply_mok(_stand_in_container(num_moe_experts=None))
    with pytest.raises(ValueError, match="expert_tensor_parallel_size = 1"):
        apply_mok(_stand_in_container(expert_tensor_parallel_size=2))


# ---------------------------------------------------------------- built models (one spawned rank)
def _build_rank(rank, world_size):
    """Build and run models through each spec path; return what the tests check."""
    from megatron.core.models.gpt import GPTModel

    from mok_megatron.megatron import parity

    parity.init_megatron_parallel(world_size)
    result = {}
    config = _config()
    model = GPTModel(config, get_gpt_layer_mok_spec, vocab_size=64, max_sequence_length=8)
    tokens = torch.randint(0, 64, (2, 8))
    mask = torch.ones(8, 8).triu(1).bool()[None, None]
    loss = model(tokens, torch.arange(8).expand(2, 8), mask, labels=tokens).mean()
    loss.backward()
    result["spec_layers"] = [type(layer.mlp).__name__ for layer in model.decoder.layers]
    result["finite"] = bool(torch.isfinite(loss))
    cfg = apply_mok(_stand_in_container())
    bridged = GPTModel(cfg.model, cfg.model.resolved_spec(), vocab_size=64, max_sequence_length=8)
    result["bridge_layers"] = [type(layer.mlp).__name__ for layer in bridged.decoder.layers]
    block = get_gpt_decoder_block_mok_spec(_config(), use_transformer_engine=False)
    result["block_layers"] = [getattr(b, "func", b).__name__ for b in _mlp_builders(block)]
    result["errors"] = _error_messages()
    return result


def _error_messages() -> dict:
    """The clear errors of misuse, as messages."""
    from mok_megatron.megatron import parity

    errors = {}
    gated = _config(moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True)
    builder = get_mok_moe_module_spec(use_te=False, fuse_shared_experts=True)
    errors["gate"] = _message(lambda: builder(config=gated, pg_collection=None, is_mtp_layer=False))
    wrong = _config(moe_token_dispatcher_type="alltoall")
    errors["dispatcher"] = _message(
        lambda: get_mok_moe_module_spec(use_te=False)(
            config=wrong, pg_collection=None, is_mtp_layer=False
        )
    )
    gelu = _config(activation_func=torch.nn.functional.gelu)
    errors["gelu"] = _message(
        lambda: get_mok_moe_module_spec(use_te=False)(
            config=gelu, pg_collection=None, is_mtp_layer=False
        )
    )
    layer = parity.build_moe_layer(parity.LayerCase(), "mok_fused", 1)
    errors["rows"] = _message(
        lambda: layer.experts(
            torch.zeros(3, 32), torch.tensor([3, 0, 0, 0, 0, 0, 0, 0]), torch.ones(3)
        )
    )
    return errors


def _message(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return str(e)
    return "no error"


@pytest.fixture(scope="module")
def built():
    return run_ranks(_build_rank, 1)[0]


def test_megatron_lm_spec_object_builds_a_mok_gpt(built):
    assert built["spec_layers"] == ["MoKMoELayer"] * 3 and built["finite"]


def test_bridge_config_builds_a_mok_gpt(built):
    assert built["bridge_layers"] == ["MLP", "MoKMoELayer", "MoKMoELayer"]


def test_decoder_block_mok_spec(built):
    assert built["block_layers"][1:] == ["MoKMoELayer", "MoKMoELayer"]
    assert built["block_layers"][0] != "MoKMoELayer"


@pytest.mark.parametrize(
    "case,text",
    [
        ("gate", "fuse_shared_experts=True but the shared expert has a gate"),
        ("dispatcher", "MoKMoELayer needs moe_token_dispatcher_type='mok', got 'alltoall'"),
        ("gelu", "MoKExperts: the experts must be SwiGLU"),
        ("rows", "MoKExperts needs MoKTokenDispatcher in fused mode"),
    ],
)
def test_misuse_fails_clearly(built, case, text):
    assert text in built["errors"][case]


# --------------------------------------------------------------------------------- the launcher
# (test_megatron_lm.py runs Megatron-LM's real pretrain_gpt.py; this script checks the flags
# chain with a script's own extra_args_provider.)
FAKE_PRETRAIN = """
    from megatron.training.arguments import parse_args

    args = parse_args(extra_args_provider=lambda p: (p.add_argument("--my-flag", type=int), p)[1])
    print("dispatcher", args.moe_token_dispatcher_type, "minibatch", args.mok_minibatch_size,
          "my_flag", args.my_flag)
"""


def _launch(tmp_path, *flags) -> str:
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(textwrap.dedent(FAKE_PRETRAIN))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "mok_megatron.megatron.launch", str(script), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_launcher_runs_a_megatron_lm_script_with_mok(tmp_path):
    out = _launch(tmp_path, "--moe-token-dispatcher-type", "mok", "--mok-minibatch-size", "512",
                  "--my-flag", "7")  # fmt: skip
    assert "dispatcher mok minibatch 512 my_flag 7" in out


def test_launcher_polls_mok_errors_after_each_training_log(monkeypatch):
    """Megatron-LM's per-iteration training_log ends with functional.poll_errors() (where a
    capacity overflow recorded on the device, CUDA-graph replays included, surfaces)."""
    from megatron.training import training

    from mok_megatron import functional
    from mok_megatron.megatron import launch

    seen = []
    monkeypatch.setattr(training, "training_log", lambda *a, **k: seen.append(("log", a)) or 5)
    monkeypatch.setattr(functional, "poll_errors", lambda: seen.append(("poll",)))
    launch._poll_errors_after_logging()
    assert training.training_log(1, 2) == 5
    assert seen == [("log", (1, 2)), ("poll",)]
