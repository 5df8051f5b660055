"""A standby adopting its primary's snapshot (issue 23) drops every group, then
restores them: a read of a group not back yet is refused UNAVAILABLE, reason
``STATE_REPLACING`` (clients retry it), not NOT_FOUND (which says "create it").
Real in-process servers with write-ahead logs; the adoption is held half-way by the
test taking a group's lock, as a push being applied would.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from _servers import details
from onnxps.client import Adagrad, Client
from onnxps.server.app import ServerHandle
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc


def _groups(address: str) -> None:
    with Client(address, timeout=30) as c:
        for name in ("a", "b"):
            c.create_group(
                name, Adagrad(), learning_rate=0.1, tensors={"x": np.zeros(4)}
            )
        assert c.push("a", np.ones(4)) == 1


def test_a_read_while_a_snapshot_is_adopted_is_unavailable_not_not_found(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    # Any: the test reaches into their durability and store, which it changes
    primary: Any = servers(durability="wal", data_dir=str(tmp_path / "p"))
    standby: Any = servers(durability="wal", data_dir=str(tmp_path / "s"))
    _groups(primary.address)
    _groups(standby.address)
    saved = primary.durability.snapshot(force=True)
    assert saved is not None
    received = tmp_path / "incoming" / Path(saved.path).name  # snap-N
    shutil.copytree(saved.path, received)
    stub = pb_grpc.ParameterServerServiceStub(grpc.insecure_channel(standby.address))

    def describe(name: str) -> pb.DescribeGroupResponse:
        return stub.DescribeGroup(pb.DescribeGroupRequest(group=name), timeout=5)

    # While the adoption runs (held here by the test taking a group's lock,
    # as a push being applied would), the store says it is replacing its state.
    with standby.store._group("b").cond:
        adopting = threading.Thread(
            target=standby.durability.adopt_snapshot, args=(str(received),)
        )
        adopting.start()
        deadline = time.monotonic() + 30
        while standby.store.replacing is None:
            assert time.monotonic() < deadline, "the adoption did not start"
            time.sleep(0.01)
        assert standby.store.replacing == (
            "adopting its primary's snapshot (" + received.name + ")"
        )
    adopting.join(30)
    assert not adopting.is_alive()
    assert standby.store.replacing is None
    assert describe("a").group.update_count == 1  # the primary's state
    code, info, _ = details(lambda: describe("zzz"))
    assert (code, info.reason) == (grpc.StatusCode.NOT_FOUND, "GROUP_NOT_FOUND")
    # A group not back yet while the state is replaced: UNAVAILABLE, retried.
    standby.store.replacing = "adopting its primary's snapshot (snap-x)"
    code, info, _ = details(lambda: describe("zzz"))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert info.reason == "STATE_REPLACING"
    assert info.metadata["group"] == "zzz"
    standby.store.replacing = None
