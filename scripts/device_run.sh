#!/usr/bin/env bash
# The one command a recorded device run calls, with the prebuilt mok_megatron/_C*.so and .whl/
# (megatron-core, nvidia-cutlass) carried:
#   tests       scripts/gpu_check.sh: every single-GPU test, plus the multi-GPU tests when the
#               machine has 2 GPUs or more (JSON record)
#   bench_ep2   scripts/bench_moe.py at EP 2 (torchrun, 2 GPUs)
#   bench_ep1   scripts/bench_moe.py at EP 1
#   profile     scripts/profile_moe.py at EP 2 (2 GPUs) or EP 1 (one GPU)
#   fp8         scripts/bench_moe.py --mok-fp8 (BF16, FP8, FP8 with FP8 data gradients) and
#               scripts/fp8_accuracy.py --shapes scaled, at EP 1 (not in the default steps)
#   wgrad       the weight-gradient study at EP 1 (not in the default steps): the engine's
#               weight-gradient GEMMs, plain and into fp32 main_grad, cooperative / pingpong /
#               torch (scripts/bench_grouped_gemm.py), then the layer's forward + backward with
#               --mok-wgrad-pingpong, into main_grad and in .grad mode (there beside the same
#               engine steps in the default schedule); deepseek-v3 only where the GPU has the
#               memory for its fp32 main_grad (WGRAD_SHAPES overrides the layer's shapes)
#   targets     issues 13-15's layer benches at EP 1 (not in the default steps; deepseek-v3 needs an
#               H200's memory): each shape at 8192 and 16384 tokens with --mok-graph (the targets
#               table's records) and deepseek-v3's FP8 megakernel forward against BF16 in one
#               process (TARGET_SHAPES overrides the shapes)
#   rounds      the layer in macrobatch rounds at EP 1 (not in the default steps): bench_moe.py
#               --mok-macrobatch, the backward megakernel in rounds against stage 1's backward
#               after the same forward, 8192 tokens, about four rounds per shape (ROUNDS: the
#               shape:macrobatch_size pairs)
#   bwd_wgrad   the down weight's gradient inside the backward megakernel at EP 1 (not in the
#               default steps): bench_moe.py --mok-bwd-wgrad (MoKConfig.bwd_wgrad 'down' and
#               'down_interleaved' beside the default), 8192 tokens, into main_grad and in .grad
#               mode; deepseek-v3 where the GPU has its memory, else qwen3-30b-a3b and
#               mixtral-8x7b (BWD_WGRAD_SHAPES overrides)
#   acc_store   the fp32 accumulating weight gradient's two stores (the tile read back, or TMA
#               reduce-add) and 'auto' by rows a group at EP 1 (not in the default steps):
#               bench_grouped_gemm.py on qwen3-30b-a3b at 1x, 2x, 4x its rows and mixtral-8x7b at
#               0.25x, 0.5x, 1x, plus deepseek-v3 at 1x, 2x, 4x where the GPU has the memory for
#               its fp32 buffers (docs/GEMM.md's store table: grouped_gemm_report.py --store)
#   clock       the megakernels' timelines with the SMs' clock at EP 1 (not in the default steps):
#               scripts/megakernel_trace.py at 8192 tokens, the BF16 forward keeping h (rows as
#               the table picks them, then pulled), the FP8 forward and the backward
#   wgrad_cluster2  the engine's weight gradients in clusters of two CTAs (GemmTuning schedule
#               'cooperative_cluster2') against the cooperative schedule and torch at EP 1 (not in
#               the default steps): bench_grouped_gemm.py (impl mok_cluster2) on qwen3-30b-a3b at
#               1x and 2x its rows, mixtral-8x7b at 0.5x and 1x, deepseek-v3 at 1x (the plain ops;
#               the fp32 ones too where the GPU has the memory), then the layer's forward +
#               backward with --mok-wgrad-cluster2 on qwen3-30b-a3b at 8192 and 16384 tokens, in
#               .grad mode (beside the engine's cooperative weight gradients) and into main_grad
#   trace_ab    builds of the same Python tree (packed by scripts/extension_variants.sh pack, carried
#               in .devcarry) against each other on the megakernels' timelines (not in the default
#               steps): TRACE_AB_ROUNDS rounds (default 2), each running every build named in
#               TRACE_AB in turn (it is `use`d first, so the carried extension is replaced):
#               megakernel_trace.py --keep on TRACE_AB_SHAPES (default the three) and --fp8 on
#               TRACE_AB_FP8 (default deepseek-v3; empty: none) at 8192 tokens, into
#               megakernel_trace_<gpu>_<build>_ab_<round>[_fp8].json; for kernel changes whose
#               outputs are bitwise unchanged (the session 44 notes' cache hints)
#   order_block the forward's task order in blocks of 16 and of 8 m-tiles (MoKConfig.
#               megakernel_order_block) on the megakernels' timelines, one build (not in the default
#               steps): ORDER_BLOCK_ROUNDS rounds (default 2) of megakernel_trace.py --keep on the
#               three shapes and --fp8 on deepseek-v3 with --order-block 16, then 8, at 8192 and
#               16384 tokens, into megakernel_trace_<gpu>_<commit>-block<B>_ab[16k]_<round>[_fp8]
#               .json (perf_report --trace-ab's names; the records in one tarball)
# Everything lands in $OUT. Env: MOK_COMMIT (commit id: the device copy has no .git),
# BENCH_EP2_ARGS / BENCH_EP1_ARGS / PROFILE_ARGS / FP8_BENCH_ARGS (extra arguments),
# BENCH_TIMEOUT_S (per bench run), STEPS (default "tests bench_ep2 bench_ep1 profile" on 2+
# GPUs, "tests bench_ep1 profile" on one).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
NGPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
if [[ $NGPU -ge 2 ]]; then KIND=nvidia-h200-x$NGPU; DEFAULT="tests bench_ep2 bench_ep1 profile";
else KIND=nvidia-h200; DEFAULT="tests bench_ep1 profile"; fi
STEPS="${STEPS:-$DEFAULT}"
step() { [[ " $STEPS " == *" $1 "* ]]; }
# 1 where the GPU has the memory for deepseek-v3's layer and fp32 buffers (an H200), else 0.
big_gpu() { python3 -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory > 100e9))"; }
if step tests; then
  MOK_DEVICE_KIND="${MOK_DEVICE_KIND:-$KIND}" bash scripts/gpu_check.sh "$([[ $NGPU -ge 2 ]] && echo 2 || echo 0)" \
    > "$OUT/gpu_check.log" 2>&1
  echo "[device_run] gpu_check exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_check.log" | tail -12
