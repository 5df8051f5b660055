"""mypy --strict over the whole package and the tests, imports resolved across the
mapped folders."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_mypy_strict_is_clean_on_the_package_and_the_tests() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "typecheck.py")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    package, tests = proc.stdout.splitlines()[-2:]
    assert package.startswith("Success: no issues found"), proc.stdout
    # then every file under tests/ (without torch, all but the two that import it:
    # onnxps.torch is checked against torch's annotations)
    n = len(list((ROOT / "tests").rglob("*.py")))
    if importlib.util.find_spec("torch") is None:
        n -= 2
    assert tests == f"Success: no issues found in {n} source files", proc.stdout
