"""Distributed checkpoints move between Megatron's experts and MoKExperts in both directions.

MoKExperts' sharded state dict is Megatron's SequentialMLP's, tensor for tensor (keys, global
shapes, offsets, replica ids, and the per-expert ``_extra_state`` objects), in the default and
the ``singleton_local_shards`` layouts; alltoall -> mok -> alltoall round trips are exact.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from mok_megatron.testing import run_ranks


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
    original = parity.build_moe_layer(case, "alltoall", world_size)
    mok = parity.build_moe_layer(case, "mok_fused", world_size)
    back = parity.build_moe_layer(case, "alltoall", world_size)
    result = {
        f"metadata/{name}": (_flat_metadata(original, meta), _flat_metadata(mok, meta))
        for name, meta in (("default", None), ("singleton", {"singleton_local_shards": True}))
    }
    parity.share_weights(original, mok, os.path.join(root, "to_mok"))
    parity.share_weights(mok, back, os.path.join(root, "from_mok"))
    result["loaded"] = _loaded_as_megatron(original, mok, case.ffn)
    result["round_trip"] = _same_state(original.state_dict(), back.state_dict())
    result["allreduce"] = {n: p.allreduce for n, p in mok.experts.named_parameters()}
    return result


def _loaded_as_megatron(original, mok, ffn: int) -> bool:
    """MoK's gate / up / down are Megatron's fc1 [gate; up] halves and fc2, expert by expert."""
    experts = original.experts.local_experts
    fc1 = torch.stack([e.linear_fc1.weight for e in experts])
    fc2 = torch.stack([e.linear_fc2.weight for e in experts])
    return (
        torch.equal(mok.experts.weight_gate, fc1[:, :ffn])
        and torch.equal(mok.experts.weight_up, fc1[:, ffn:])
        and torch.equal(mok.experts.weight_down, fc2)
    )


def _same_state(a: dict, b: dict) -> bool:
    tensors = [k for k in a if isinstance(a[k], torch.Tensor)]
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in tensors)


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as root:
        return run_ranks(_checkpoint_rank, 2, root)


@pytest.mark.parametrize("layout", ["default", "singleton"])
def test_sharded_state_dict_is_megatrons(results, layout):
    for ref, mok in (r[f"metadata/{layout}"] for r in results):
        assert mok == ref


def test_alltoall_checkpoint_loads_into_mok(results):
    assert all(r["loaded"] for r in results)


def test_checkpoint_round_trip_alltoall_mok_alltoall(results):
    assert all(r["round_trip"] for r in results)


def test_expert_parameters_are_not_allreduced(results):
    """Megatron's DDP reduces ``allreduce=False`` parameters over expert-data-parallel only."""
    expected = {"weight_gate": False, "weight_up": False, "weight_down": False}
    assert all(r["allreduce"] == expected for r in results)
