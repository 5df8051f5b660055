"""A standby answers a resent push from its exactly-once window (issue 23): a defect
found by running docker-compose.yml's replicated profile as local processes
(tests/containers/test_compose_replicated.py).

A standby refuses writes (FAILED_PRECONDITION, NOT_PRIMARY), but the push path looks
the (client_id, seq) up in the group's window before it asks whether this server
may acknowledge (``_run_in_order``: ``_dedup_lookup`` before ``journal.log``). A
resend that reaches a standby holding the record is answered as done. With compose
(``restart: unless-stopped``) that loses acknowledged pushes: a primary killed after
logging a push its standby never got comes back within its old lease, replays the
push into its window, is dialled by clients while etcd still names its address,
answers their resend "done", and then adopts the new primary's snapshot, which lacks
it. The profile's demo then ends at T=1199 of 1200 in about half the runs here.

Fixed: the push path asks the journal whether this server may accept a change
(``JournalEntry.check_writable``) before it looks in the window.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _etcd import EtcdProcess
from _procs import clean_env, start_server, stop
from onnxps.client import Adagrad, Client, NotFoundError
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import array_to_tensor


def _get(etcd: EtcdProcess, key: str) -> Any:
    import etcd3gw

    got = etcd3gw.Etcd3Client(
        host="127.0.0.1", port=etcd.client_port, api_path="/v3/", timeout=5
    ).get(key)
    return json.loads(got[0]) if got else None


def _wait(etcd: EtcdProcess, key: str, ok: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while not ok(value := _get(etcd, key)):
        assert time.monotonic() < deadline, f"{key} is {value!r} after {timeout} s"
        time.sleep(0.05)
    return value


@pytest.mark.slow
def test_a_standby_refuses_a_resent_push_it_holds(
    tmp_path: Path,
    etcd_server: EtcdProcess,
) -> None:
    url = etcd_server.url("ps")
    procs, addresses = {}, {}
    try:
        for name in ("m0", "m1"):
            procs[name], addresses[name] = start_server(
                tmp_path / f"{name}.log",
                "--durability", "wal",
                "--data-dir", str(tmp_path / name),
                "--coordinator", url,
                "--shard", "0/1",
                "--member-id", name,
                "--lease-ttl", "2",
                env=clean_env(),
            )  # fmt: skip
        primary = _wait(etcd_server, "/ps/shards/0/primary", bool)["member"]
        standby = "m1" if primary == "m0" else "m0"
        _wait(etcd_server, "/ps/shards/0/sync", lambda v: v and v["standbys"])
        with Client(url, timeout=30) as ps:
            ps.create_group(
                "g", Adagrad(), learning_rate=0.1, tensors={"x": np.zeros(4)}
            )
        request = pb.PushRequest(
            group="g",
            gradients=[array_to_tensor(np.ones(4))],
            client_id="resender",
            seq=1,
        )
        with grpc.insecure_channel(addresses[primary]) as ch:
            reply = pb_grpc.ParameterServerServiceStub(ch).Push(request, timeout=30)
        assert reply.update_count == 1  # acknowledged: the standby holds it
        with Client(addresses[standby], timeout=30) as s:
            # the standby acknowledges a record once durable and applies it after
            # (the create too): its group may not be there yet
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(NotFoundError):
                    if s.describe_group("g").update_count == 1:
                        break
                assert time.monotonic() < deadline
                time.sleep(0.05)

        with grpc.insecure_channel(addresses[standby]) as ch:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.ParameterServerServiceStub(ch).Push(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not the primary" in (err.value.details() or "")
    finally:
        for p in procs.values():
            stop(p)