fi
# The carried wheels (gpu_check.sh installs them too, for the tests step).
if [[ ! -d /tmp/site/megatron ]] && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD"
if step bench_ep2; then
  timeout "${BENCH_TIMEOUT_S:-240}" torchrun --standalone --nproc-per-node 2 scripts/bench_moe.py \
    --out "$OUT/bench_ep2.json" ${BENCH_EP2_ARGS:-} > "$OUT/bench_ep2.log" 2>&1
  echo "[device_run] bench EP 2 exit $?"; grep -E "speedup|skipped|Error" "$OUT/bench_ep2.log" | tail -20
fi
if step bench_ep1; then
  timeout "${BENCH_TIMEOUT_S:-240}" python3 scripts/bench_moe.py --out "$OUT/bench_ep1.json" \
    ${BENCH_EP1_ARGS:---shapes qwen3-30b-a3b,mixtral-8x7b} > "$OUT/bench_ep1.log" 2>&1
  echo "[device_run] bench EP 1 exit $?"; grep -E "speedup|skipped|Error" "$OUT/bench_ep1.log" | tail -14
fi
if step profile; then
  EP=$([[ $NGPU -ge 2 ]] && echo 2 || echo 1)
  timeout "${BENCH_TIMEOUT_S:-240}" torchrun --standalone --nproc-per-node "$EP" scripts/profile_moe.py \
    --out "$OUT/profile_ep$EP.json" ${PROFILE_ARGS:-} > "$OUT/profile.log" 2>&1
  echo "[device_run] profile exit $?"; grep -E "GPU time|Error" "$OUT/profile.log" | tail -6
