"""A move that follows its source's write-ahead log (docs/resharding.md, "A group
is followed, then cut over"): a 16 MiB group is copied while a worker pushes to
it, its log records follow, and only the last records are sent while its writes
are held; every acknowledged push is applied exactly once. A source without a
log, or ``--copy-under-fence``, copies the group whole under the fence."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from _reshard import EtcdCluster
from _servers import details
from onnxps.cli.reshard import Move, reshard, target_shard
from onnxps.client import Adagrad, Client
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

ROWS, COLS = 65536, 64  # float32: 16 MiB of X (and 16 MiB of Adagrad's H)
WHOLE = 1 << 30  # no group is split


def _name() -> str:
    """A group name that growing from 2 shards to 3 moves from shard 0 to 2."""
    return next(
        f"big{i}"
        for i in range(100)
        if target_shard(f"big{i}", 2) == 0 and target_shard(f"big{i}", 3) == 2
    )


def _create(c: Client, name: str, rows: int = ROWS) -> None:
    x = np.linspace(-1, 1, rows * COLS, dtype=np.float32).reshape(rows, COLS)
    c.create_group(name, Adagrad(epsilon=1e-7), learning_rate=0.1, tensors={"w": x})


def _push(c: Client, name: str, step: int, rows: int = ROWS) -> int:
    rng = np.random.default_rng(step)
    ids = rng.integers(0, rows, 16)
    grads = rng.standard_normal((16, COLS)).astype(np.float32)
    return c.push_rows(name, {"w": (ids, grads)}).update_count


def _pushing(cluster: EtcdCluster, name: str, acked: list[int], stop: Any) -> None:
    with cluster.connect(client_id="worker", split_bytes=WHOLE) as c:
        step = 0
        while not stop.is_set():
            _push(c, name, step)
            step += 1
            acked[0] = step


def test_a_16_mib_group_is_followed_and_only_its_last_records_are_sent_fenced(
    etcd_cluster: EtcdCluster, servers: Callable[..., Any]
) -> None:
    cluster = etcd_cluster
    name = _name()
    acked = [0]
    errors: list[BaseException] = []
    stop = threading.Event()
    moves: list[Move] = []
    try:
        cluster.start_shards(2)
        with cluster.connect(split_bytes=WHOLE) as admin:
            _create(admin, name)

        def work() -> None:
            try:
                _pushing(cluster, name, acked, stop)
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        while acked[0] < 20 and not errors:
            stop.wait(0.05)
        cluster.start(2, 3)
        reshard(cluster.url, 3, progress=lambda m, done, total: moves.append(m))
        seen = acked[0]
        while acked[0] < seen + 20 and not errors:  # the target serves it
            stop.wait(0.05)
        stop.set()
        worker.join(timeout=60)
        assert not errors, errors
        (m,) = [m for m in moves if m.name == name]
        assert (m.source, m.target) == (0, 2)
        assert m.followed
        group_bytes = 2 * ROWS * COLS * 4  # X and H
        assert m.bytes > group_bytes
        assert 0 < m.fenced_bytes < 1 << 20, m  # records only: no copy of X
        assert "log records of group " + name in cluster.log(0)
        ref = servers()
        with (
            cluster.connect(split_bytes=WHOLE) as c,
            Client(f"127.0.0.1:{ref.port}") as replay,
        ):
            _create(replay, name)
            for step in range(acked[0]):
                _push(replay, name, step)
            info = c.describe_group(name)
            assert info.update_count == acked[0]
            got, want = c.pull(name, state=True), replay.pull(name, state=True)
            for a, b in zip(got, want, strict=True):
                assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        # the target logged the records it applied: a restart keeps them
        cluster.stop(2)
        cluster.start(2, 3)
        with cluster.connect(split_bytes=WHOLE) as c:
            assert c.describe_group(name).update_count == acked[0]
            for a, b in zip(c.pull(name, state=True), want, strict=True):
                assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    finally:
        stop.set()


def test_a_group_is_copied_whole_under_the_fence_with_copy_under_fence(
    etcd_cluster: EtcdCluster,
) -> None:
    cluster = etcd_cluster
    name = _name()
    moves: list[Move] = []
    cluster.start_shards(2)
    with cluster.connect(split_bytes=WHOLE) as c:
        _create(c, name, rows=64)
        for step in range(5):
            _push(c, name, step, rows=64)
    cluster.start(2, 3)
    reshard(
        cluster.url,
        3,
        progress=lambda m, done, total: moves.append(m),
        follow=False,
    )
    (m,) = [m for m in moves if m.name == name]
    assert not m.followed
    assert m.fenced_bytes == m.bytes > 2 * 64 * COLS * 4
    assert "log records of group" not in cluster.log(0)
    with cluster.connect(split_bytes=WHOLE) as c:
        assert c.describe_group(name).update_count == 5


def test_a_source_without_a_log_refuses_to_be_followed(
    servers: Callable[..., Any],
) -> None:
    """A move asks to follow first; a server with no write-ahead log refuses
    (FAILED_PRECONDITION NO_HISTORY), and the tool copies the group under the
    fence instead."""
    handle = servers()
    with Client(f"127.0.0.1:{handle.port}") as c:
        _create(c, "g", rows=8)
    with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        stub = pb_grpc.ParameterServerServiceStub(channel)
        for ask in (
            pb.ExportGroupRequest(group="g", to_shard=1, follow=True),
            pb.ExportGroupRequest(group="g", to_shard=1, records=True),
        ):
            code, info, _ = details(lambda: list(stub.ExportGroup(ask, timeout=10)))  # noqa: B023
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            assert info.reason == "NO_HISTORY"
    with Client(f"127.0.0.1:{handle.port}") as c:
        assert c.describe_group("g").update_count == 0  # served, not fenced
        _push(c, "g", 0, rows=8)
