"""A group of many tensors keeps X, V and H each in one flat buffer and steps it as
one array (``server/store/_flat.py``): its results are bit for bit those of stepping
each tensor in a group of its own, on every optimizer, dtype and kernel path, through
every way a push's gradients arrive, across block boundaries, snapshots, the WAL
and a restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _procs import StartServer, start_server, stop
from onnxps.client import Adagrad, Adam, Client, Momentum, Nesterov, Sync
from onnxps.server.app import ServerHandle

Array = np.ndarray[Any, Any]

OPTIMIZERS = {
    "adagrad": Adagrad(decay_factor=0.01),
    "momentum": Momentum(alpha=0.9, beta=0.1),
    "nesterov": Nesterov(alpha=0.9, beta=0.1, norm_coefficient=0.01),
    "adam": Adam(norm_coefficient=0.01, norm_coefficient_post=0.001),
}
# odd sizes, a scalar, a matrix: blocks of the flat buffer end inside tensors
SHAPES = [(3, 5), (), (7,), (2, 3, 4), (1000,), (33,), (1,), (129, 3)]


def bits(a: Array) -> Array:
    """The array's bytes as unsigned ints: equal bit patterns, NaN included."""
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def assert_same_bits(got: list[Array], want: list[Array]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and g.dtype == w.dtype, i
        assert np.array_equal(bits(g), bits(w)), f"array {i} differs"


def tensors(
    dtype: str, shapes: list[tuple[int, ...]], seed: int = 0
) -> dict[str, Array]:
    rng = np.random.default_rng(seed)
    return {
        f"t{i}": np.asarray(rng.standard_normal(s)).astype(dtype)
        for i, s in enumerate(shapes)
    }


def gradients(values: dict[str, Array], step: int) -> list[Array]:
    rng = np.random.default_rng(100 + step)
    return [
        np.asarray(rng.standard_normal(a.shape) * 0.1).astype(a.dtype)
        for a in values.values()
    ]


def create_twins(
    c: Client, name: str, opt: Any, values: dict[str, Array], **kw: Any
) -> None:
    """``name``: a group of every tensor; ``name/i``: a group of tensor i alone."""
    c.create_group(name, opt, learning_rate=0.05, tensors=values, **kw)
    for i, (n, a) in enumerate(values.items()):
        c.create_group(f"{name}/{i}", opt, learning_rate=0.05, tensors={n: a}, **kw)


def push_twins(c: Client, name: str, grads: list[Array], **kw: Any) -> Any:
    got = c.push(name, *grads, **kw)
    alone = [c.push(f"{name}/{i}", g, **kw) for i, g in enumerate(grads)]
    return got, alone


def pull_twins(c: Client, name: str, count: int) -> tuple[list[Array], list[Array]]:
    """(X..., V..., H... of the group, the same from the groups of one tensor)."""
    many = c.pull(name, state=True)
    alone = [c.pull(f"{name}/{i}", state=True) for i in range(count)]
    states = len(many) // count
    return many, [alone[i][k] for k in range(states) for i in range(count)]


@pytest.mark.parametrize("kernels", ["numpy", "numba"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", list(OPTIMIZERS))
@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_many_tensors_step_as_each_alone(
    server: ServerHandle,
    monkeypatch: pytest.MonkeyPatch,
    kernels: str,
    dtype: str,
    op: str,
    transport: Any,
) -> None:
    monkeypatch.setenv("ONNXPS_KERNELS", kernels)  # read when a group is created
    values = tensors(dtype, SHAPES)
    opts: dict[str, Any] = {"shared_memory": "off", "data_channel": "off"}
    with Client(server.address, timeout=60, transport=transport, **opts) as c:
        create_twins(c, "g", OPTIMIZERS[op], values)
        for step in range(4):
            t, _ = push_twins(c, "g", gradients(values, step))
            assert t == step + 1
        many, alone = pull_twins(c, "g", len(SHAPES))
        assert_same_bits(many, alone)
        assert not np.array_equal(many[0], values["t0"])  # it stepped
        x, _ = push_twins(c, "g", gradients(values, 9), return_values=True)
        assert_same_bits(x, c.pull("g"))


def test_sync_group_of_many_tensors_steps_as_each_alone(server: ServerHandle) -> None:
    """A sync step combines per-tensor contributions: the group steps tensor by
    tensor over its flat buffers' views, with the same bits."""
    values = tensors("float32", SHAPES, seed=3)
    with Client(server.address, timeout=60) as c:
        create_twins(c, "s", OPTIMIZERS["adam"], values, consistency=Sync(1))
        for step in range(3):
            push_twins(c, "s", gradients(values, step))
        many, alone = pull_twins(c, "s", len(SHAPES))
        assert_same_bits(many, alone)
        assert c.describe_group("s").update_count == 3


@pytest.mark.parametrize("kernels", ["numpy", "numba"])
def test_values_stream_back_block_by_block_across_tensors(
    server: ServerHandle, monkeypatch: pytest.MonkeyPatch, kernels: str
) -> None:
    """Tensors of 6.8 MB in all step in several threads' blocks that start and end
    inside tensors; a push returning X on a stream sends each block as it is
    final, cut back into the tensors it covers."""
    monkeypatch.setenv("ONNXPS_KERNELS", kernels)
    shapes = [(700_001,), (350_000,), (1,), (650_003,), (3, 7)]
    values = tensors("float32", shapes, seed=5)
    opts: dict[str, Any] = {"shared_memory": "off", "data_channel": "off"}
    with Client(server.address, timeout=120, transport="stream", **opts) as c:
        create_twins(c, "b", OPTIMIZERS["adam"], values)
        for step in range(2):
            x, alone = push_twins(c, "b", gradients(values, step), return_values=True)
            assert_same_bits(x, [a[0] for a in alone])
        many, alone_state = pull_twins(c, "b", len(shapes))
        assert_same_bits(many, alone_state)


def test_row_pushes_and_row_pulls_of_a_many_tensor_group(server: ServerHandle) -> None:
    """Rows of one tensor step and read back through the flat buffers' views;
    the other tensors keep every element."""
    values = tensors("float32", [(6, 4), (5,), (10, 3)], seed=7)
    rows = np.array([4, 0, 9], np.int64)
    g = (np.arange(9, dtype=np.float32).reshape(3, 3) - 4) * np.float32(0.01)
    with Client(server.address, timeout=60) as c:
        create_twins(c, "r", OPTIMIZERS["adam"], values)
        c.push_rows("r", {"t2": (rows, g)})
        c.push_rows("r/2", {"t2": (rows, g)})
        many, alone = pull_twins(c, "r", 3)
        assert_same_bits(many, alone)
        assert_same_bits(many[:2], [values["t0"], values["t1"]])
        got = c.pull_rows("r", {"t2": rows, "t0": np.array([5], np.int64)})
        assert_same_bits([got["t2"], got["t0"]], [many[2][rows], many[0][[5]]])


@pytest.mark.slow
def test_flat_layout_survives_snapshot_wal_replay_and_restart(
    server_processes: StartServer, tmp_path: Path
) -> None:
    """A snapshot holds the group's tensors one file each (the format unchanged);
    the pushes after it replay from the WAL into the flat buffers, which then step
    on as the groups of one tensor do."""
    data = tmp_path / "data"
    args = ("--durability", "wal", "--data-dir", str(data))
    values = tensors("float64", SHAPES, seed=11)
    proc, address = start_server(tmp_path / "1.log", *args)
    try:
        with Client(address, timeout=60) as c:
            create_twins(c, "w", OPTIMIZERS["nesterov"], values)
            push_twins(c, "w", gradients(values, 0))
            c.save()
            for step in (1, 2):
                push_twins(c, "w", gradients(values, step))
            before, _ = pull_twins(c, "w", len(SHAPES))
    finally:
        stop(proc)  # SIGKILL: the last pushes are in the WAL only
    proc, address = server_processes(tmp_path / "2.log", *args)
    with Client(address, timeout=60) as c:
        after, _ = pull_twins(c, "w", len(SHAPES))
        assert_same_bits(after, before)
        assert c.describe_group("w").update_count == 3
        push_twins(c, "w", gradients(values, 3))
        many, alone = pull_twins(c, "w", len(SHAPES))
        assert_same_bits(many, alone)
        snapshots = sorted(p.name for p in data.iterdir())
        assert any(s.startswith("snapshot") for s in snapshots), snapshots