fi
if step fp8; then
  timeout "${BENCH_TIMEOUT_S:-240}" python3 scripts/bench_moe.py --out "$OUT/bench_fp8.json" --mok-fp8 \
    ${FP8_BENCH_ARGS:---shapes deepseek-v3,mixtral-8x7b --tokens 8192 --routing uniform} \
    > "$OUT/bench_fp8.log" 2>&1
  echo "[device_run] bench FP8 exit $?"; grep -E "speedup|Error" "$OUT/bench_fp8.log" | tail -6
  timeout "${BENCH_TIMEOUT_S:-240}" python3 scripts/fp8_accuracy.py --shapes scaled \
    --out "$OUT/fp8_accuracy.json" > "$OUT/fp8_accuracy.log" 2>&1
  echo "[device_run] fp8_accuracy exit $?"; grep -E "d_x=|Error" "$OUT/fp8_accuracy.log" | tail -8
fi
if step wgrad; then
  big=$(big_gpu)
  models="qwen3-30b-a3b mixtral-8x7b"; [[ $big == 1 ]] && models="qwen3-30b-a3b deepseek-v3 mixtral-8x7b"
  timeout "${BENCH_TIMEOUT_S:-240}" python3 scripts/bench_grouped_gemm.py --ep 1 --models $models \
    --scales 1.0 --ops wgrad_l1 wgrad_l2 wgrad_l1_acc wgrad_l2_acc \
    --out "$OUT/bench_grouped_gemm_wgrad.json" > "$OUT/bench_grouped_gemm_wgrad.log" 2>&1
  echo "[device_run] wgrad GEMMs exit $?"; grep -E "wgrad|Error" "$OUT/bench_grouped_gemm_wgrad.log" | tail -24
  shapes="${WGRAD_SHAPES:-qwen3-30b-a3b $([[ $big == 1 ]] && echo deepseek-v3 || echo mixtral-8x7b)}"
  for shape in $shapes; do
    for mode in main_grad grad; do
      extra="--main-grad"; [[ $mode == grad ]] && extra="--mok-expert-gemm l1+l2+wgrad"
      timeout "${BENCH_TIMEOUT_S:-240}" python3 scripts/bench_moe.py --shapes "$shape" --tokens 8192 \
        --routing uniform --mok-cuda-forward megakernel --mok-wgrad-pingpong $extra \
        --out "$OUT/bench_wgrad_${mode}_$shape.json" > "$OUT/bench_wgrad_${mode}_$shape.log" 2>&1
      echo "[device_run] layer $shape $mode exit $?"
      grep -E "speedup|Error" "$OUT/bench_wgrad_${mode}_$shape.log" | tail -3
    done
  done
fi
if step targets; then
  for shape in ${TARGET_SHAPES:-deepseek-v3 qwen3-30b-a3b mixtral-8x7b}; do
    timeout "${BENCH_TIMEOUT_S:-240}" python3 scripts/bench_moe.py --shapes "$shape" \
      --tokens 8192,16384 --routing uniform --mok-cuda-forward megakernel --mok-graph \
      --out "$OUT/bench_targets_$shape.json" > "$OUT/bench_targets_$shape.log" 2>&1
    echo "[device_run] targets $shape exit $?"; grep -E "speedup|Error|skipped" "$OUT/bench_targets_$shape.log" | tail -3
  done
  timeout "${BENCH_TIMEOUT_S:-240}" python3 scripts/bench_moe.py --shapes deepseek-v3 --tokens 8192 \
    --routing uniform --mok-cuda-forward megakernel --mok-fp8 --mok-fp8-mega --mok-graph \
    --out "$OUT/bench_targets_fp8mega_deepseek-v3.json" > "$OUT/bench_targets_fp8.log" 2>&1
  echo "[device_run] targets FP8 exit $?"; grep -E "speedup|Error|skipped" "$OUT/bench_targets_fp8.log" | tail -3
