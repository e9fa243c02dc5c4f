#!/usr/bin/env bash
# Several builds of the extension in one device call, for same-machine A/B runs of kernel changes
# that live on different commits (docs/perf_notes.md). On the CPU machine, after building a commit
# (`python setup.py build_ext --inplace`):
#   bash scripts/extension_variants.sh pack NAME   # mok_megatron/_C*.so -> .devcarry/so/NAME.so.gz
# (debug sections stripped: about 3.6 MB each, where the carried .so is 33 MB). On the device, with
# .devcarry carried, before each process that should load variant NAME:
#   bash scripts/extension_variants.sh use NAME    # .devcarry/so/NAME.so.gz -> mok_megatron/
# `use` names the file for the interpreter that will import it, $PYTHON (default python3: the
# device's); `pack` takes the one extension the build left. A variant's Python must be the
# checked-out tree's: variants whose commits change the op schema or mok_megatron/ cannot share
# one call.
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
    gunzip -c ".devcarry/so/$2.so.gz" > "$so"
    echo "extension: $2"
    ;;
  *)
    echo "usage: $0 pack NAME | use NAME" >&2
    exit 2
    ;;
esac
