"""Readiness and promotion compare terms, not only positions (issue: hardening
replicated shards). A deposed primary restarted and cut off from the new one holds
more records than the new primary logged, some never acknowledged: it is not
ready, and ``onnxps status`` says it does not follow. A standby promoted while it
still applies what it received answers UNAVAILABLE (retried), not NOT_FOUND, and
is not ready until it applied everything. Real etcd, real ``onnxps serve``
processes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _replicas import (
    ADMIN,
    REPLICATION,
    SERVING,
    SIZE,
    ReplicaSet,
    _check,
    _create,
    _kill,
    _wait_log,
    _wait_ready,
)
from onnxps.cli.status import replica_rows
from onnxps.client import Client, NotFoundError, OnnxpsError
from onnxps.server._health import READY
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1.parameter_server_pb2_grpc import ParameterServerServiceStub


def _lsn_of(rs: ReplicaSet, member: int, lsn: int, timeout: float = 30.0) -> None:
    """Wait until ``member`` published ``lsn`` in its member key."""
    deadline = time.monotonic() + timeout
    while True:
        key = rs.key(f"members/m{member}")
        if isinstance(key, dict) and key["lsn"] == lsn:
            return
        assert time.monotonic() < deadline, f"m{member} published {key}"
        time.sleep(0.05)


def _t(rs: ReplicaSet, member: int, t: int, timeout: float = 30.0) -> None:
    """Wait until ``member`` holds g at T=``t`` (its reads need the token)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with Client(rs.addresses[member], timeout=5, token=ADMIN) as c:
                if c.describe_group("g").update_count == t:
                    return
        except NotFoundError:
            pass
        assert time.monotonic() < deadline, f"m{member} is not at T={t}"
        time.sleep(0.05)


def _row(rs: ReplicaSet, member: int) -> dict[str, str]:
    columns = ("SHARD", "MEMBER", "ADDRESS", "ROLE", "TERM", "LSN", "LAG", "SYNC")
    for r in replica_rows(rs.url, 10):
        if r[1] == f"m{member}":
            return dict(zip(columns, r, strict=True))
    raise AssertionError(f"m{member} not in onnxps status")


@pytest.mark.slow
def test_a_deposed_primary_holding_unacknowledged_records_is_not_ready(
    replicas: Any,
    tmp_path: Path,
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ADMIN} admin *\n{REPLICATION} replication *\n")
    rs: ReplicaSet = replicas(
        2,
        extra=("--tokens-file", str(tokens)),
        env={"ONNXPS_REPLICATION_TOKEN": REPLICATION},
    )
    p = rs.primary()
    rs.wait_sync()
    s = 1 - p
    g = np.full(SIZE, 0.5, np.float32)
    with Client(rs.url, timeout=30, token=ADMIN) as c:
        c.create_group("g", **_group())
        assert [c.push("g", g) for _ in range(3)] == [1, 2, 3]  # records 1 to 4
    _t(rs, s, 3)
    # The standby stops answering: record 5 is logged (durable) on the primary,
    # never acknowledged; then both die, and the standby comes back to lead.
    os.kill(rs.procs[s].pid, signal.SIGSTOP)

    def push_unacknowledged() -> None:
        with Client(rs.addresses[p], timeout=3, token=ADMIN) as c:
            with pytest.raises(OnnxpsError):
                c.push("g", g)

    pusher = threading.Thread(target=push_unacknowledged)
    pusher.start()
    try:
        _lsn_of(rs, p, 5)
    finally:
        _kill(rs, p)
        _kill(rs, s)  # record 5 waiting in its socket dies with it
        pusher.join()
    rs.start(s)  # it replays its log (records 1 to 4) and takes the lead
    assert rs.primary(not_=p) == s
    _lsn_of(rs, s, 4)
    # Restarted with a token the new primary refuses, the deposed primary holds
    # record 5 of term 1; the new primary logged 4 (term 2). It is not ready.
    rs.env["ONNXPS_REPLICATION_TOKEN"] = "rep-wrong"
    rs.start(p)
    log = tmp_path / f"server{p}-2.log"
    _wait_log(log, rf"(not ready|caught up \(ready\)): .*m{s}")
    polls = []
    for _ in range(30):
        polls.append(_check(rs.addresses[p], READY))
        time.sleep(0.1)
    assert polls.count(SERVING) == 0, (polls, log.read_text()[-2000:])
    assert _check(rs.addresses[p], "") == SERVING  # it serves (reads), not ready
    found = _wait_log(log, rf"not ready: .*m{s}")
    assert "follow" in found.group(0), found.group(0)
    row = _row(rs, p)
    assert row["LAG"] == "not-following", row
    assert _row(rs, s)["LAG"] == "0"
    # With its token it follows: the new primary sends it a snapshot (its log
    # holds record 5 in another term), and it is ready, following.
    _kill(rs, p)
    rs.env["ONNXPS_REPLICATION_TOKEN"] = REPLICATION
    rs.start(p)
    _wait_ready(rs.addresses[p])
    _t(rs, p, 3)  # the unacknowledged push is gone
    deadline = time.monotonic() + 30
    while (row := _row(rs, p))["LAG"] != "0":
        assert time.monotonic() < deadline, row
        time.sleep(0.1)


