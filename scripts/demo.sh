#!/usr/bin/env bash
# The main job: set up .venv if needed, then train the tiny GPT-MoE with
# --moe-token-dispatcher-type mok and compare its losses with Megatron's alltoall dispatcher.
# On CPU (gloo, EP 2) by default; on GPUs (NCCL, bfloat16, the CUDA backend) when there are any.
# Extra arguments go to scripts/pretrain_gpt_mok.py.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)
if [ "${gpus:-0}" -ge 2 ]; then config=configs/tiny_gpu_ep2.yaml
elif [ "${gpus:-0}" -eq 1 ]; then config=configs/tiny_gpu_ep1.yaml
else
  config=configs/tiny_cpu.yaml
  export MOK_SKIP_CUDA="${MOK_SKIP_CUDA:-1}"  # no GPU to run kernels on: skip their compile
fi
venv="$("$root/scripts/setup_env.sh")"
cd "$root"
echo "[demo] $config"
exec "$venv/bin/python" scripts/pretrain_gpt_mok.py --config "$config" --compare-dispatcher alltoall "$@"
