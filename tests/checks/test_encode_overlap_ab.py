"""benchmarks/encode_overlap_ab.py: its baseline is an older commit run from its own
checkout (benchmarks/_baseline.py), not a switch in production code."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "encode_overlap_ab.py"
BASELINE = "6a7a5fc"  # the script's default: before the overlap, no wire/ folder


def _has_commit(rev: str) -> bool:
    found = subprocess.run(
        ["git", "cat-file", "-e", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True
    )
    return found.returncode == 0


needs_baseline = pytest.mark.skipif(
    not _has_commit(BASELINE), reason=f"commit {BASELINE} is not in this clone"
)


def _baseline_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "benchmarks_baseline", ROOT / "benchmarks" / "_baseline.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def test_help_names_the_baseline_commit() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--baseline REV" in proc.stdout
    assert f"(default {BASELINE})" in proc.stdout


@needs_baseline
def test_an_older_commit_runs_from_its_own_files() -> None:
    base = _baseline_module()
    with base.checkout(BASELINE) as found:
        assert found.label == BASELINE
        assert not (found.source / "wire").exists()  # before onnxps.wire
        code = (
            "import onnxps.client._requests as r, onnxps.cli.process as p; "
            "print(r.__file__); print(p.__file__); "
            "print(hasattr(r.ClientCore, '_defers_encoding'))"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=base.tree_env(found.tree),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        requests, process, defers = proc.stdout.split()
        source = found.source.resolve()
        assert Path(requests).resolve() == source / "client" / "_requests.py"
        assert Path(process).resolve() == source / "cli" / "process.py"
        assert defers == "False"  # 81e8874 added the deferred encoding


@pytest.mark.slow
@needs_baseline
def test_one_round_runs_both_sides() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "1", "--mib", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].startswith(f"baseline:  {BASELINE} ")
    tables = [line for line in lines if line.startswith("1 MiB float32, ")]
    assert [t.split(",")[1].strip() for t in tables] == [
        "bfloat16 push (ms",
        "bfloat16 pull (ms",
        "float16 push (ms",
        "float16 pull (ms",
    ]
    ratios = [line for line in lines if line.endswith(" of 1")]
    assert len(ratios) == 6  # a push pair and two pull pairs per encoding
