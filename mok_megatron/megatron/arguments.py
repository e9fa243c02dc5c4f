"""Megatron-LM command-line flags for MoK, generated from ``functional.MoKConfig``.

``add_mok_args(parser)`` is an ``extra_args_provider``: it adds ``mok`` to the choices of
``--moe-token-dispatcher-type`` (or adds that flag to a parser without it), ``--mok-config FILE``
(a YAML file with a ``mok:`` section) and one ``--mok-<field>`` flag per ``MoKConfig`` field, with
the field's help text. ``mok_config_from_args(args)`` resolves them: the dataclass defaults, then
the file, then the flags given on the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

__all__ = [
    "add_mok_args",
    "honour_megatron_fp8",
    "mok_config_from_args",
    "mok_flag_name",
    "resolve_mok_config",
]

DISPATCHER_FLAG = "--moe-token-dispatcher-type"
_STOCK_DISPATCHERS = ("allgather", "alltoall", "flex")


def mok_flag_name(field_name: str) -> str:
    """``minibatch_size`` → ``--mok-minibatch-size``."""
    return "--mok-" + field_name.replace("_", "-")


def add_mok_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the MoK flags to ``parser`` (Megatron-LM's or any other); returns the parser."""
    _allow_mok_dispatcher(parser)
    group = parser.add_argument_group(title="mok", description="MoK fused MoE layer")
    group.add_argument(
        "--mok-config", type=str, default=None, metavar="FILE",
        help="YAML file whose 'mok:' section sets MoKConfig; --mok-* flags override it.",
    )  # fmt: skip
    for f, hint in _config_fields():
        group.add_argument(mok_flag_name(f.name), dest=f"mok_{f.name}", default=None,
                           help=f"{f.metadata.get('help', '')} (default: {f.default!r})",
                           **_argparse_type(f, hint))  # fmt: skip
    return parser


def mok_config_from_args(args: argparse.Namespace):
    """args (with ``add_mok_args``' flags) → ``functional.MoKConfig``: defaults < file < flags.

    Megatron's own ``--fp8-format e4m3 --fp8-recipe blockwise``, where the args have them and
    neither the file nor a flag names ``expert_precision``, give ``fp8_blockwise`` here already
    (as ``honour_megatron_fp8`` does for a layer's config), so knobs that need it, such as
    ``--mok-fp8-backward dgrad``, validate with it."""
    from mok_megatron.functional import MoKConfig

    path = getattr(args, "mok_config", None)
    knobs = MoKConfig.yaml_knobs(path) if path else {}
    knobs.update({
        f.name: getattr(args, f"mok_{f.name}")
        for f, _ in _config_fields()
        if getattr(args, f"mok_{f.name}", None) is not None
    })  # fmt: skip
    fp8, recipe = getattr(args, "fp8", None), _recipe_name(getattr(args, "fp8_recipe", None))
    if "expert_precision" not in knobs and _megatron_asks_fp8_blockwise(fp8, recipe):
        knobs["expert_precision"] = "fp8_blockwise"
    return MoKConfig.from_dict(knobs)


def _recipe_name(recipe):
    return getattr(recipe, "value", recipe)  # an enum in some Megatron versions


def _megatron_asks_fp8_blockwise(fp8, recipe) -> bool:
    """Megatron's FP8 flags ask for what MoK runs as expert_precision="fp8_blockwise"."""
    return fp8 == "e4m3" and recipe == "blockwise"


def resolve_mok_config(value):
    """A MoKConfig from what a layer spec holds: a MoKConfig, a dict of fields, or None.

    None means Megatron-LM's parsed ``--mok-*`` flags when ``megatron.training`` has global
    args with them, else ``MoKConfig()``.
    """
    from mok_megatron.functional import MoKConfig

    if isinstance(value, MoKConfig):
        return value
    if isinstance(value, dict):
        return MoKConfig.from_dict(value)
    if value is not None:
        raise TypeError(f"mok_config must be a MoKConfig, a dict or None, got {type(value)}")
    args = _megatron_global_args()
    if args is not None and hasattr(args, "mok_config"):
        return mok_config_from_args(args)
    return MoKConfig()


