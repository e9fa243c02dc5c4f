#!/usr/bin/env bash
# Make (or reuse) .venv with Python 3.12 and requirements/dev.txt (and requirements/bridge.txt,
# --no-deps, into .venv/bridge_site for the Bridge test), then install mok_megatron into
# it (editable). The CUDA extension is compiled when nvcc is found, unless MOK_SKIP_CUDA=1.
# Idempotent: a second run reinstalls nothing whose inputs did not change. Prints the venv path.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MOK_VENV:-$root/.venv}"
log() { echo "[setup] $*" >&2; }

find_python() {
  for cand in "python3.12" "python3"; do
    for env in "PYENV_VERSION=3.12.1" ""; do
      if env $env "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        echo "$env $cand"; return 0
      fi
    done
  done
  echo "mok_megatron needs Python 3.12 (megatron-core 0.19 requires it); none was found" >&2
  return 1
}

if [ ! -x "$venv/bin/python" ]; then
  py="$(find_python)"
  log "creating $venv with: $py"
  env $py -m venv "$venv"
fi
stamp="$venv/.mok-requirements.sha"
want="$(sha256sum "$root/requirements/dev.txt" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing requirements/dev.txt (first time: a few minutes, torch is large)"
  # The venv takes about 5.2 GB (torch's CUDA build and its nvidia-* wheels), and pip unpacks
  # each wheel beside it while it installs: say so before pip fails with ENOSPC.
  free_kb="$(df -Pk "$venv" | awk 'NR == 2 { print $4 }')"
  if [ -n "$free_kb" ] && [ "$free_kb" -lt $((8 * 1024 * 1024)) ]; then
    log "WARNING: $((free_kb / 1024)) MB free under $venv; the first install needs about 8 GB"
  fi
  # --no-cache-dir: torch's CUDA build and its nvidia-* wheels are several GB; a cached copy of
  # them beside the installed one doubled what a first install needs on disk (CI once ran out).
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir \
    -r "$root/requirements/dev.txt"
  echo "$want" > "$stamp"
fi
bridge_stamp="$venv/bridge_site/.mok-requirements.sha"
want="$(sha256sum "$root/requirements/bridge.txt" | cut -d' ' -f1)"
if [ "$(cat "$bridge_stamp" 2>/dev/null)" != "$want" ]; then
  log "installing requirements/bridge.txt into $venv/bridge_site (--no-deps: a few MB)"
  rm -rf "$venv/bridge_site"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    --target "$venv/bridge_site" -r "$root/requirements/bridge.txt"
  echo "$want" > "$bridge_stamp"
fi
log "installing mok_megatron (editable; compiles csrc/ when nvcc is present)"
(cd "$root" && MAX_JOBS="${MAX_JOBS:-2}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" \
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . >&2)
echo "$venv"
