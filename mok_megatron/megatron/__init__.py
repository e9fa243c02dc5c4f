"""Layer 3: MoK as a Megatron-Core (0.19) plugin — ``--moe-token-dispatcher-type mok``.

Importing this package imports ``megatron.core``. The Megatron-LM launcher is
``python -m mok_megatron.megatron.launch SCRIPT ARGS...``; the YAML runs are
``scripts/pretrain_gpt_mok.py --config FILE``. See docs/MEGATRON.md.
"""

from .arguments import add_mok_args, mok_config_from_args, resolve_mok_config
from .experts import MoKExperts
from .layer_specs import (
    get_gpt_decoder_block_mok_spec,
    get_gpt_layer_mok_spec,
    get_mok_moe_module_spec,
    mokify_spec,
)
from .moe_layer import MOK_DISPATCHER_TYPE, MoKMoELayer
from .token_dispatcher import MoKRouting, MoKTokenDispatcher, routing_to_topk

__all__ = [
    "MOK_DISPATCHER_TYPE",
    "MoKExperts",
    "MoKMoELayer",
    "MoKRouting",
    "MoKTokenDispatcher",
    "add_mok_args",
    "get_gpt_decoder_block_mok_spec",
    "get_gpt_layer_mok_spec",
    "get_mok_moe_module_spec",
    "mok_config_from_args",
    "mokify_spec",
    "resolve_mok_config",
    "routing_to_topk",
]
