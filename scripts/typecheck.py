"""Run mypy with imports resolved across the packages mapped by package-dir.

The source folders are mapped onto one import root by setuptools' ``package-dir``
(``server`` -> ``onnxps.server`` ...), which mypy cannot follow from an editable
install: every cross-package import would be ``Any``. This script lays the mapping out
as a tree of symlinks in a temporary directory and checks that tree, so mypy sees the
packages exactly as Python imports them. ``python scripts/typecheck.py [mypy args]``;
exit status is mypy's.
"""

from __future__ import annotations

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


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="onnxps-mypy-") as tmp:
        tree = Path(tmp)
        packages = build_tree(tree)
        checked = [p for p in packages if not p.endswith(".v1")]
        cmd = [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(ROOT / ".mypy_cache"),
            *[arg for p in checked for arg in ("-p", p)],
            *argv,
        ]
        return subprocess.run(cmd, cwd=tree).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
