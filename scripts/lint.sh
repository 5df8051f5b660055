#!/usr/bin/env bash
# ruff (lint and format) over the whole tree, then mypy --strict over the package and
# tests/. Uses ./.venv as scripts/test.sh installs it (ruff and mypy are test extras).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
  echo "lint: no .venv here: run bash scripts/test.sh (or pip install -e '.[test]')" >&2
  exit 2
fi
echo "== ruff check"
"$PY" -m ruff check .
echo "== ruff format --check"
"$PY" -m ruff format --check .
echo "== mypy --strict (package, tests)"
"$PY" scripts/typecheck.py