fi
if step rounds; then
  for pair in ${ROUNDS:-qwen3-30b-a3b:16384 deepseek-v3:16384 mixtral-8x7b:4096}; do
    shape=${pair%%:*}
    timeout "${BENCH_TIMEOUT_S:-240}" python3 scripts/bench_moe.py --shapes "$shape" --tokens 8192 \
      --routing uniform --mok-cuda-forward megakernel --mok-macrobatch "${pair##*:}" \
      --out "$OUT/bench_rounds_$shape.json" > "$OUT/bench_rounds_$shape.log" 2>&1
    echo "[device_run] rounds $shape exit $?"; grep -E "speedup|Error" "$OUT/bench_rounds_$shape.log" | tail -3
  done
fi
if step bwd_wgrad; then
  big=$(big_gpu)
  shapes="${BWD_WGRAD_SHAPES:-$([[ $big == 1 ]] && echo deepseek-v3 || echo qwen3-30b-a3b,mixtral-8x7b)}"
  for mode in main_grad grad; do
    extra=""; [[ $mode == main_grad ]] && extra="--main-grad"
    timeout "${BENCH_TIMEOUT_S:-240}" python3 scripts/bench_moe.py --shapes "$shapes" --tokens 8192 \
      --routing uniform --mok-cuda-forward megakernel --mok-bwd-wgrad $extra \
      --out "$OUT/bench_bwd_wgrad_$mode.json" > "$OUT/bench_bwd_wgrad_$mode.log" 2>&1
    echo "[device_run] bwd_wgrad $mode exit $?"; grep -E "speedup|Error" "$OUT/bench_bwd_wgrad_$mode.log" | tail -3
  done
