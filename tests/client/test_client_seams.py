"""The client's two seams: the transport plan (``client/_transport.py``: one choice
of ways from a call's shape) and the per-shard operations (``ShardOps``), which the
routes and the cluster's modules call through public members only."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from onnxps.client import Adam, Client
from onnxps.client._shardops import ShardOps
from onnxps.client._transport import CallShape, plan
from onnxps.client.shm import TensorBuffers
from onnxps.server.app import ServerConfig, ServerHandle

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
CLUSTER_MODULES = ("_routes", "_sharded", "_rowsplit", "_ids_cluster", "_cluster")


def _host(**settings: Any) -> Any:
    """A client's settings as the plan reads them (Client's defaults, frames off:
    ``test_with_frames_shared_memory_waits_for_calls_a_frame_costs_more``)."""
    base = {
        "transport": "auto",
        "stream_threshold_bytes": MIB,
        "shared_memory": "auto",
        "data_channel": "auto",
        "frames": False,
        "TRANSFERS": True,
        "address": "127.0.0.1:1",
        "addresses": ["127.0.0.1:1"],
        "shards": None,
        "chunk_bytes": MIB,
    }
    return SimpleNamespace(**{**base, **settings})


def _push(nbytes: int, **kw: Any) -> CallShape:
    return CallShape("push", nbytes, nbytes, 1, **kw)


def test_the_plan_reads_the_calls_shape_and_the_offers() -> None:
    assert plan(_push(1024), _host()) == ("inline",)
    assert plan(_push(1024), _host(frames=True)) == ("frame",)
    assert plan(_push(128 << 10), _host()) == ("shm", "inline")
    assert plan(_push(2 * MIB), _host()) == ("shm", "channel", "stream")
    assert plan(_push(2 * MIB, native=False), _host()) == ("channel", "stream")
    off = _host(shared_memory="off", data_channel="off")
    assert plan(_push(2 * MIB), off) == ("stream",)
    # a gRPC transport asked for by name: "auto" ways step aside, "on" ones do not
    assert plan(_push(2 * MIB), _host(transport="unary")) == ("inline",)
    on = _host(transport="unary", data_channel="on")
    assert plan(_push(1024), on) == ("channel", "inline")
    assert plan(_push(2 * MIB), _host(TRANSFERS=False)) == ("shm", "stream")


def test_with_frames_shared_memory_waits_for_calls_a_frame_costs_more() -> None:
    """By measured cost (benchmarks/paths.py): a frame below 960 KiB (a frame's
    request holds 1 MiB), shared memory from there, the data channel from 1 MiB
    where shared memory is not to be had; a server that refused a call
    channel lately: shared memory from 64 KiB again, and unary gRPC."""
    from onnxps.client import Client
    from onnxps.client._transport import FRAMED_SHARED_MEMORY_THRESHOLD_BYTES

    assert Client("127.0.0.1:1").frames is True  # the default
    assert Client("127.0.0.1:1", frames="off").frames is False
    framed = _host(frames=True)
    assert FRAMED_SHARED_MEMORY_THRESHOLD_BYTES == 960 << 10
    assert plan(_push(1024), framed) == ("frame",)
    assert plan(_push(256 << 10), framed) == ("frame",)
    assert plan(_push(800_000), framed) == ("frame",)  # 200 x 1,000 float32
    assert plan(_push(960 << 10), framed) == ("shm", "frame")
    assert plan(_push(2 * MIB), framed) == ("shm", "channel", "stream")
    assert plan(_push(256 << 10, frames_refused=True), framed) == ("shm", "inline")
    pull = CallShape("pull", 256 << 10, 256 << 10, 1, segment_bytes=256 << 10)
    assert plan(pull, framed) == ("frame",)


def test_the_plan_of_a_pull() -> None:
    def pull(nbytes: int, **kw: Any) -> CallShape:
        wire = nbytes if kw.get("native", True) else nbytes // 2
        return CallShape("pull", nbytes, wire, 1, **kw)

    # shared memory needs the reply's segment size (known once described)
    assert plan(pull(2 * MIB), _host()) == ("channel", "stream")
    assert plan(pull(2 * MIB, segment_bytes=3 * MIB), _host())[0] == "shm"
    # an encoded X is half the bytes on the wire, and never in shared memory
    encoded = pull(3 * MIB // 2, native=False, segment_bytes=2 * MIB)
    assert plan(encoded, _host()) == ("stream",)
    bufs = TensorBuffers("g", np.dtype(np.float32), [(1 << 16,)], None)
    into = pull(1 << 18, buffers=bufs, segment_bytes=1 << 19)
    assert plan(into, _host()) == ("buffers", "shm", "inline")
    assert plan(into, _host(shared_memory="off")) == ("inline",)


def test_the_plan_of_calls_whose_tensors_travel_in_their_messages() -> None:
    for kind in ("create", "apply"):
        small = CallShape(kind, MIB, MIB, 3)
        large = CallShape(kind, MIB + 1, MIB + 1, 3)
        assert plan(small, _host(frames=True)) == ("inline",)
        assert plan(large, _host()) == ("stream",)
        assert plan(large, _host(transport="unary")) == ("inline",)
    assert plan(CallShape("rows", 8, 8, 1), _host(transport="unary")) == ("stream",)


def _private_reach_ins(module: str, source: str | None = None) -> list[str]:
    """``name._member`` in ``module`` (its file, or ``source``), ``self`` aside."""
    path = ROOT / "client" / f"{module}.py"
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id != "self"
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{module}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_the_cluster_modules_call_shard_operations_by_public_members() -> None:
    assert [r for m in CLUSTER_MODULES for r in _private_reach_ins(m)] == []
    assert not (ROOT / "client" / "_host.py").exists()


def test_the_reach_in_finder_sees_one() -> None:
    source = "def f(core, ops):\n    return core._pull_op(ops.pull, ops.__doc__)\n"
    assert _private_reach_ins("x", source) == ["x:2 core._pull_op"]


def test_a_clients_shard_operations_hold_its_state(
    servers: Callable[..., ServerHandle],
) -> None:
    handle = servers(ServerConfig(address="127.0.0.1:0", durability="none"))
    with Client(handle.address) as c:
        assert isinstance(c.ops, ShardOps) and c.ops.pending is c._pending
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(4)})
        assert c.ops.sizes["g"] == 32 and c.ops.dtypes["g"] == np.float64
        seq = next(c._seq)
        assert c.push_detailed("g", np.ones(4)).update_count == 1
        assert next(c.ops.seq) == seq + 2  # the push took seq + 1
