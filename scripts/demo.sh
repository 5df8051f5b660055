#!/usr/bin/env bash
# Install onnxps with the demo extra into ./.venv and run `onnxps demo` (arguments are
# passed on, e.g. `bash scripts/demo.sh --optimizer nesterov --workers 2`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PY" -m venv .venv
fi
echo "== installing onnxps[demo]"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -e '.[demo]'
echo "== running onnxps demo"
exec .venv/bin/onnxps demo "$@"
