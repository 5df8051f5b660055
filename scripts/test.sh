#!/usr/bin/env bash
# Install onnxps with its test extras into ./.venv and run the test suite.
# Arguments go to pytest: none runs every test (both tiers, as CI does);
# `bash scripts/test.sh -m "not slow"` is the fast tier, `-m slow` the slow one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PY" -m venv .venv
fi
echo "== installing onnxps[test]"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -e '.[test]'
# onnxps.torch's tests need PyTorch. Only its CPU wheel is installed, and only from a
# local wheel directory (pip's find-links, /opt/wheels by default): the PyPI torch
# pulls gigabytes of CUDA libraries. Without that wheel those tests are skipped.
TORCH_SPEC=${ONNXPS_TORCH_SPEC:-torch==2.13.0+cpu}
WHEELS=${ONNXPS_TORCH_WHEELS:-/opt/wheels}
if .venv/bin/python -c 'import torch' >/dev/null 2>&1; then
  echo "== torch already installed"
elif ls $WHEELS/torch-*+cpu-*.whl >/dev/null 2>&1; then
  echo "== installing $TORCH_SPEC (CPU wheel from $WHEELS)"
  .venv/bin/python -m pip install -q --find-links "$WHEELS" \
    "$TORCH_SPEC"
else
  echo "== no CPU torch wheel in $WHEELS: the onnxps.torch" \
    "tests will be SKIPPED (pip install '$TORCH_SPEC' to run them)"
fi
if [ "${ONNXPS_LINT_FIRST:-0}" = 1 ]; then
  bash scripts/lint.sh  # CI: lint first, so the test summary is the last line
fi
echo "== running the tests"
exec .venv/bin/python -m pytest -q "$@"