def _group() -> dict[str, Any]:
    from onnxps.client import Adagrad

    return {
        "optimizer": Adagrad(),
        "learning_rate": 0.1,
        "tensors": {"x": np.zeros(SIZE, np.float32)},
    }


@pytest.mark.slow
def test_a_promoted_standby_answers_unavailable_until_it_applied_what_it_holds(
    replicas: Any,
    tmp_path: Path,
) -> None:
    # The primary steps with NumPy. The standby is told to step with numba's
    # kernels (ONNXPS_KERNELS=numba: a step waits for them), which it compiles
    # from no cache (6 to 20 s from its start), so applying the create waits for
    # the compile: it is promoted meanwhile. (With the default, auto, a step
    # never waits: NumPy steps until the kernels are in, and the case is not met.)
    rs: ReplicaSet = replicas(1, env={"ONNXPS_KERNELS": "numpy"})
    assert rs.primary() == 0
    rs.starts[1] = 0
    cache = str(tmp_path / "numba-cache")
    rs.env = {"NUMBA_CACHE_DIR": cache, "ONNXPS_KERNELS": "numba"}
    rs.start(1)
    rs.wait_sync()
    standby_log = tmp_path / "server1-1.log"
    _create(rs.url)  # acknowledged: the standby holds it (durable), applies it next
    with Client(rs.url, timeout=30) as c:
        assert c.push("g", np.full(SIZE, 0.5, np.float32)) == 1
    if "fused kernels ready" in standby_log.read_text():
        pytest.skip("the standby compiled its kernels before the primary was killed")
    _kill(rs, 0)
    assert rs.primary(not_=0) == 1
    answers: list[str] = []  # each answer, as gRPC gave it (no retries)
    deadline = time.monotonic() + 60
    with grpc.insecure_channel(
        rs.addresses[1], options=[("grpc.enable_retries", 0)]
    ) as channel:
        stub = ParameterServerServiceStub(channel)
        while True:
            ready = _check(rs.addresses[1], READY) == SERVING
            try:
                reply = stub.DescribeGroup(
                    pb.DescribeGroupRequest(group="g"), timeout=5
                )
            except grpc.RpcError as exc:
                answers.append(f"{exc.code().name}: {exc.details()}")
                assert not ready, f"ready, yet {answers[-1]}"
                # a push meanwhile (a hostile worker's, or one that raced the
                # failover) is refused: nothing steps on a state not yet whole
                with pytest.raises(grpc.RpcError) as push:
                    stub.Push(_push_request(len(answers)), timeout=5)
                assert push.value.code() in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.FAILED_PRECONDITION,
                ), push.value.details()
            else:
                assert reply.group.update_count == 1  # no probe's push stepped
                answers.append("found")
                break
            assert time.monotonic() < deadline, answers
            time.sleep(0.05)
    log = standby_log.read_text()
    print(f"{len(answers)} answers, first {answers[0]!r}")
    assert not [a for a in answers if a.startswith("NOT_FOUND")], answers
    for answer in answers[:-1]:
        assert answer.startswith("UNAVAILABLE: no group named 'g' yet: this server "
                                 "is taking the lead"), answer  # fmt: skip
    _wait_ready(rs.addresses[1])
    # The case was met: the standby took the lead before it applied the create.
    led = _logged_at(log, "m1 is the primary of shard")
    compiled = _logged_at(log, "fused kernels ready")
    if compiled is None or led is None or compiled < led:
        pytest.skip("the standby applied the create before it took the lead")
    assert len(answers) > 1, answers


def _push_request(seq: int) -> pb.PushRequest:
    g = np.full(SIZE, 0.5, np.float32)
    tensor = pb.Tensor(
        name="x", dtype=pb.DATA_TYPE_FLOAT, dims=[g.size], raw_data=g.tobytes()
    )
    return pb.PushRequest(group="g", gradients=[tensor], client_id="probe", seq=seq)


def _logged_at(log: str, text: str) -> str | None:
    """The time stamp of the first log line with ``text`` (sortable text)."""
    for line in log.splitlines():
        if text in line:
            return line[:23]
    return None
