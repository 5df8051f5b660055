"""A frozen primary (issue 36, item 4): SIGSTOP of a replicated shard's primary.
Real etcd, real ``onnxps serve`` processes.

A call waiting on the frozen primary used to wait out its whole deadline (the
server's socket stays open, nothing answers); the client of ``etcd://`` now pings
the server a call waits on, finds it silent within about 2 s, and resends to the
primary etcd elects meanwhile, with the same seq (exactly once).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
from _replica_sets import G, Replicas, _create
from _replicas import _serial
from onnxps.client import Client


@pytest.mark.slow
def test_a_push_waiting_on_a_frozen_primary_goes_to_the_new_one(
    replica_sets: Any,
) -> None:
    rs: Replicas = replica_sets(3)
    p = rs.primary_with_group()
    times: list[float] = []
    with Client(rs.url, timeout=60, client_id="w") as c:
        assert c.push("g", G) == 1
        # a later push is in flight when the primary freezes
        os.kill(rs.procs[p].pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            assert c.push("g", G) == 2
            times.append(time.monotonic() - start)
            new = rs.primary(not_=p)
            assert c.address == rs.addresses[new]
            assert c.push("g", G) == 3
        finally:
            os.kill(rs.procs[p].pid, signal.SIGCONT)
    # well inside the 60 s deadline: the lease (2 s), the election, the resend
    assert times[0] < 20, times
    for i in rs.procs:
        if i != p:
            rs.wait_t(i, "g", 3)
            np.testing.assert_array_equal(rs.state(i, "g")[1], _serial([G] * 3))


@pytest.mark.slow
def test_a_push_in_flight_when_the_primary_freezes_is_applied_once(
    replica_sets: Any,
) -> None:
    """Pushes keep going while the primary freezes: each is acknowledged once, at
    its own T, by one primary or the other."""
    rs: Replicas = replica_sets(3)
    p = rs.primary_with_group()
    ts: list[int] = []
    done = threading.Event()

    def pushes() -> None:
        with Client(rs.url, timeout=60, client_id="w2") as c:
            while not done.is_set() and len(ts) < 400:
                ts.append(c.push("g", G))

    worker = threading.Thread(target=pushes)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while len(ts) < 5:  # pushes under way, acknowledged by this primary
            assert time.monotonic() < deadline, f"stuck at {len(ts)} pushes"
            time.sleep(0.01)
        os.kill(rs.procs[p].pid, signal.SIGSTOP)
        new = rs.primary(not_=p)
        deadline = time.monotonic() + 30
        n = len(ts)
        while len(ts) < n + 5:  # pushes acknowledged by the new primary
            assert time.monotonic() < deadline, f"stuck at {len(ts)} pushes"
            time.sleep(0.05)
    finally:
        done.set()
        worker.join(timeout=90)
        os.kill(rs.procs[p].pid, signal.SIGCONT)
    assert ts == list(range(1, len(ts) + 1))
    rs.wait_t(new, "g", len(ts))
    np.testing.assert_array_equal(rs.state(new, "g")[1], _serial([G] * len(ts)))


@pytest.mark.slow
def test_a_live_server_takes_the_pings_of_a_call_that_waits(
    replica_sets: Any,
) -> None:
    """The pings go on for as long as a call waits with no data moving (here a
    push waiting for a frozen synchronous standby): a server that took them as
    abuse (gRPC's default: two pings in 5 minutes without data) would end the
    connection, too_many_pings, and the call would fail UNAVAILABLE early."""
    import grpc
    from onnxps.client._settings import channel_options
    from onnxps.v1 import parameter_server_pb2 as pb
    from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

    rs: Replicas = replica_sets(2)
    p = rs.primary()
    s = 1 - p
    assert rs.wait_sync() == [f"m{s}"]
    _create(rs)
    tensor = pb.Tensor(
        name="x", dtype=pb.DATA_TYPE_FLOAT, dims=[G.size], raw_data=G.tobytes()
    )
    request = pb.PushRequest(group="g", gradients=[tensor], client_id="ka", seq=1)
    os.kill(rs.procs[s].pid, signal.SIGSTOP)
    try:
        options = channel_options(None, follows=True)
        with grpc.insecure_channel(rs.addresses[p], options) as ch:
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.ParameterServerServiceStub(ch).Push(request, timeout=4.5)
            waited = time.monotonic() - start
    finally:
        os.kill(rs.procs[s].pid, signal.SIGCONT)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
    assert waited >= 4.0  # four pings, each answered: the call ran to its deadline
