"""Run an unmodified Megatron-LM script with MoK: ``python -m mok_megatron.megatron.launch SCRIPT
ARGS...`` (under torchrun: ``torchrun ... -m mok_megatron.megatron.launch pretrain_gpt.py ...``).

Before running SCRIPT as ``__main__`` it makes three additions to Megatron-LM, all no-ops unless
the command line says ``--moe-token-dispatcher-type mok``:

1. ``megatron.training.arguments.parse_args`` also calls ``add_mok_args``, so ``mok`` is a valid
   dispatcher and ``--mok-config`` / ``--mok-*`` parse (after the script's own
   ``extra_args_provider``, if any).
2. Megatron-Core's GPT spec builders (``get_gpt_decoder_block_spec``,
   ``get_gpt_layer_local_spec``, ``get_gpt_layer_with_transformer_engine_spec``,
   ``get_gpt_decoder_layer_specs``) return their spec with the MoE layers made MoK layers
   (``mokify_spec``), carrying the ``MoKConfig`` from the flags. So ``gpt_builders.py`` builds a
   MoK model for every spec path it takes (``--spec`` given or not, TE or local, moe_layer_freq).
3. ``megatron.training.training.training_log``, which runs after every iteration once the loss
   scale has reached the host, then calls ``functional.poll_errors()``: a capacity overflow that
   a pass recorded on the device (CUDA-graph replays included) raises there, at no extra sync.
"""

from __future__ import annotations

import functools
import runpy
import sys
from pathlib import Path

__all__ = ["install", "main"]

_SPEC_BUILDERS = (
    "get_gpt_decoder_block_spec",
    "get_gpt_decoder_layer_specs",
    "get_gpt_layer_local_spec",
    "get_gpt_layer_with_transformer_engine_spec",
)
_INSTALLED = False


def _wants_mok(argv: list[str]) -> bool:
    for i, arg in enumerate(argv):
        if arg == "--moe-token-dispatcher-type" and i + 1 < len(argv):
            return argv[i + 1] == "mok"
        if arg == "--moe-token-dispatcher-type=mok":
            return True
    return False


def _chain_arg_providers():
    """Make Megatron-LM's parse_args add the MoK flags after the script's own provider."""
    from megatron.training import arguments

    from .arguments import add_mok_args

    original = arguments.parse_args

    @functools.wraps(original)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return add_mok_args(parser)

        return original(provider, ignore_unknown_args)

    arguments.parse_args = parse_args


def _mokify_spec_builders():
    """Wrap Megatron-Core's GPT spec builders so their MoE layers come out as MoK layers."""
    from megatron.core.models.gpt import gpt_layer_specs

    from .layer_specs import mokify_spec

    def wrap(builder):
        @functools.wraps(builder)
        def mok_builder(*args, **kwargs):
            # mok_config=None: the layer reads the parsed --mok-* flags
            return mokify_spec(builder(*args, **kwargs), mok_config=None)

        return mok_builder

    for name in _SPEC_BUILDERS:
        setattr(gpt_layer_specs, name, wrap(getattr(gpt_layer_specs, name)))


def _poll_errors_after_logging():
    """Make Megatron-LM's per-iteration training_log end with ``functional.poll_errors()``."""
    from megatron.training import training

    from mok_megatron import functional

    original = training.training_log

    @functools.wraps(original)
    def training_log(*args, **kwargs):
        result = original(*args, **kwargs)
        functional.poll_errors()
        return result

    training.training_log = training_log


def install() -> None:
    """Apply the additions (idempotent). Call before the script imports ``gpt_builders``."""
    global _INSTALLED
    if _INSTALLED:
        return
    _chain_arg_providers()
    _mokify_spec_builders()
    _poll_errors_after_logging()
    _INSTALLED = True


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    script, script_args = argv[0], argv[1:]
    if _wants_mok(script_args):
        install()
    sys.argv = [script, *script_args]
    sys.path.insert(0, str(Path(script).resolve().parent))  # gpt_builders.py, model_provider.py
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