fi
if step acc_store; then
  big=$(big_gpu)
  sweeps="qwen3-30b-a3b:1,2,4 mixtral-8x7b:0.25,0.5,1"; [[ $big == 1 ]] && sweeps="$sweeps deepseek-v3:1,2,4"
  for spec in $sweeps; do
    model=${spec%%:*}; scales=${spec##*:}
    timeout "${BENCH_TIMEOUT_S:-240}" python3 scripts/bench_grouped_gemm.py --ep 1 --models "$model" \
      --scales ${scales//,/ } --ops wgrad_l1_acc wgrad_l2_acc --impls mok mok_load mok_reduce \
      torch_gemm+add --out "$OUT/bench_grouped_gemm_acc_store_$model.json" > "$OUT/acc_store_$model.log" 2>&1
    echo "[device_run] acc_store $model exit $?"; grep -E "Error" "$OUT/acc_store_$model.log" | tail -3
  done
  python3 scripts/grouped_gemm_report.py --store "$OUT"/bench_grouped_gemm_acc_store_*.json | tail -40
fi
if step wgrad_cluster2; then
  big=$(big_gpu)
  deepseek_ops="wgrad_l1 wgrad_l2"; [[ $big == 1 ]] && deepseek_ops="$deepseek_ops wgrad_l1_acc wgrad_l2_acc"
  for spec in "qwen3-30b-a3b:1,2" "mixtral-8x7b:0.5,1" "deepseek-v3:1"; do
    model=${spec%%:*}; scales=${spec##*:}; ops="wgrad_l1 wgrad_l2 wgrad_l1_acc wgrad_l2_acc"
    [[ $model == deepseek-v3 ]] && ops=$deepseek_ops
    timeout "${BENCH_TIMEOUT_S:-240}" python3 scripts/bench_grouped_gemm.py --ep 1 --models "$model" \
      --scales ${scales//,/ } --ops $ops --impls mok mok_cluster2 torch_gemm torch_gemm+add \
      --out "$OUT/bench_grouped_gemm_cluster2_$model.json" > "$OUT/cluster2_$model.log" 2>&1
    echo "[device_run] wgrad_cluster2 GEMMs $model exit $?"; grep -E "Error" "$OUT/cluster2_$model.log" | tail -3
  done
  for mode in grad main_grad; do
    extra="--mok-expert-gemm l1+l2+wgrad"; [[ $mode == main_grad ]] && extra="--main-grad"
    timeout "${BENCH_TIMEOUT_S:-240}" python3 scripts/bench_moe.py --shapes qwen3-30b-a3b \
      --tokens 8192,16384 --routing uniform --mok-cuda-forward megakernel --mok-wgrad-cluster2 \
      $extra --out "$OUT/bench_wgrad_cluster2_$mode.json" > "$OUT/bench_wgrad_cluster2_$mode.log" 2>&1
    echo "[device_run] wgrad_cluster2 layer $mode exit $?"
    grep -E "speedup|Error" "$OUT/bench_wgrad_cluster2_$mode.log" | tail -3
  done
fi
# megakernel_trace.py at $TOKENS (default 8192) tokens into $OUT/NAME.json (its log NAME.log),
# the spans echoed:
#   trace NAME SHAPES [megakernel_trace.py arguments...]
trace() {
  local name=$1 shapes=$2; shift 2
  timeout "${BENCH_TIMEOUT_S:-240}" python3 scripts/megakernel_trace.py --shapes "$shapes" \
    --tokens "${TOKENS:-8192}" "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "[device_run] $name exit $?"
  grep -E "span|Error" "$OUT/$name.log" | sed -e 's/; first L1 ready.*//' | tail -3
}
if step clock; then
  # the same build's timelines with the SMs' clock (megakernel_trace.py's sm_ghz): the forward
  # keeping h with the rows as the table picks them, then pulled, the FP8 forward, the backward
  trace megakernel_trace_clock_keep qwen3-30b-a3b,mixtral-8x7b,deepseek-v3 --keep
  trace megakernel_trace_clock_pull qwen3-30b-a3b,deepseek-v3 --keep --fwd-rows pull
  trace megakernel_trace_clock_fp8 deepseek-v3,qwen3-30b-a3b --fp8
  trace megakernel_trace_clock_bwd qwen3-30b-a3b --backward
fi
if step trace_ab; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo h200 || echo h100)
  for round in $(seq 1 "${TRACE_AB_ROUNDS:-2}"); do
    for build in ${TRACE_AB:?trace_ab needs TRACE_AB: the packed builds to compare}; do
      bash scripts/extension_variants.sh use "$build" > /dev/null || continue
      name="megakernel_trace_${gpu}_${build}_ab_$round"
      trace "$name" "${TRACE_AB_SHAPES:-qwen3-30b-a3b,mixtral-8x7b,deepseek-v3}" --keep
      if [[ -n "${TRACE_AB_FP8-deepseek-v3}" ]]; then
        trace "${name}_fp8" "${TRACE_AB_FP8-deepseek-v3}" --fp8
      fi
    done
  done
  # one file for all of them (at most 8 files come back)
  (cd "$OUT" && tar czf "megakernel_trace_${gpu}_ab.tar.gz" --remove-files ./megakernel_trace_*_ab_*.json)
fi
if step order_block; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo h200 || echo h100)
  build=${MOK_COMMIT:?order_block needs MOK_COMMIT: the records name the build}
  build=${build:0:7}
  for tokens in 8192 16384; do
    tag=ab; [[ $tokens == 16384 ]] && tag=ab16k
    for round in $(seq 1 "${ORDER_BLOCK_ROUNDS:-2}"); do
      for block in 16 8; do
        name="megakernel_trace_${gpu}_${build}-block${block}_${tag}_$round"
        TOKENS=$tokens trace "$name" qwen3-30b-a3b,mixtral-8x7b,deepseek-v3 --keep --order-block $block
        TOKENS=$tokens trace "${name}_fp8" deepseek-v3 --fp8 --order-block $block
      done
    done
  done
  (cd "$OUT" && tar czf "megakernel_trace_${gpu}_order_block.tar.gz" --remove-files ./megakernel_trace_*-block*_ab*.json)
fi
nvidia-smi --query-gpu=name,driver_version --format=csv
# At most 8 files come back from a device run: keep the JSON records loose, pack the logs.
(cd "$OUT" && tar czf logs.tar.gz --remove-files gpu_check ./*.log 2>/dev/null)
ls -la "$OUT"
