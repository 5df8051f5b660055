"""What a shard answers about a group a resharding moved (MOVED, never NOT_FOUND) or is
moving to it (held, then GROUP_IMPORTING), and a client whose placement map is stale
following it (docs/resharding.md)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from _etcd import EtcdProcess
from _reshard import EtcdCluster, create_groups, push
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from onnxps.cli.reshard import reshard, reshard_status
from onnxps.client import Client, FailedPreconditionError
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
    tmp_path: Path, etcd_server: EtcdProcess
) -> None:
    cluster = EtcdCluster(tmp_path, etcd_server)
    try:
        cluster.start(0, 2)
        cluster.start(1, 2)
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
    finally:
        cluster.close()


def test_a_group_on_its_way_in_is_held_then_unavailable(
    tmp_path: Path, etcd_server: EtcdProcess
) -> None:
    cluster = EtcdCluster(tmp_path, etcd_server)
    try:
        cluster.start(0, 1)
        address = cluster.start(1, 2)  # a new shard: it owns nothing yet
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
    finally:
        cluster.close()
