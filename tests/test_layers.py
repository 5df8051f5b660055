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


PRODUCTION = ("client", "server", "wire", "cli", "torch_integration")


def _production_files() -> list[Path]:
    return sorted(p for folder in PRODUCTION for p in (ROOT / folder).rglob("*.py"))


def test_no_production_module_is_over_900_lines() -> None:
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for p in _production_files()
    }
    assert {p: n for p, n in sizes.items() if n > 900} == {}
    assert max(sizes.values()) > 100  # it did read the modules


def test_no_function_is_above_complexity_20() -> None:
    radon = pytest.importorskip("radon.complexity")
    over = {}
    for p in _production_files():
        for block in radon.cc_visit(p.read_text()):
            if block.complexity > 20:
                over[f"{p.relative_to(ROOT)}:{block.fullname}"] = block.complexity
    assert over == {}


_PACKAGES = {
    "client": "onnxps.client",
    "server": "onnxps.server",
    "wire": "onnxps.wire",
    "cli": "onnxps.cli",
    "torch_integration": "onnxps.torch",
}


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in _PACKAGES.items():
        for p in (ROOT / folder).rglob("*.py"):
            parts = list(p.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = p
    return found


def _import_graph() -> dict[str, set[str]]:
    """Module -> the onnxps modules it imports anywhere in it (under
    TYPE_CHECKING and inside functions too): ``from . import x`` is an edge to
    ``x``, not to the package."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    anchor = base[: len(base) - node.level + 1]
                    module = ".".join(anchor + ([module] if module else []))
                subs = {f"{module}.{a.name}" for a in node.names} & modules.keys()
                edges |= subs
                if len(subs) < len(node.names):
                    edges.add(module)
        graph[name] = {m for m in edges if m in modules and m != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (empty when there is none)."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str]:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w) :] + [w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return []

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return []


def test_no_module_imports_back_into_a_cycle() -> None:
    graph = _import_graph()
    assert len(graph) > 50 and graph["onnxps.client._client"]  # it read them
    assert _cycle(graph) == []


def test_the_cycle_finder_finds_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
