"""One YAML file → Megatron's TransformerConfig / Megatron-LM flags, MoKConfig and the EP groups.

A run file has five sections; every key is checked, and an unknown one is an error that names
the file, the section, the key and the closest known key::

    model:        TransformerConfig fields (MLATransformerConfig's with multi_latent_attention),
                  plus GPT-level keys: vocab_size, seq_length, position_embedding_type,
                  rotary_base, rotary_percent, share_embeddings_and_output_weights, swiglu
    parallelism:  tensor / pipeline / expert / expert-tensor / context parallel sizes,
                  sequence_parallel, data_parallel_size (ranks to spawn without torchrun)
    training:     micro/global batch, iterations, optimizer, seed, dtype, device
    mok:          functional.MoKConfig fields (the knobs, cuda_forward, expert_gemm,
                  wait_timeout_ms, bwd_schedule)
    mok_layer:    MoKMoELayer options: fused_experts, fuse_shared_experts, backend,
                  max_local_tokens

``load_run_config(path)`` returns a ``MoKRunConfig``; its methods give the TransformerConfig,
the GPTModel arguments, the Megatron-LM command line, and set up Megatron's process groups.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "LayerOptions",
    "MoKRunConfig",
    "ParallelismConfig",
    "TrainingConfig",
    "load_run_config",
    "run_config_from_dict",
]

SECTIONS = ("model", "parallelism", "training", "mok", "mok_layer")

#: model keys that are GPTModel / Megatron-LM arguments rather than TransformerConfig fields.
GPT_KEYS = {
    "vocab_size": 1024,
    "seq_length": 128,
    "position_embedding_type": "rope",
    "rotary_base": 10000,
    "rotary_percent": 1.0,
    "share_embeddings_and_output_weights": True,
    "swiglu": True,
}
#: TransformerConfig fields that another section (or the loader) owns.
_OWNED_ELSEWHERE = {
    "params_dtype": "training.dtype",
    "bf16": "training.dtype",
    "fp16": "training.dtype",
    "pipeline_dtype": "training.dtype",
    "activation_func": "model.swiglu (true: SwiGLU, the only MLP MoK computes)",
    "gated_linear_unit": "model.swiglu",
    "use_cpu_initialization": "training.device",
}


@dataclass
class ParallelismConfig:
    """Process-group sizes (Megatron's names). data_parallel_size only sets how many ranks
    ``scripts/pretrain_gpt_mok.py`` spawns without torchrun (None: the fewest that fit)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    data_parallel_size: int | None = None

    def world_size(self) -> int:
        """Ranks to spawn: TP x CP x PP x DP, with DP covering EP x ETP when not given."""
        tp_cp = self.tensor_model_parallel_size * self.context_parallel_size
        if self.data_parallel_size is not None:
            return tp_cp * self.data_parallel_size * self.pipeline_model_parallel_size
        expert = self.expert_model_parallel_size * self.expert_tensor_parallel_size
        return max(tp_cp, expert) * self.pipeline_model_parallel_size


@dataclass
class TrainingConfig:
    """The training loop of ``scripts/pretrain_gpt_mok.py`` (mock data, Adam)."""

    micro_batch_size: int = 2
    global_batch_size: int | None = None  # None: micro_batch_size x data-parallel size
    train_iters: int = 20
    lr: float = 1.0e-3
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    seed: int = 1234
    dtype: str = "float32"  # float32 | bfloat16
    device: str = "auto"  # auto (cuda if available) | cpu | cuda
    recompute_granularity: str | None = None  # None | selective | full

    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


@dataclass
class LayerOptions:
    """``MoKMoELayer`` arguments (see its docstring)."""

    fused_experts: bool = True
    fuse_shared_experts: bool | None = None
    backend: str = "auto"
    max_local_tokens: int | None = None


@dataclass
class MoKRunConfig:
    """A parsed, checked run file. ``model`` holds the TransformerConfig / GPT keys as given."""

    model: dict[str, Any]
    parallelism: ParallelismConfig
    training: TrainingConfig
    mok: Any  # functional.MoKConfig
    layer: LayerOptions
    path: str | None = None
    dispatcher: str = "mok"
    extra: dict[str, Any] = field(default_factory=dict)

    def gpt(self, key: str):
        """A GPT-level model key, or its default."""
        return self.model.get(key, GPT_KEYS[key])

    def transformer_config(self, dispatcher: str | None = None):
        """Megatron's TransformerConfig (MLATransformerConfig with multi_latent_attention)."""
        cls = _config_class(self.model)
        tc_fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in self.model.items() if k in tc_fields}
        values.update(dataclasses.asdict(self.parallelism))
        values.pop("data_parallel_size")
        dtype = self.training.torch_dtype()
        values.update(
            params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
            use_cpu_initialization=self.training.resolved_device() == "cpu",
            moe_token_dispatcher_type=dispatcher or self.dispatcher,
            recompute_granularity=self.training.recompute_granularity,
        )  # fmt: skip
        values.setdefault("ffn_hidden_size", 4 * values["hidden_size"])
        values.setdefault("moe_ffn_hidden_size", values["ffn_hidden_size"])
        if self.gpt("swiglu"):
            values.update(gated_linear_unit=True, activation_func=F.silu)
        if values.get("recompute_granularity") == "full":
            values.setdefault("recompute_method", "uniform")
            values.setdefault("recompute_num_layers", 1)
        return cls(**values)

    def gpt_model_kwargs(self) -> dict[str, Any]:
        """GPTModel's keyword arguments besides config and the layer spec."""
        return {
            "vocab_size": self.gpt("vocab_size"),
            "max_sequence_length": self.gpt("seq_length"),
            "position_embedding_type": self.gpt("position_embedding_type"),
            "rotary_base": self.gpt("rotary_base"),
            "rotary_percent": self.gpt("rotary_percent"),
            "share_embeddings_and_output_weights": self.gpt("share_embeddings_and_output_weights"),
        }

    def layer_params(self) -> dict[str, Any]:
        """``MoKMoELayer`` keyword arguments for the layer spec."""
        params = dataclasses.asdict(self.layer)
        params.pop("fused_experts")
        return {"mok_config": self.mok, **params}

    def initialize_model_parallel(self) -> None:
        """Megatron's process groups (TP, PP, CP, EP, ETP, DP) on the initialised world."""
        from megatron.core import parallel_state

        p = self.parallelism
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=p.tensor_model_parallel_size,
            pipeline_model_parallel_size=p.pipeline_model_parallel_size,
            context_parallel_size=p.context_parallel_size,
            expert_model_parallel_size=p.expert_model_parallel_size,
            expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        )

    def megatron_lm_args(self) -> list[str]:
        """The same run as Megatron-LM ``pretrain_gpt.py`` flags (mock data, NullTokenizer)."""
        from .megatron_lm_flags import run_config_to_flags

        return run_config_to_flags(self)


