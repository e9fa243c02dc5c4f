"""A run file → Megatron-LM ``pretrain_gpt.py`` flags, spelled by Megatron-LM's own parser.

Each key is looked up among the parser's actions by destination, so flag spellings and boolean
forms (``--disable-bias-linear``, ``--untie-embeddings-and-output-weights``, ``--no-*``) come from
Megatron-LM itself. ``megatron.training`` ships in the megatron-core wheel.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from .arguments import add_mok_args, mok_flag_name

__all__ = ["megatron_lm_parser", "run_config_to_flags"]

#: TransformerConfig / run-file names whose Megatron-LM destination differs.
_DEST = {
    "num_moe_experts": "num_experts",
    "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
    "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers",
    "share_embeddings_and_output_weights": "untie_embeddings_and_output_weights",
}
_INVERTED = {"share_embeddings_and_output_weights"}  # true here = flag absent there


def megatron_lm_parser() -> argparse.ArgumentParser:
    """Megatron-LM's full argument parser with the MoK flags added."""
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    return add_mok_args(add_megatron_arguments(parser))


def run_config_to_flags(run) -> list[str]:
    """``MoKRunConfig`` → argv for ``pretrain_gpt.py`` (through the MoK launcher)."""
    actions = {a.dest: a for a in megatron_lm_parser()._actions}
    flags = ["--moe-token-dispatcher-type", run.dispatcher, "--mock-data"]
    flags += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(run.gpt("vocab_size"))]
    flags += ["--seq-length", str(run.gpt("seq_length"))]
    flags += ["--max-position-embeddings", str(run.gpt("seq_length"))]
    model = {k: v for k, v in run.model.items() if k not in ("vocab_size", "seq_length")}
    if model.get("num_query_groups"):
        flags.append("--group-query-attention")
    if "share_embeddings_and_output_weights" not in model:
        model["share_embeddings_and_output_weights"] = True
    for key, value in {**model, **_parallel_and_training(run)}.items():
        flags += _flag(actions, key, value)
    for key, value in run.mok.to_dict().items():
        if isinstance(value, bool):  # --mok-x / --no-mok-x (argparse.BooleanOptionalAction)
            flags.append(mok_flag_name(key).replace("--", "--" if value else "--no-", 1))
        else:
            flags += [mok_flag_name(key), str(value)]
    return flags


def _parallel_and_training(run) -> dict[str, Any]:
    p = dataclasses.asdict(run.parallelism)
    p.pop("data_parallel_size")
    t = run.training
    return {
        **p, "micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size,
        "train_iters": t.train_iters, "lr": t.lr, "weight_decay": t.weight_decay,
        "clip_grad": t.clip_grad, "seed": t.seed, "bf16": t.dtype == "bfloat16",
        "recompute_granularity": t.recompute_granularity,
    }  # fmt: skip


def _flag(actions: dict, key: str, value: Any) -> list[str]:
    """One key's flags ([] when the value is Megatron-LM's default or None)."""
    dest = _DEST.get(key, key)
    if key in _INVERTED:
        value = not value
    action = actions.get(dest)
    if action is None:
        raise ValueError(
            f"'{key}' has no Megatron-LM flag (no argument with dest '{dest}'); drop it from the "
            "run file or set it in Megatron-LM by hand"
        )
    if value is None:
        return []
    option = action.option_strings[0]
    if isinstance(action, argparse._StoreTrueAction):
        return [option] if value else []
    if isinstance(action, argparse._StoreFalseAction):
        return [] if value else [option]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [option if value else "--no-" + option[2:]]
    if isinstance(value, list) and action.nargs in ("+", "*"):
        return [option, *(str(v) for v in value)]
    if isinstance(value, list):  # a pattern such as --moe-layer-freq: no spaces allowed
        return [option, "[" + ",".join(str(v) for v in value) + "]"]
    return [option, str(value)]
