#!/usr/bin/env bash
# The test command: set up .venv if needed, lint, then run the test suite. GPU tests are marked
# and skipped on machines without a GPU. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$("$root/scripts/setup_env.sh")"
cd "$root"
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
# Where nvcc exists the extension must have compiled and must load: CI checks csrc/ this way.
require_ext=0
if command -v nvcc >/dev/null && [ "${MOK_SKIP_CUDA:-0}" != 1 ]; then require_ext=1; fi
"$venv/bin/python" - "$require_ext" <<'PY'
import sys

import mok_megatron.ops as ops

print("mok_megatron._C:", "loaded" if ops.extension_available() else ops.extension_error())
if sys.argv[1] == "1" and not ops.extension_available():
    sys.exit("nvcc is present but the CUDA extension did not build or load")
PY
exec "$venv/bin/python" -m pytest tests -q "$@"
