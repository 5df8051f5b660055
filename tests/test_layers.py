"""The layering rules of the package, read from the source.

- the wire layer (``onnxps.wire``) imports neither end (client, server) nor grpc;
- the server imports nothing from ``onnxps.client``;
- the core (the store, kernels, durability) loads neither grpc nor the client, even
  through other modules (checked in a fresh interpreter).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (absolute names; relative imports
    resolved against the file's package)."""
    package = {
        "wire": "onnxps.wire",
        "server": "onnxps.server",
        "client": "onnxps.client",
    }
    parts = path.relative_to(ROOT).parts
    base = package.get(parts[0], parts[0]).split(".") + list(parts[1:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                module = ".".join(anchor + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _violations(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for module in sorted(_imports(path)):
            if module.startswith(forbidden) or module in {
                f.rstrip(".") for f in forbidden
            }:
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    return bad


def test_the_wire_layer_imports_neither_end_nor_grpc() -> None:
    assert (
        _violations("wire", ("onnxps.client", "onnxps.server", "grpc", "grpc_status"))
        == []
    )


def test_the_server_imports_nothing_from_the_client() -> None:
    assert _violations("server", ("onnxps.client",)) == []


def test_the_rule_finder_sees_a_violation() -> None:
    # The checker itself: client modules do import the wire layer and grpc.
    assert _violations("client", ("onnxps.wire",)) != []
    assert "grpc" in _imports(ROOT / "client" / "_errors.py")


@pytest.mark.parametrize(
    "module",
    [
        "onnxps.server.store",
        "onnxps.server.kernels",
        "onnxps.server.durability",
        "onnxps.wire.codec",
        "onnxps.wire.image",
        "onnxps.wire.shm",
    ],
)
def test_the_core_loads_neither_grpc_nor_the_client(module: str) -> None:
    script = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        "print(json.dumps(sorted(m for m in sys.modules\n"
        "    if m == 'grpc' or m.startswith(('grpc.', 'onnxps.client')))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert json.loads(out) == []
