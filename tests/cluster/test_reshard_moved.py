"""What a shard answers about a group a resharding moved (MOVED, never NOT_FOUND) or is
moving to it (held, then GROUP_IMPORTING), and a client whose placement map is stale
following it (docs/resharding.md)."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import time
import urllib.request
from typing import Any

import grpc
import numpy as np
import pytest
from _etcd import EtcdProcess
from _procs import clean_env
from _reshard import EtcdCluster, create_groups, push, shapes_of
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from onnxps.cli.reshard import reshard, reshard_status
from onnxps.client import AsyncClient, Client, FailedPreconditionError
from onnxps.client._cluster import base_name
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow


def _info(err: grpc.RpcError) -> tuple[str, dict[str, str]]:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return str(info.reason), dict(info.metadata)
    return "", {}


def test_a_client_with_a_stale_map_follows_moved_and_pushes_land_once(
    etcd_cluster: EtcdCluster,
) -> None:
    cluster = etcd_cluster
    cluster.start_shards(2)
    with cluster.connect(client_id="stale") as stale:
        names = create_groups(stale, 10, 3, ids=False)
        for step, name in enumerate(names):
            push(stale, name, 0, step)
        assert stale.shards == 2
        cluster.start(2, 3)
        report = reshard(cluster.url, 3)
        moved = {m.name: m for m in report.moves}
        assert moved and {m.target for m in moved.values()} == {2}
        # the stale client has not read the map since: MOVED sends it there
        for step, name in enumerate(names):
            push(stale, name, 0, 100 + step)
        assert stale.shards == 3
        for name in names:
            info = stale.describe_group(name)
            assert info.update_count == 2, name
            assert all(p.update_count == 2 for p in info.parts), name
    # the source answers MOVED with the new owner and the map's version
    version = reshard_status(cluster.url)["map_version"]
    name, m = sorted(moved.items())[0]
    with grpc.insecure_channel(cluster.addresses[m.source]) as ch:
        stub = pb_grpc.ParameterServerServiceStub(ch)
        for call in (
            lambda: stub.DescribeGroup(pb.DescribeGroupRequest(group=name)),
            lambda: stub.Pull(pb.PullRequest(group=name)),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            reason, metadata = _info(err.value)
            assert reason == "MOVED"
            # the version of the map that flipped it, or a later one
            seen = int(metadata.pop("map_version"))
            assert 1 < seen <= version
            assert metadata == {"group": name, "shard": "2"}
    # and a one-server client of the old shard gets the same, as an exception
    with Client(cluster.addresses[m.source], timeout=5) as one:
        with pytest.raises(FailedPreconditionError) as moved_err:
            one.pull(name)
        assert moved_err.value.reason == "MOVED"
        assert moved_err.value.metadata["shard"] == "2"
        assert name not in {g.name for g in one.list_groups()}


def _status(url: str) -> str:
    """What ``onnxps status URL`` prints (it exits 0)."""
    done = subprocess.run(
        [sys.executable, "-m", "onnxps.cli", "status", url],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_group_on_its_way_in_is_held_then_unavailable(
    etcd_cluster: EtcdCluster, etcd_server: EtcdProcess
) -> None:
    cluster = etcd_cluster
    cluster.start(0, 1)
    address = cluster.start(1, 2)  # a new shard: it owns nothing yet
    assert "it owns nothing until a resharding" in cluster.log(1)
    status = _status(cluster.url)
    assert (
        f"shard 1 owns nothing yet: it holds groups once `onnxps reshard "
        f"{cluster.url} --shards 2` (or more)"
    ) in status
    # shard 0 restarted with the count the cluster grows to: it joins
    cluster.stop(0)
    cluster.start(0, 2)
    # a shard of a cluster found through etcd checks the index a call was
    # routed to, not the count (a resharding changes it)
    with grpc.insecure_channel(cluster.addresses[0]) as ch:
        stub = pb_grpc.ParameterServerServiceStub(ch)
        listed = stub.ListGroups(
            pb.ListGroupsRequest(), metadata=(("onnxps-shard", "0/7"),)
        )
        assert list(listed.groups) == []
        with pytest.raises(grpc.RpcError) as err:
            stub.ListGroups(pb.ListGroupsRequest(), metadata=(("onnxps-shard", "1/2"),))
        assert _info(err.value)[0] == "SHARD_LAYOUT_MISMATCH"
    # a move under way, as the map records it: status says so
    _etcd_put(
        etcd_server.endpoint,
        "/ps/placement",
        {"version": 1, "shards": 1, "serving": 2, "owners": {},
         "moving": {"h": {"from": 0, "to": 1}}},
    )  # fmt: skip
    status = _status(cluster.url)
    assert "moving h: shard 0 -> 1 (a resharding)" in status
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.ParameterServerServiceStub(ch)
        begin = pb.MoveGroupRequest(group="g", step=pb.MOVE_STEP_BEGIN_IMPORT)
        assert not stub.MoveGroup(begin).present
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            stub.DescribeGroup(pb.DescribeGroupRequest(group="g"), timeout=20)
        held = time.monotonic() - started
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _info(err.value) == ("GROUP_IMPORTING", {"group": "g"})
        assert 4.5 < held < 15
        # activating what was never imported is refused
        activate = pb.MoveGroupRequest(group="g", step=pb.MOVE_STEP_ACTIVATE)
        with pytest.raises(grpc.RpcError) as err:
            stub.MoveGroup(activate)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        abort = pb.MoveGroupRequest(group="g", step=pb.MOVE_STEP_ABORT_IMPORT)
        stub.MoveGroup(abort)
        with pytest.raises(grpc.RpcError) as err:
            stub.DescribeGroup(pb.DescribeGroupRequest(group="g"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def _raw_push(address: str, group: str, seq: int, size: int) -> Any:
    g = np.full(size, 0.5, np.float32)
    tensor = pb.Tensor(
        name="w", dtype=pb.DATA_TYPE_FLOAT, dims=[size], raw_data=g.tobytes()
    )
    request = pb.PushRequest(group=group, gradients=[tensor], client_id="raw", seq=seq)
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.ParameterServerServiceStub(ch).Push(request, timeout=10)


def test_a_push_resent_across_the_cutover_is_not_applied_twice_even_after_a_kill(
    etcd_cluster: EtcdCluster,
) -> None:
    cluster = etcd_cluster
    cluster.start_shards(2)
    with cluster.connect() as admin:
        names = create_groups(admin, 10, 0, ids=False)
        cluster.start(2, 3)
        # a push each group's source applies: the window remembers (raw, 7)
        sizes = {n: admin.describe_group(n).element_count for n in names}
        owners = {n: admin.describe_group(n).parts[0].shard for n in names}
        for n in names:
            assert _raw_push(cluster.addresses[owners[n]], n, 7, sizes[n]).applied
        report = reshard(cluster.url, 3)
        moved = [m.name for m in report.moves]
        assert moved
    # the target killed -9 and restarted: the moves were logged there
    cluster.procs[2].kill()
    cluster.procs[2].wait()
    cluster.start(2, 3)
    end = time.monotonic() + 30  # its old lease ends, it leads again
    while True:
        try:
            _raw_push(cluster.addresses[2], moved[0], 7, sizes[moved[0]])
            break
        except grpc.RpcError as exc:
            assert _info(exc)[0] == "NOT_PRIMARY" and time.monotonic() < end
            time.sleep(0.2)
    for n in moved:
        reply = _raw_push(cluster.addresses[2], n, 7, sizes[n])
        assert reply.duplicate, n  # answered from the window it came with
        assert reply.update_count == 1, n
        assert _raw_push(cluster.addresses[2], n, 8, sizes[n]).update_count == 2
    with cluster.connect() as c:
        for n in names:
            want = 2 if n in moved else 1
            assert c.describe_group(n).update_count == want, n


def _etcd_put(endpoint: str, key: str, value: Any) -> None:
    body = {
        "key": base64.b64encode(key.encode()).decode(),
        "value": base64.b64encode(json.dumps(value).encode()).decode(),
    }
    request = urllib.request.Request(
        f"http://{endpoint}/v3/kv/put",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(request, timeout=5).close()


def _etcd_get(endpoint: str, key: str) -> Any:
    """A key's JSON value over etcd's gateway by hand (docs/resharding.md)."""
    body = {"key": base64.b64encode(key.encode()).decode()}
    request = urllib.request.Request(
        f"http://{endpoint}/v3/kv/range",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=5) as reply:
        kvs = json.loads(reply.read()).get("kvs", [])
    return json.loads(base64.b64decode(kvs[0]["value"])) if kvs else None


def test_a_client_written_from_the_docs_follows_the_map_and_moved(
    etcd_cluster: EtcdCluster, etcd_server: EtcdProcess
) -> None:
    """No onnxps client code: the map and the primaries read over plain HTTP, the
    calls made with the generated stubs, as docs/resharding.md says another
    language would."""
    cluster = etcd_cluster
    endpoint = etcd_server.endpoint
    cluster.start_shards(2)
    names = cluster.create_groups(8, 2, ids=False)
    cluster.start(2, 3)
    before = _etcd_get(endpoint, "/ps/placement")
    assert before is None  # never resharded: PREFIX/layout is the count
    report = reshard(cluster.url, 3)
    doc = _etcd_get(endpoint, "/ps/placement")
    assert doc["serving"] == doc["shards"] == 3 and doc["moving"] == {}
    assert {m.name: m.target for m in report.moves}.items() <= doc["owners"].items()

    def stub(shard: int) -> Any:
        primary = _etcd_get(endpoint, f"/ps/shards/{shard}/primary")
        channel = grpc.insecure_channel(primary["address"])
        return channel, pb_grpc.ParameterServerServiceStub(channel)

    channels, stubs = zip(*(stub(i) for i in range(doc["serving"])), strict=True)
    try:
        # a group's parts: every serving shard's listing, a name kept only on
        # the shard the map's owners name (when they name one)
        held: dict[str, int] = {}
        for i, s in enumerate(stubs):
            for g in s.ListGroups(pb.ListGroupsRequest()).groups:
                if doc["owners"].get(g.name, i) == i:
                    assert g.name not in held, g.name
                    held[g.name] = i
        assert len(held) == 8 + 2 * 2  # the split groups' parts
        # a call sent by a stale map to where the part was: MOVED, then there
        for m in report.moves:
            with pytest.raises(grpc.RpcError) as err:
                stubs[m.source].Pull(pb.PullRequest(group=m.name))
            reason, metadata = _info(err.value)
            assert reason == "MOVED" and metadata["shard"] == str(m.target)
            shard = int(metadata["shard"])
            assert shard == held[m.name]
            reply = stubs[shard].Pull(pb.PullRequest(group=m.name))
            assert reply.update_count == 0 and len(reply.tensors) >= 1
    finally:
        for ch in channels:
            ch.close()
    assert set(names) == {base_name(n)[0] for n in held}


def test_an_async_client_with_a_stale_map_follows_moved(
    etcd_cluster: EtcdCluster,
) -> None:
    cluster = etcd_cluster
    cluster.start_shards(2)
    names = cluster.create_groups(8, 2, ids=False)
    cluster.start(2, 3)

    async def run() -> list[int]:
        async with AsyncClient(cluster.url, timeout=30, split_bytes=256) as c:
            for name in names:  # the layouts remembered, the map read
                await c.describe_group(name)
            await asyncio.to_thread(reshard, cluster.url, 3)
            done = []
            for name in names:
                g = [np.full(s, 0.5, np.float32) for s in _shapes(name)]
                done.append(await c.push(name, *g))
            assert c.shards == 3
            return done

    assert asyncio.run(run()) == [1] * len(names)


def _shapes(name: str) -> list[tuple[int, ...]]:
    return list(shapes_of(name).values())
