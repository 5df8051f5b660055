"""Two tiers (README, "Two commands"): ``-m "not slow"`` for every push, and CI runs
both. The kill -9 loops, the examples, compose, the container images and 256 MiB
tensors are slow only."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SLOW_MODULES = [
    "tests/durability/test_crash_recovery.py",
    "tests/training/test_demo.py",
    "tests/containers/test_compose.py",
    "tests/service/test_large_tensors.py",
    "tests/containers/test_containers.py",
    "tests/replication/test_local_replicated.py",
]


def collected(marks: str) -> int:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
         "no:cacheprovider", "-m", marks, *SLOW_MODULES],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    counted = r"(\d+)(?:/\d+)? tests? collected|no tests collected"
    found = re.search(counted, proc.stdout)
    assert found, proc.stdout + proc.stderr
    return int(found.group(1) or 0)


def test_the_fast_tier_leaves_out_the_slow_modules() -> None:
    assert collected("not slow") == 0
    assert collected("slow") >= 20


def test_ci_runs_every_test_and_the_linters() -> None:
    run = (ROOT / ".ci" / "run").read_text()
    # no -m: both tiers; the linters first (scripts/test.sh runs scripts/lint.sh)
    assert re.search(r"^ONNXPS_LINT_FIRST=1 bash scripts/test\.sh$", run, re.M)
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    assert re.search(r"^  bash scripts/lint\.sh", test_sh, re.M)
