"""The official ONNX node tests live in the repository, and are the official ones.

They are committed under ``tests/data/onnx-node-tests`` (Apache-2.0, with the ONNX
project's LICENSE): onnx wheels no longer ship the .pb artifacts. The generators that
wrote them do ship, so the installed onnx package vouches for every byte we compare.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx_reference as ref
import pytest
from onnx import helper

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


def generated_cases() -> dict[str, Any]:
    """The installed onnx's own node test cases for the three training operators."""
    for module in ("adagrad", "momentum", "adam"):
        # Importing a case module runs its exporters, which record their cases.
        importlib.import_module(f"onnx.backend.test.case.node.{module}")
    cases = importlib.import_module("onnx.backend.test.case.node")._NodeTestCases
    return {case.name: case for case in cases if case.name in ref.NODE_TESTS}


def test_committed_cases_are_what_the_onnx_package_generates() -> None:
    generated = generated_cases()
    assert sorted(generated) == sorted(ref.NODE_TESTS)
    for name in ref.NODE_TESTS:
        committed = ref.load_node_test(name)
        case = generated[name]
        (node,) = case.model.graph.node
        assert node.op_type == committed.op
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
        assert attrs == committed.attrs, name
        ((inputs, outputs),) = case.data_sets
        for got, expected in zip(
            committed.inputs + committed.outputs,
            [np.asarray(a) for a in [*inputs, *outputs]],
            strict=True,
        ):
            assert got.dtype == expected.dtype and got.shape == expected.shape, name
            assert got.tobytes() == expected.tobytes(), name


def test_committed_cases_are_the_seven_with_their_license() -> None:
    root = ref.node_tests_dir()
    assert root.is_relative_to(REPO)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == sorted(
        ref.NODE_TESTS
    )
    assert "Apache License" in (root / "LICENSE").read_text()
    assert (
        "6be0677fc22e74563e6eb472f931513aefe5648d" in (root / "SOURCE.txt").read_text()
    )


# A folder beside the checkout, or a variable naming it; or a parent of a test file
# above the checkout (from tests/x.py two parents up, from tests/unit/x.py three).
OUTSIDE = re.compile(r"\.\./shared|\bONNXPS_" + r"SHARED\b")
PARENTS = re.compile(r"parents\[(\d+)\]")


def _outside(path: Path, line: str) -> bool:
    depth = len(path.relative_to(REPO).parts)
    return bool(OUTSIDE.search(line)) or any(
        int(n) >= depth for n in PARENTS.findall(line)
    )


def test_no_test_reads_a_folder_beside_the_checkout() -> None:
    offenders = [
        f"{path.relative_to(REPO)}:{number}"
        for path in sorted(TESTS.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _outside(path, line)
    ]
    assert offenders == []


@pytest.mark.slow
def test_the_official_tests_pass_in_a_checkout_with_nothing_beside_it(
    tmp_path: Path,
) -> None:
    """tests/ copied alone into an empty directory (as a fresh clone has it)."""
    alone = tmp_path / "alone" / "onnxps"
    alone.mkdir(parents=True)
    (alone / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    shutil.copytree(
        TESTS, alone / "tests", ignore=shutil.ignore_patterns("__pycache__")
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONNXPS_")}
    env["HOME"] = str(tmp_path)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/unit/test_kernels_conformance.py",
            "-k",
            "official",
        ],
        cwd=alone,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"\b32 passed\b", result.stdout), result.stdout
