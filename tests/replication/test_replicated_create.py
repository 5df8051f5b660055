"""A group's creation is exactly once across a failover (issue 23): real etcd, real
``onnxps serve`` processes.

A create that the standbys hold but whose answer was lost (the primary died before
replying) is resent by the client to the new primary with the same request id: it
answers the group, it does not refuse ALREADY_EXISTS. Another create of the name
(a new call: another request id) is still refused.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _replicas import SIZE, ReplicaSet
from _servers import _crash
from onnxps.client import Adagrad, AlreadyExistsError, Client, NotFoundError
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc


def _wait_two_sync(rs: ReplicaSet, timeout: float = 60.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sync, primary = rs.key("sync"), rs.key("primary")
        if (
            isinstance(sync, dict)
            and isinstance(primary, dict)
            and len(sync["standbys"]) == 2
            and sync["term"] == primary["term"]
        ):
            return list(sync["standbys"])
        time.sleep(0.05)
    raise AssertionError(f"two synchronous standbys not named within {timeout} s")


def _wait_group(address: str, group: str, timeout: float = 60.0) -> None:
    """Until the server at ``address`` holds ``group`` (a standby holds a record
    durably before it applies it: it holds the create record then)."""
    deadline = time.monotonic() + timeout
    with Client(address, timeout=10) as c:
        while True:
            try:
                c.describe_group(group)
                return
            except NotFoundError:
                assert time.monotonic() < deadline, f"{address} never got {group!r}"
                time.sleep(0.02)


@pytest.mark.slow
def test_a_create_whose_answer_was_lost_in_a_failover_succeeds_when_resent(
    replicas: Any,
) -> None:
    # Two synchronous standbys: with one of them frozen, the primary holds the
    # create's answer back (deterministically) while the other holds the record.
    rs: ReplicaSet = replicas(3, extra=("--sync-replicas", "2"))
    p = rs.primary()
    frozen, holder = (int(m[1:]) for m in _wait_two_sync(rs))
    os.kill(rs.procs[frozen].pid, signal.SIGSTOP)
    outcome: dict[str, Any] = {}

    def create() -> None:
        try:
            with Client(rs.url, timeout=90) as c:
                outcome["info"] = c.create_group(
                    "g", Adagrad(), learning_rate=0.1,
                    tensors={"x": np.zeros(SIZE, np.float32)},
                )  # fmt: skip
        except Exception as exc:  # the test asserts on it below
            outcome["error"] = exc

    thread = threading.Thread(target=create)
    thread.start()
    _wait_group(rs.addresses[holder], "g")
    assert thread.is_alive()  # no answer yet: the frozen standby lacks the record
    rs.procs[p].kill()  # the create is logged and held by a standby, not answered
    rs.procs[p].wait()
    assert rs.primary(not_=p, timeout=60) == holder  # the frozen one cannot run
    thread.join(timeout=120)
    os.kill(rs.procs[frozen].pid, signal.SIGCONT)
    assert "error" not in outcome, repr(outcome.get("error"))
    info = outcome["info"]
    assert (info.name, info.update_count, info.learning_rate) == ("g", 0, 0.1)
    with Client(rs.url, timeout=30) as c:
        # A new create of the name, of another spec or the same one, is refused.
        with pytest.raises(AlreadyExistsError):
            c.create_group(
                "g", Adagrad(), learning_rate=0.5,
                tensors={"x": np.ones(SIZE, np.float32)},
            )  # fmt: skip
        with pytest.raises(AlreadyExistsError):
            c.create_group(
                "g", Adagrad(), learning_rate=0.1,
                tensors={"x": np.zeros(SIZE, np.float32)},
            )  # fmt: skip
        assert c.describe_group("g").learning_rate == pytest.approx(0.1)


def _raw_create(address: str, request_id: str) -> pb.CreateGroupResponse:
    """One CreateGroup call, no client retries: the server's own answer."""
    x = np.zeros(SIZE, np.float32)
    request = pb.CreateGroupRequest(
        group="g",
        optimizer=pb.OptimizerSpec(adagrad=pb.Adagrad()),
        learning_rate=0.1,
        tensors=[
            pb.Tensor(
                name="x", dtype=pb.DATA_TYPE_FLOAT, dims=[SIZE], raw_data=x.tobytes()
            )
        ],
        request_id=request_id,
    )
    with grpc.insecure_channel(address) as ch:
        reply: pb.CreateGroupResponse = pb_grpc.ParameterServerServiceStub(
            ch
        ).CreateGroup(request, timeout=30)
        return reply


@pytest.mark.parametrize("restored_from", ["log", "snapshot"])
def test_the_request_id_of_a_create_is_kept_in_the_log_and_in_snapshots(
    servers: Callable[..., ServerHandle], tmp_path: Path, restored_from: str
) -> None:
    """What a standby holds (the records, or a snapshot it caught up from) is what
    a restarted server holds: the create's request id is in both."""
    config = ServerConfig(
        address="127.0.0.1:0", durability="wal", data_dir=str(tmp_path),
        snapshot_interval=0,
    )  # fmt: skip
    first = servers(config)
    assert _raw_create(first.address, "req-1").group.name == "g"
    with Client(first.address, timeout=30) as c:
        assert c.push("g", np.full(SIZE, 0.5, np.float32)) == 1
    durability = first.durability
    assert durability is not None
    if restored_from == "snapshot":
        assert durability.snapshot(force=True) is not None
    _crash(first)  # no shutdown snapshot
    second = servers(config)
    again = _raw_create(second.address, "req-1")  # its answer was lost
    assert (again.group.name, again.group.update_count) == ("g", 1)
    for other in ("req-2", ""):  # another create of the name
        with pytest.raises(grpc.RpcError) as err:
            _raw_create(second.address, other)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
