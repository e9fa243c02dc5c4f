"""Run an unmodified Megatron-LM script with MoK: ``python -m mok_megatron.megatron.launch SCRIPT
ARGS...`` (under torchrun: ``torchrun ... -m mok_megatron.megatron.launch pretrain_gpt.py ...``).

Before running SCRIPT as ``__main__`` it makes three additions to Megatron-LM, all no-ops unless
the command line says ``--moe-token-dispatcher-type mok``:

1. ``megatron.training.arguments.parse_args`` also calls ``add_mok_args``, so ``mok`` is a valid
   dispatcher and ``--mok-config`` / ``--mok-*`` parse (after the script's own
   ``extra_args_provider``, if any).
2. Megatron-Core's ``GPTModel`` makes its MoE layers MoK layers (``mokify_spec`` on the layer
   spec and the multi-token-prediction block spec it is given, carrying the ``MoKConfig`` from
   the flags) before it builds anything. Every way Megatron-LM core_v0.19.0 builds a GPT model
   ends in that constructor: ``gpt_builders.py`` (``--spec`` or not, TE or local, block or layer
   specs, heterogeneous and experimental-attention specs) and ``megatron.training.models.gpt``
   (the config-container path ``pretrain_gpt.py`` takes), however they imported their spec
   builders. A spec that already has MoK layers is kept as it is (``--spec
   mok_megatron.megatron get_gpt_layer_mok_spec``). Other model classes (``HybridModel``,
   ``MambaModel``) are not changed.
3. ``megatron.training.training.training_log``, which runs after every iteration once the loss
   scale has reached the host, then calls ``functional.poll_errors()``: a capacity overflow that
   a pass recorded on the device (CUDA-graph replays included) raises there, at no extra sync.
"""

from __future__ import annotations

import functools
import inspect
import runpy
import sys
from pathlib import Path

__all__ = ["install", "main"]

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


def _mokify_gpt_models():
    """Make ``GPTModel`` build MoK MoE layers from whatever specs it is given."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from .layer_specs import mokify_spec

    original = GPTModel.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        for name in ("transformer_layer_spec", "mtp_block_spec"):
            if bound.arguments.get(name) is not None:
                # mok_config=None: the layer reads the parsed --mok-* flags
                bound.arguments[name] = mokify_spec(bound.arguments[name], mok_config=None)
        original(*bound.args, **bound.kwargs)

    GPTModel.__init__ = __init__


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
    """Apply the additions (idempotent). Call before the script builds its model."""
    global _INSTALLED
    if _INSTALLED:
        return
    _chain_arg_providers()
    _mokify_gpt_models()
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
