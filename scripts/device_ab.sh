#!/usr/bin/env bash
# Sourced by a device command (from the repository root, .whl and .devcarry carried) for A/B runs
# of several builds in one call (docs/perf_notes.md, session 29): installs the carried wheels,
# names the GPU, and defines
#   variant TREE SO   enter .devcarry/trees/TREE (scripts/extension_variants.sh tree REV TREE)
#                     with the packed build SO (extension_variants.sh pack SO) as its extension;
#                     MOK_COMMIT = SO's text after its last '-' (name builds NAME-<commit>)
#   el WHAT           prints the seconds since sourcing, for the log
# and GPU (h100 / h200: for record names), KIND (nvidia-$GPU: for junit names) and PYT (pytest).
# Example:
#   source scripts/device_ab.sh
#   for v in new:new-abc1234 main:main-def5678; do
#     variant ${v%%:*} ${v#*:}
#     python3 scripts/bench_moe.py ... --out $OUT/bench_moe_${GPU}_ep1_${MOK_COMMIT}.json; el bench $v
#   done
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
  2>&1 | tail -1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then GPU=h200; else GPU=h100; fi
KIND=nvidia-$GPU
PYT="python3 -m pytest -q -p no:cacheprovider -p no:hypothesispytest"
variant() {
  cd "$ROOT/.devcarry/trees/$1" || return 1
  PYTHON=python3 bash scripts/extension_variants.sh use "$2"
  export PYTHONPATH=/tmp/site:$PWD MOK_COMMIT=${2##*-}
  python3 -c "import mok_megatron.ops as o; print('$1 with $2:', o.extension_available(), o.extension_error())"
}
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s] $*"; }