def honour_megatron_fp8(mok_config, transformer_config):
    """The expert precision Megatron's own FP8 flags ask for, where MoK can give it.

    ``--fp8-format e4m3 --fp8-recipe blockwise`` (TransformerConfig ``fp8="e4m3"``,
    ``fp8_recipe="blockwise"``) is MoK's ``expert_precision="fp8_blockwise"``, with or without
    Transformer Engine: a config left at the default "bf16" takes it. Any other FP8 format or
    recipe leaves the MoK experts in BF16, with a warning that says so; an explicit
    ``--mok-expert-precision fp8_blockwise`` always wins."""
    import warnings

    fp8 = getattr(transformer_config, "fp8", None)
    if not fp8 or mok_config.expert_precision != "bf16":
        return mok_config
    recipe = _recipe_name(getattr(transformer_config, "fp8_recipe", None))
    if _megatron_asks_fp8_blockwise(fp8, recipe):
        return dataclasses.replace(mok_config, expert_precision="fp8_blockwise")
    warnings.warn(
        f"mok: Megatron's --fp8-format {fp8} --fp8-recipe {recipe} is not a precision the MoK "
        "experts run; they stay BF16 (MoK's FP8 is --fp8-format e4m3 --fp8-recipe blockwise, or "
        "--mok-expert-precision fp8_blockwise)",
        stacklevel=2,
    )
    return mok_config


def _megatron_global_args():
    try:
        from megatron.training import global_vars
    except ImportError:
        return None
    return getattr(global_vars, "_GLOBAL_ARGS", None)


def _config_fields():
    """(field, resolved type hint) for every MoKConfig field."""
    from mok_megatron.functional import MoKConfig

    hints = typing.get_type_hints(MoKConfig)
    return [(f, hints[f.name]) for f in dataclasses.fields(MoKConfig)]


def _argparse_type(f: dataclasses.Field, hint) -> dict:
    """argparse kwargs for one field: bool → --x/--no-x; choices from the field's metadata, a
    Literal type, or (for ``bwd_schedule``) ``functional.config.KNOWN_BWD_SCHEDULES``; else its type."""
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    choices = f.metadata.get("choices") or _literal_choices(hint) or _known_choices(f.name)
    if choices:
        return {"type": type(choices[0]), "choices": tuple(choices)}
    if hint in (int, float, str):
        return {"type": hint}
    if set(typing.get_args(hint)) == {int, str}:  # an int knob that may be "auto"
        return {"type": _int_or_auto, "metavar": "INT|auto"}
    raise TypeError(f"MoKConfig.{f.name}: no command-line form for type {hint}")


def _int_or_auto(text: str) -> int | str:
    from mok_megatron.functional.config import AUTO

    if text == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an int nor {AUTO!r}") from None


def _literal_choices(hint) -> tuple | None:
    return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None


def _known_choices(name: str) -> tuple | None:
    if name == "bwd_schedule":  # a plain str field whose values functional.config lists
        from mok_megatron.functional.config import KNOWN_BWD_SCHEDULES

        return KNOWN_BWD_SCHEDULES  # MoKConfig explains the ones not implemented
    if name == "cuda_forward":
        from mok_megatron.functional.config import CUDA_FORWARDS

        return CUDA_FORWARDS
    if name == "cuda_backward":
        from mok_megatron.functional.config import CUDA_BACKWARDS

        return CUDA_BACKWARDS
    if name == "bwd_wgrad":
        from mok_megatron.functional.config import BWD_WGRADS

        return BWD_WGRADS
    if name == "expert_precision":
        from mok_megatron.functional.config import EXPERT_PRECISIONS

        return EXPERT_PRECISIONS
    if name == "fp8_backward":
        from mok_megatron.functional.config import FP8_BACKWARDS

        return FP8_BACKWARDS
    return None


def _allow_mok_dispatcher(parser: argparse.ArgumentParser) -> None:
    """Extend Megatron's ``--moe-token-dispatcher-type`` choices with 'mok' (or add the flag)."""
    for action in parser._actions:
        if DISPATCHER_FLAG in action.option_strings:
            if action.choices is not None and "mok" not in action.choices:
                action.choices = (*action.choices, "mok")
            return
    parser.add_argument(
        DISPATCHER_FLAG, dest="moe_token_dispatcher_type", default="alltoall",
        choices=(*_STOCK_DISPATCHERS, "mok"), help="MoE token dispatcher; 'mok' is MoK's.",
    )  # fmt: skip
