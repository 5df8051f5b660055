"""The layering rules of the package, read from the source.

- the wire layer (``onnxps.wire``) imports neither end (client, server) nor grpc;
- the server imports nothing from ``onnxps.client``;
- the core (the store, kernels, durability) loads neither grpc nor the client, even
  through other modules (checked in a fresh interpreter);
- inside the server, each folder imports only the folders ``SERVER_LAYERS`` allows,
  and those allowances form layers (no two folders import each other, even through
  a third).
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


# The server's folders, as layers: a module of the key may import modules of the
# folders listed (and of its own). "process" is the modules at the top of server/
# (app, config, cli, metrics, health, reflection); "errors" is server/errors.py, the
# domain errors every layer raises. A new crossing fails until it is written here,
# and docs/architecture.md draws these layers from the code (scripts/architecture.py).
SERVER_LAYERS: dict[str, set[str]] = {
    "process": {
        "rpc",
        "replication",
        "interceptors",
        "transports",
        "durability",
        "store",
        "kernels",
        "errors",
    },
    "rpc": {"interceptors", "transports", "durability", "store", "kernels", "errors"},
    "replication": {"interceptors", "durability", "store", "errors"},
    "interceptors": {"errors"},
    "transports": {"store", "kernels", "errors"},
    "durability": {"store", "errors"},
    "store": {"kernels", "errors"},
    "kernels": {"errors"},
    "errors": set(),
}


def _server_layer(module: str) -> str:
    """The layer of a module of onnxps.server (its folder, "process" or "errors")."""
    parts = module.split(".")[2:]
    if parts and parts[0] in SERVER_LAYERS:
        return parts[0]
    return "process"


def _crossings(graph: dict[str, set[str]]) -> list[str]:
    """Every import between two server folders that ``SERVER_LAYERS`` does not
    allow, as ``importer -> imported``."""
    bad = []
    for module, edges in sorted(graph.items()):
        if not module.startswith("onnxps.server"):
            continue
        here = _server_layer(module)
        for target in sorted(edges):
            if not target.startswith("onnxps.server"):
                continue
            there = _server_layer(target)
            if there != here and there not in SERVER_LAYERS[here]:
                bad.append(f"{module} ({here}) -> {target} ({there})")
    return bad


def test_each_server_folder_imports_only_the_layers_below_it() -> None:
    graph = _import_graph()
    assert _crossings(graph) == []
    # it did read the server: every layer holds a module, and crossings are seen
    layers = {_server_layer(m) for m in graph if m.startswith("onnxps.server")}
    assert layers == set(SERVER_LAYERS)


def test_the_layer_table_names_every_server_folder() -> None:
    folders = {
        p.parent.name
        for p in (ROOT / "server").glob("*/__init__.py")
        if p.parent.parent == ROOT / "server"
    }
    assert folders == set(SERVER_LAYERS) - {"process", "errors"}
    assert (ROOT / "server" / "errors.py").is_file()


def test_the_server_layers_import_no_cycle() -> None:
    assert _cycle(SERVER_LAYERS) == []
    # and no layer allows itself or an unknown one
    for layer, allowed in SERVER_LAYERS.items():
        assert layer not in allowed and allowed <= set(SERVER_LAYERS)


def test_a_new_crossing_between_server_folders_fails() -> None:
    graph = {
        "onnxps.server.store.store": {"onnxps.server.rpc.service", "onnxps.wire.codec"},
        "onnxps.server.rpc.service": {"onnxps.server.store.store"},
        "onnxps.server.kernels": {"onnxps.server.errors"},
        "onnxps.server.errors": {"onnxps.server.app"},
    }
    assert _crossings(graph) == [
        "onnxps.server.errors (errors) -> onnxps.server.app (process)",
        "onnxps.server.store.store (store) -> onnxps.server.rpc.service (rpc)",
    ]


def test_each_server_folder_says_what_it_owns_and_may_import() -> None:
    for init in sorted((ROOT / "server").glob("*/__init__.py")):
        doc = " ".join((ast.get_docstring(ast.parse(init.read_text())) or "").split())
        assert "may import" in doc, init
        for allowed in SERVER_LAYERS[init.parent.name]:
            assert f"``{allowed}``" in doc, (init, allowed)
