#!/usr/bin/env bash
# The one command a device run calls: set up, run the GPU tests, write a JSON record.
#
#   bash scripts/gpu_check.sh            # single-GPU tests (-m "gpu and not multigpu")
#   bash scripts/gpu_check.sh 2          # ... plus torchrun --nproc-per-node 2 -m multigpu tests
#
# 1. Carried wheels (.whl/*.whl) are installed into /tmp/site and put on PYTHONPATH.
# 2. A carried prebuilt mok_megatron/_C*.so is used if it imports; otherwise the extension is
#    built in place (python setup.py build_ext --inplace).
# 3. pytest writes JUnit XML; scripts/record_gpu_results.py turns it into
#    gpu_check_<kind>_<UTC date>.json under docs/results/ and $OUT (when set).
# Env: PYTHON (default python3), MOK_COMMIT (commit id when the copy has no .git),
#      MOK_DEVICE_KIND (name in the record), MAX_JOBS (build jobs), PYTEST_ARGS (extra args,
#      split as the shell splits a command line: PYTEST_ARGS='-k "a or b"' passes one -k value),
#      TEST_PATHS (the single-GPU run's test files or folders, default tests/gpu: a path given in
#      PYTEST_ARGS is added to tests/gpu, not run instead of it).
# Exit status: non-zero when a test run failed; the record is written either way.
set -uo pipefail

NPROC_MULTIGPU="${1:-0}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
RESULTS="${OUT:-$ROOT/out}/gpu_check"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}"

log() { echo "[gpu_check] $*"; }

# ---- 1. carried wheels ----------------------------------------------------------------------
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  log "installing carried wheels: $(ls .whl/*.whl | xargs -n1 basename | tr '\n' ' ')"
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl ||
    log "wheel install failed"
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

# ---- 2. the extension -----------------------------------------------------------------------
extension_imports() { "$PY" -c "import torch, mok_megatron._C" >/dev/null 2>&1; }
if compgen -G "mok_megatron/_C*.so" >/dev/null && extension_imports; then
  log "using the carried prebuilt $(ls mok_megatron/_C*.so)"
else
  log "building mok_megatron._C in place"
  rm -f mok_megatron/_C*.so
  MAX_JOBS="${MAX_JOBS:-16}" "$PY" setup.py build_ext --inplace 2>&1 | tail -n 40
fi
"$PY" - <<'EOF'
import torch
from mok_megatron import ops
print(f"[gpu_check] torch {torch.__version__} cuda {torch.version.cuda}, "
      f"{torch.cuda.device_count()} GPU(s): "
      f"{[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}")
print(f"[gpu_check] extension available={ops.extension_available()} error={ops.extension_error()}")
EOF

# ---- 3. tests -------------------------------------------------------------------------------
RUNS=()
STATUS=0
JUNIT_LOGGING=(-o junit_logging=system-out -o junit_log_passing_tests=true)

# NOTE: eval, so that quotes inside PYTEST_ARGS group words (a -k expression with spaces).
eval "EXTRA_ARGS=(${PYTEST_ARGS:-})"
read -r -a PATHS <<< "${TEST_PATHS:-tests/gpu}"
SINGLE_CMD="$PY -m pytest -m \"gpu and not multigpu\" ${PATHS[*]} -v -rA ${PYTEST_ARGS:-}"
log "$SINGLE_CMD"
"$PY" -m pytest -m "gpu and not multigpu" "${PATHS[@]}" -v -rA "${EXTRA_ARGS[@]}" \
  --junitxml="$RESULTS/junit_gpu.xml" "${JUNIT_LOGGING[@]}" 2>&1 | tee "$RESULTS/pytest_gpu.log"
rc=${PIPESTATUS[0]}
[[ $rc -eq 5 ]] && rc=0  # no test collected is not a failure here
[[ $rc -ne 0 ]] && STATUS=$rc
RUNS+=(--run "$SINGLE_CMD" "$RESULTS/junit_gpu.xml" "$rc")

if [[ "$NPROC_MULTIGPU" -ge 2 ]]; then
  MULTI_CMD="torchrun --standalone --nproc-per-node $NPROC_MULTIGPU -m pytest -m multigpu tests/gpu"
  log "$MULTI_CMD"
  # One JUnit file per rank: each rank's pytest writes junit_multigpu_rank$RANK.xml.
  # shellcheck disable=SC2016
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC_MULTIGPU" --no-python \
    bash -c '"$0" -m pytest -m multigpu tests/gpu -v -rA \
      --junitxml="$1/junit_multigpu_rank${RANK}.xml" -o junit_logging=system-out \
      -o junit_log_passing_tests=true; rc=$?; [ $rc -eq 5 ] && rc=0; exit $rc' \
    "$PY" "$RESULTS" \
    2>&1 | tee "$RESULTS/pytest_multigpu.log"
  rc=${PIPESTATUS[0]}
  [[ $rc -eq 5 ]] && rc=0
  [[ $rc -ne 0 ]] && STATUS=$rc
  RUNS+=(--run "$MULTI_CMD" "$RESULTS/junit_multigpu_rank*.xml" "$rc")
fi

# ---- 4. record ------------------------------------------------------------------------------
OUT_DIRS=(--out-dir "$ROOT/docs/results")
[[ -n "${OUT:-}" ]] && OUT_DIRS+=(--out-dir "$OUT")
"$PY" scripts/record_gpu_results.py --suite gpu_check "${RUNS[@]}" "${OUT_DIRS[@]}"
log "exit status $STATUS"
exit "$STATUS"