# ----------------------------------------------------------------------------------- loading
def load_run_config(path: str | Path) -> MoKRunConfig:
    """Read and check a run file (see the module docstring)."""
    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    return run_config_from_dict(doc, source=str(path))


def run_config_from_dict(doc: dict[str, Any], source: str = "<dict>") -> MoKRunConfig:
    """The checked run config for a parsed YAML document."""
    from mok_megatron.functional import MoKConfig

    if not isinstance(doc, dict):
        raise ValueError(f"{source}: a run file is a mapping of sections {SECTIONS}")
    _reject_unknown(source, "", doc, SECTIONS)
    sections = {name: doc.get(name) or {} for name in SECTIONS}
    for name, body in sections.items():
        if not isinstance(body, dict):
            raise ValueError(f"{source}: section '{name}:' must be a mapping, got {body!r}")
    model = _checked_model(source, sections["model"])
    try:
        mok = MoKConfig.from_dict(sections["mok"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: section 'mok:': {e}") from None
    return MoKRunConfig(
        model=model,
        parallelism=_dataclass_section(source, "parallelism", ParallelismConfig, sections),
        training=_dataclass_section(source, "training", TrainingConfig, sections),
        mok=mok,
        layer=_dataclass_section(source, "mok_layer", LayerOptions, sections),
        path=source,
        dispatcher=model.pop("moe_token_dispatcher_type", "mok"),
    )


def _checked_model(source: str, model: dict[str, Any]) -> dict[str, Any]:
    for key, owner in _OWNED_ELSEWHERE.items():
        if key in model:
            raise ValueError(f"{source}: 'model.{key}' is set through {owner}; remove it")
    parallel = {f.name for f in dataclasses.fields(ParallelismConfig)}
    for key in parallel & set(model):
        raise ValueError(f"{source}: 'model.{key}' belongs in the 'parallelism:' section")
    allowed = _model_keys(model) - set(_OWNED_ELSEWHERE) - parallel
    _reject_unknown(source, "model.", model, allowed)
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_moe_experts"):
        if key not in model:
            raise ValueError(f"{source}: 'model.{key}' is required")
    return dict(model)


def _model_keys(model: dict[str, Any]) -> set[str]:
    cls = _config_class(model)
    return {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")} | set(GPT_KEYS)


def _config_class(model: dict[str, Any]):
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    return MLATransformerConfig if model.get("multi_latent_attention") else TransformerConfig


def _dataclass_section(source, name, cls, sections):
    body = sections[name]
    _reject_unknown(source, f"{name}.", body, {f.name for f in dataclasses.fields(cls)})
    return cls(**body)


def _reject_unknown(source: str, where: str, given: dict, allowed) -> None:
    for key in given:
        if key not in allowed:
            close = _closest(str(key), allowed)
            hint = f"; did you mean '{close}'?" if close else ""
            what = "section" if not where else "key"
            raise ValueError(
                f"{source}: unknown {what} '{where}{key}'{hint} "
                f"(known: {_known_summary(where, allowed)})"
            )


def _closest(key: str, allowed) -> str | None:
    """The known key a typo most likely meant: a close spelling, else one containing the other."""
    close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
    if close:
        return close[0]
    related = sorted(
        (a for a in allowed if a in key or key in a), key=lambda a: abs(len(a) - len(key))
    )
    return related[0] if related else None


def _known_summary(where: str, allowed) -> str:
    if where == "model.":
        return "TransformerConfig fields and " + ", ".join(sorted(GPT_KEYS))
    return ", ".join(sorted(allowed))
