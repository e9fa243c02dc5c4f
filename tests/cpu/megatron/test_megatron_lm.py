"""Megatron-LM's real ``pretrain_gpt.py`` (core_v0.19.0, tests/fixtures/) through the launcher, on
CPU: its argument parsing and validation, its config container and the real model builder
(``megatron.training.models.gpt.GPTModelBuilder``) give MoK MoE layers on every spec path.

Megatron's ``pretrain()`` asserts CUDA before it builds the model, so the child replaces it with
what it does next on this path: process groups (gloo), the RNG tracker (the CPU shim) and
``builder.build_model``; the GPU run of the whole script is recorded in docs/MEGATRON.md.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PRETRAIN_GPT = ROOT / "tests" / "fixtures" / "megatron_lm_core_v0_19_0" / "pretrain_gpt.py"

PROBE = """
    import sys

    import torch.distributed as dist

    import megatron.training
    from mok_megatron.megatron import cpu_shim, launch

    cpu_shim.install()


    def pretrain(full_config, *args, **kwargs):  # pretrain()'s model building, without CUDA
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        dist.init_process_group("gloo")
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(1234)
        builder = full_config.model.get_builder_cls()(full_config.model)
        model = builder.build_model(ProcessGroupCollection.use_mpu_process_groups(),
                                    pre_process=True, post_process=True)
        layers = [type(layer.mlp).__name__ for layer in model.decoder.layers]
        mtp = [type(layer.mtp_model_layer.mlp).__name__ for layer in model.mtp.layers
               ] if getattr(model, "mtp", None) is not None else []
        print("PROBE", type(builder).__name__, layers, mtp, flush=True)


    megatron.training.pretrain = pretrain  # pretrain_gpt.py imports it when it runs
    launch.main(sys.argv[1:])
"""

# A tiny MoE GPT; the switches of fused kernels that need Apex are off (fixture README).
TINY = (
    "--transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion "
    "--no-rope-fusion --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 2 --num-experts 4 "
    "--moe-router-topk 2 --moe-ffn-hidden-size 64 --ffn-hidden-size 128 --swiglu "
    "--disable-bias-linear --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
    "--train-iters 1 --lr 1e-4 --distributed-backend gloo --use-cpu-initialization"
).split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe(tmp_path, *flags) -> str:
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(PROBE))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}  # fmt: skip
    cmd = [sys.executable, str(script), str(PRETRAIN_GPT), *TINY, *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert len(lines) == 1, done.stdout[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    "flags,want",
    [
        (["--moe-token-dispatcher-type", "alltoall"],
         "PROBE GPTModelBuilder ['MoELayer', 'MoELayer'] []"),
        (["--moe-token-dispatcher-type", "mok"],
         "PROBE GPTModelBuilder ['MoKMoELayer', 'MoKMoELayer'] []"),
        (["--moe-token-dispatcher-type", "mok", "--moe-layer-freq", "[0,1]"],
         "PROBE GPTModelBuilder ['MLP', 'MoKMoELayer'] []"),
        (["--moe-token-dispatcher-type", "mok", "--spec", "mok_megatron.megatron",
          "get_gpt_layer_mok_spec"],
         "PROBE GPTModelBuilder ['MoKMoELayer', 'MoKMoELayer'] []"),
        (["--moe-token-dispatcher-type", "mok", "--mtp-num-layers", "1",
          "--position-embedding-type", "rope"],
         "PROBE GPTModelBuilder ['MoKMoELayer', 'MoKMoELayer'] ['MoKMoELayer']"),
    ],
    ids=["alltoall", "mok", "dense_and_moe", "mok_spec", "mtp"],
)  # fmt: skip
def test_real_pretrain_gpt_builds_mok_layers(tmp_path, flags, want):
    assert _probe(tmp_path, *flags) == want
