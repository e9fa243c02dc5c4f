"""The run files in configs/: every one loads, becomes a TransformerConfig, MoKConfig and a
Megatron-LM command line that Megatron-LM's own parser accepts; mistakes fail clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from mok_megatron.functional import MoKConfig
from mok_megatron.megatron.megatron_lm_flags import megatron_lm_parser
from mok_megatron.megatron.yaml_config import load_run_config, run_config_from_dict

ROOT = Path(__file__).resolve().parents[3]
RUN_FILES = sorted([*ROOT.glob("configs/*.yaml"), *ROOT.glob("configs/examples/*.yaml")])
TINY = ROOT / "configs" / "tiny_cpu.yaml"


def test_there_are_run_files():
    names = {p.stem for p in RUN_FILES}
    for model in ("qwen3_30b_a3b", "deepseek_v3", "mixtral_8x7b"):
        assert {f"{model}_hopper8", f"{model}_nvl72"} <= names
    assert "tiny_cpu" in names


@pytest.mark.parametrize("path", RUN_FILES, ids=lambda p: p.stem)
def test_run_file_maps_onto_megatron(path):
    run = load_run_config(path)
    config = run.transformer_config()
    model = yaml.safe_load(path.read_text())["model"]
    assert config.moe_token_dispatcher_type == "mok"
    assert config.num_moe_experts == model["num_moe_experts"]
    assert config.expert_model_parallel_size == run.parallelism.expert_model_parallel_size
    assert config.gated_linear_unit and config.activation_func is torch.nn.functional.silu
    assert isinstance(run.mok, MoKConfig)
    args = megatron_lm_parser().parse_args(run.megatron_lm_args())
    assert args.num_experts == model["num_moe_experts"]
    assert args.hidden_size == model["hidden_size"]
    assert args.moe_token_dispatcher_type == "mok" and args.swiglu and args.mock_data
    assert args.expert_model_parallel_size == run.parallelism.expert_model_parallel_size
    assert args.untie_embeddings_and_output_weights == (
        not model.get("share_embeddings_and_output_weights", True)
    )
    assert args.mok_minibatch_size == run.mok.minibatch_size


@pytest.mark.parametrize("path", [p for p in RUN_FILES if "nvl72" in p.stem], ids=lambda p: p.stem)
def test_rack_files_fill_one_nvl72_rack(path):
    assert load_run_config(path).parallelism.world_size() == 72


def test_tiny_demo_is_two_cpu_ranks():
    run = load_run_config(TINY)
    assert run.parallelism.world_size() == 2 and run.training.resolved_device() == "cpu"


def _tiny_doc() -> dict:
    return yaml.safe_load(TINY.read_text())


@pytest.mark.parametrize(
    "section,key,value,message",
    [
        (
            "model",
            "hiden_size",
            64,
            r"unknown key 'model.hiden_size'; did you mean 'hidden_size'\?",
        ),
        ("training", "lr_rate", 1.0, r"unknown key 'training.lr_rate'; did you mean 'lr'\?"),
        ("mok", "minibatch", 256, r"section 'mok:'.*unknown MoKConfig key"),
        ("mok", "minibatch_size", 100, r"minibatch_size=100 must be a positive multiple of 128"),
        ("model", "expert_model_parallel_size", 2, r"belongs in the 'parallelism:' section"),
        ("model", "params_dtype", "bf16", r"'model.params_dtype' is set through training.dtype"),
        ("mok_layer", "fused", True, r"unknown key 'mok_layer.fused'; did you mean"),
    ],
)
def test_mistakes_name_the_file_and_the_key(section, key, value, message):
    doc = _tiny_doc()
    doc[section][key] = value
    with pytest.raises(ValueError, match=message) as info:
        run_config_from_dict(doc, source="tiny.yaml")
    assert str(info.value).startswith("tiny.yaml")


def test_unknown_section_and_missing_required_key():
    doc = _tiny_doc()
    doc["modle"] = {}
    with pytest.raises(ValueError, match=r"unknown section 'modle'; did you mean 'model'\?"):
        run_config_from_dict(doc)
    doc = _tiny_doc()
    del doc["model"]["num_moe_experts"]
    with pytest.raises(ValueError, match=r"'model.num_moe_experts' is required"):
        run_config_from_dict(doc)


def test_dispatcher_override_and_layer_params():
    run = load_run_config(TINY)
    assert run.transformer_config("alltoall").moe_token_dispatcher_type == "alltoall"
    params = run.layer_params()
    assert params["mok_config"] == run.mok and params["backend"] == "auto"


def test_cuda_knobs_reach_the_config_and_the_command_line():
    doc = _tiny_doc()
    doc["mok"] = {**(doc.get("mok") or {}), "expert_gemm": "l1,l2", "wait_timeout_ms": 30_000}
    run = run_config_from_dict(doc, source="tiny.yaml")
    assert run.mok.expert_gemm == "l1,l2" and run.mok.wait_timeout_ms == 30_000
    args = megatron_lm_parser().parse_args(run.megatron_lm_args())
    assert args.mok_expert_gemm == "l1,l2" and args.mok_wait_timeout_ms == 30_000
    doc["mok"]["expert_gemm"] = "l3"
    with pytest.raises(ValueError, match=r"tiny.yaml: section 'mok:'.*expert_gemm='l3'"):
        run_config_from_dict(doc, source="tiny.yaml")
