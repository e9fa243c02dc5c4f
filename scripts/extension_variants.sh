#!/usr/bin/env bash
# Several builds of the extension in one device call, for same-machine A/B runs of kernel changes
# that live on different commits (docs/perf_notes.md). On the CPU machine, after building a commit
# (`python setup.py build_ext --inplace`):
#   bash scripts/extension_variants.sh pack NAME   # mok_megatron/_C*.so -> .devcarry/so/NAME.so.gz
# (debug sections stripped: about 3.6 MB each, where the carried .so is 33 MB). On the device, with
# .devcarry carried, before each process that should load variant NAME:
#   bash scripts/extension_variants.sh use NAME    # .devcarry/so/NAME.so.gz -> mok_megatron/
# `use` names the file for the interpreter that will import it, $PYTHON (default python3: the
# device's); `pack` takes the one extension the build left. A variant's Python must match its
# build (the op schema): for variants on commits whose Python differs, carry each commit's tree,
#   bash scripts/extension_variants.sh tree REV NAME  # git archive REV (no csrc/, docs/) -> .devcarry/trees/NAME
# and on the device `cd .devcarry/trees/NAME`, `use` there (PYTHONPATH=$PWD), for each variant
# (scripts/device_ab.sh's `variant` does both).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
case "${1:-}" in
  pack)
    # NOTE: not python3's suffix: on the CPU machine python3 may be another version than the
    # project's interpreter, which built the extension.
    built=(mok_megatron/_C*.so)
    if [[ ${#built[@]} -ne 1 || ! -f "${built[0]}" ]]; then
      echo "pack: expected one built extension mok_megatron/_C*.so, found: ${built[*]}" >&2
      exit 1
    fi
    so=${built[0]}
    mkdir -p .devcarry/so
    tmp=$(mktemp)
    strip --strip-debug -o "$tmp" "$so"
    gzip -c "$tmp" > ".devcarry/so/$2.so.gz"
    rm -f "$tmp"
    echo "packed $so as .devcarry/so/$2.so.gz ($(du -h ".devcarry/so/$2.so.gz" | cut -f1))"
    ;;
  use)
    so=$("${PYTHON:-python3}" -c \
      "import sysconfig; print('mok_megatron/_C' + sysconfig.get_config_var('EXT_SUFFIX'))")
    packed=".devcarry/so/$2.so.gz"
    [[ -f "$packed" ]] || packed="../../so/$2.so.gz"  # inside .devcarry/trees/NAME
    gunzip -c "$packed" > "$so"
    echo "extension: $2"
    ;;
  tree)
    rm -rf ".devcarry/trees/$3"
    mkdir -p ".devcarry/trees/$3"
    git archive "$2" -- . ':!csrc' ':!docs' | tar -x -C ".devcarry/trees/$3"
    cp scripts/extension_variants.sh ".devcarry/trees/$3/scripts/"
    echo "tree of $(git rev-parse --short "$2") as .devcarry/trees/$3 ($(du -sh ".devcarry/trees/$3" | cut -f1))"
    ;;
  *)
    echo "usage: $0 pack NAME | use NAME | tree REV NAME" >&2
    exit 2
    ;;
esac
