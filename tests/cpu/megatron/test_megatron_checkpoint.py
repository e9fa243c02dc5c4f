"""Distributed checkpoints move between Megatron's experts and MoKExperts in both directions.

MoKExperts' sharded state dict is Megatron's SequentialMLP's, tensor for tensor (keys, global
shapes, offsets, replica ids, and the per-expert ``_extra_state`` objects), in the default and
the ``singleton_local_shards`` layouts; alltoall -> mok -> alltoall round trips are exact in
both, and the loaded fused gate/up weight is Megatron's fc1 halves interleaved. The fused weight's
initial values are SequentialMLP's fc1 [gate; up] and fc2, drawn in its per-expert order.
"""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import pytest
import torch

from mok_megatron.ops import interleave_gate_up
from mok_megatron.testing import run_ranks

LAYOUTS = {"default": None, "singleton": {"singleton_local_shards": True}}


def _flat_metadata(layer, metadata=None) -> list[tuple]:
    """Every ShardedTensor / ShardedObject of a layer, without data, sorted."""
    from megatron.core.dist_checkpointing.mapping import apply_factories
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    sd = layer.sharded_state_dict(prefix="mlp.", sharded_offsets=((0, 0, 1),), metadata=metadata)
    apply_factories(sd)
    flat, _ = extract_sharded_base(sd)
    rows = []
    for item in _values(flat):
        rows.append((
            type(item).__name__, item.key, tuple(item.global_shape), tuple(item.global_offset),
            tuple(getattr(item, "axis_fragmentations", None) or ()), item.replica_id,
            tuple(item.data.shape) if isinstance(item.data, torch.Tensor) else None,
        ))  # fmt: skip
    return sorted(rows, key=repr)


def _values(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _values(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _values(v)
    else:
        yield tree


def _checkpoint_rank(rank, world_size, root) -> dict:
    """Everything this module checks, in one spawn of two gloo ranks."""
    from mok_megatron.megatron import parity

    parity.init_megatron_parallel(world_size)
    case = parity.LayerCase(topk=2, shared_ffn=24)
    result = {}
    for name, meta in LAYOUTS.items():
        kinds = ("alltoall", "mok_fused", "alltoall")
        original, mok, back = (parity.build_moe_layer(case, k, world_size) for k in kinds)
        result[f"metadata/{name}"] = (_flat_metadata(original, meta), _flat_metadata(mok, meta))
        result[f"fresh_equal/{name}"] = _same_state(original.state_dict(), back.state_dict())
        parity.share_weights(original, mok, os.path.join(root, name, "to_mok"), metadata=meta)
        parity.share_weights(mok, back, os.path.join(root, name, "from_mok"), metadata=meta)
        result[f"loaded/{name}"] = _loaded_as_megatron(original, mok, case.ffn)
        result[f"round_trip/{name}"] = _same_state(original.state_dict(), back.state_dict())
    result["allreduce"] = {n: p.allreduce for n, p in mok.experts.named_parameters()}
    return result


def _loaded_as_megatron(original, mok, ffn: int) -> bool:
    """MoK's gate_up is Megatron's fc1 [gate; up] halves interleaved and its down is fc2, expert
    by expert."""
    experts = original.experts.local_experts
    fc1 = torch.stack([e.linear_fc1.weight for e in experts])
    fc2 = torch.stack([e.linear_fc2.weight for e in experts])
    gate_up = interleave_gate_up(fc1[:, :ffn], fc1[:, ffn:])
    same_fc1 = torch.equal(mok.experts.weight_gate_up, gate_up)
    return same_fc1 and torch.equal(mok.experts.weight_down, fc2)


def _same_state(a: dict, b: dict) -> bool:
    tensors = [k for k in a if isinstance(a[k], torch.Tensor)]
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in tensors)


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as root:
        return run_ranks(_checkpoint_rank, 2, root)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_state_dict_is_megatrons(results, layout):
    for ref, mok in (r[f"metadata/{layout}"] for r in results):
        assert mok == ref


@pytest.mark.parametrize("layout", LAYOUTS)
def test_alltoall_checkpoint_loads_into_mok(results, layout):
    assert all(r[f"loaded/{layout}"] for r in results)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpoint_round_trip_alltoall_mok_alltoall(results, layout):
    assert not any(r[f"fresh_equal/{layout}"] for r in results)  # the trip has work to do
    assert all(r[f"round_trip/{layout}"] for r in results)


def test_expert_parameters_are_not_allreduced(results):
    """Megatron's DDP reduces ``allreduce=False`` parameters over expert-data-parallel only."""
    expected = {"weight_gate_up": False, "weight_down": False}
    assert all(r["allreduce"] == expected for r in results)


def _experts_config(**overrides):
    from mok_megatron.megatron import parity

    config = parity.tiny_moe_config(parity.LayerCase(), "mok", ep_size=1)  # CPU init, std 0.1
    for field, value in overrides.items():
        setattr(config, field, value)
    return config


def test_reset_parameters_draws_sequential_mlps_order():
    """Seeded, with CPU initialisation, the fused weight holds what SequentialMLP's linears held:
    per expert a float32 fc1 [2I, H] = [gate; up] by init_method, then fc2 [H, I] by
    output_layer_init_method, from the default generator (test_megatron_expert_init checks
    this against Megatron's modules)."""
    from mok_megatron.megatron.experts import MoKExperts

    config, num_local = _experts_config(), 3
    torch.manual_seed(5)
    experts = MoKExperts(num_local, config, pg_collection=SimpleNamespace(ep=None, expt_dp=None))
    torch.manual_seed(5)
    i, h = config.moe_ffn_hidden_size, config.hidden_size
    fc1, down = torch.empty(num_local, 2 * i, h), torch.empty(num_local, h, i)
    for e in range(num_local):
        config.init_method(fc1[e])
        config.output_layer_init_method(down[e])
    blocks = experts.weight_gate_up.detach().view(num_local, i // 8, 2, 8, h)  # 8 gate, 8 up rows
    assert torch.equal(blocks[:, :, 0].reshape(num_local, i, h), fc1[:, :i])
    assert torch.equal(blocks[:, :, 1].reshape(num_local, i, h), fc1[:, i:])
    assert torch.equal(experts.weight_down.detach(), down)


def test_intermediate_size_must_fill_interleave_blocks():
    from mok_megatron.megatron.experts import check_mok_experts_config

    with pytest.raises(ValueError, match="moe_ffn_hidden_size=44 must be a multiple of 8"):
        check_mok_experts_config(_experts_config(moe_ffn_hidden_size=44))
