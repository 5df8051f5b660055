"""mypy --strict over the whole package, imports resolved across the mapped folders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_strict_is_clean_on_client_server_and_cli() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "typecheck.py")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("Success: no issues found"), proc.stdout
