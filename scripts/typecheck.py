"""Run mypy with imports resolved across the packages mapped by package-dir.

The source folders are mapped onto one import root by setuptools' ``package-dir``
(``server`` -> ``onnxps.server`` ...), which mypy cannot follow from an editable
install: every cross-package import would be ``Any``. This script lays the mapping out
as a tree of symlinks in a temporary directory and checks that tree, so mypy sees the
packages exactly as Python imports them. The tests are checked in the same run, each
file under ``tests/`` as the module its path names (``unit.test_wire``,
``workers.common``), the support modules beside conftest.py by their names, as pytest
imports them (``_procs``).
``python scripts/typecheck.py [mypy args]``; exit status is mypy's.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """The package-dir mapping of the checkout at ``root`` (its pyproject.toml)."""
    with open(root / "pyproject.toml", "rb") as f:
        config = tomllib.load(f)
    mapping = config["tool"]["setuptools"]["package-dir"]
    return {name: root / path for name, path in mapping.items()}


def build_tree(dest: Path, root: Path = ROOT) -> list[str]:
    """Symlink each top-level mapped package of the checkout at ``root`` into
    ``dest``; returns their names. ``dest`` on ``PYTHONPATH`` imports that
    checkout (benchmarks/_baseline.py runs an older commit so)."""
    tops = []
    dirs = package_dirs(root)
    # A namespace portion (no __init__.py, e.g. onnxps's __main__): its modules only.
    spaces = {
        name for name, path in dirs.items() if not (path / "__init__.py").exists()
    }
    for name in spaces:
        target = dest.joinpath(*name.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for module in dirs[name].glob("*.py"):
            (target / module.name).symlink_to(module)
    for name, path in sorted(dirs.items()):
        parts = name.split(".")
        parent = dest.joinpath(*parts[:-1])
        if name in spaces or any(
            name.startswith(other + ".") for other in dirs if other not in spaces
        ):
            continue  # a sub-package of a mapped package: reached through its parent
        parent.mkdir(parents=True, exist_ok=True)
        (parent / parts[-1]).symlink_to(path, target_is_directory=True)
        tops.append(name)
    return tops


# Test modules that import torch (tests/training/test_torch.py skips itself without it).
TORCH_TESTS = {"test_torch.py", "torch_workers.py"}


def mypy(tree: Path, targets: list[str], argv: list[str]) -> int:
    cmd = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "--cache-dir",
        str(ROOT / ".mypy_cache"),
        *targets,
        *argv,
    ]
    # tests/ on the search path: a test file's module is its path under tests/
    # (unit.test_wire, workers.common), a support module its name (_procs), as pytest
    # imports it; onnxps from the tree.
    env = {**os.environ, "MYPYPATH": os.pathsep.join([str(tree), str(ROOT / "tests")])}
    return subprocess.run(cmd, cwd=tree, env=env).returncode


def main(argv: list[str]) -> int:
    """The package, then the tests (mypy takes packages or files in one run, not both;
    the second run reads the package from the first one's cache)."""
    with tempfile.TemporaryDirectory(prefix="onnxps-mypy-") as tmp:
        tree = Path(tmp)
        packages = build_tree(tree)
        checked = [p for p in packages if not p.endswith(".v1")]
        tests = sorted((ROOT / "tests").rglob("*.py"))
        if importlib.util.find_spec("torch") is None:
            # onnxps.torch is checked against torch's annotations: without torch,
            # leave it and the tests that import it out, and say so.
            print("typecheck: PyTorch is not installed: onnxps.torch not checked")
            checked.remove("onnxps.torch")
            tests = [t for t in tests if t.name not in TORCH_TESTS]
        status = mypy(tree, [arg for p in checked for arg in ("-p", p)], argv)
        files = [str(t) for t in tests]
        return mypy(tree, ["--explicit-package-bases", *files], argv) or status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
