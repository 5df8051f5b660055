"""Refused calls carry google.rpc error details a client in any language can read.

Each case is checked twice: through the Python client's exception (``reason``,
``metadata``, ``violations``) and through the raw gRPC status details, as a client
in another language would read them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from onnxps.client import (
    Adagrad,
    Async,
    Client,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from onnxps.server.app import ServerHandle
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import array_to_tensor, chunk_messages, header_tensor

W = np.zeros(3, np.float32)


def raw_details(
    call: Callable[[], Any],
) -> tuple[grpc.StatusCode, error_details_pb2.ErrorInfo, list[Any]]:
    """Code, ErrorInfo and BadRequest field violations of a refused raw call."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    status = rpc_status.from_call(err.value)  # type: ignore[arg-type]
    assert status is not None, "no google.rpc.Status in the trailers"
    info = error_details_pb2.ErrorInfo()
    violations: list[Any] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            detail.Unpack(info)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations += bad.field_violations
    assert status.code == err.value.code().value[0]
    return err.value.code(), info, violations


def test_stale_push_is_failed_precondition_with_the_current_t(
    client: Client, stub: pb_grpc.ParameterServerServiceStub
) -> None:
    client.create_group(
        "stale",
        Adagrad(),
        learning_rate=0.1,
        tensors={"w": W},
        consistency=Async(max_staleness=1),
    )
    client.push("stale", np.ones(3, np.float32))
    client.push("stale", np.ones(3, np.float32))
    with pytest.raises(FailedPreconditionError) as err:
        client.push("stale", np.ones(3, np.float32), base_version=0)
    assert err.value.reason == "STALE_PUSH"
    assert err.value.metadata == {
        "group": "stale",
        "update_count": "2",
        "max_staleness": "1",
    }
    assert err.value.violations == []

    request = pb.PushRequest(
        group="stale", gradients=[array_to_tensor(np.ones(3, np.float32))]
    )
    request.base_version = 0
    code, info, violations = raw_details(lambda: stub.Push(request, timeout=10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert (info.reason, info.domain) == ("STALE_PUSH", "onnxps.v1")
    assert dict(info.metadata)["update_count"] == "2"
    assert violations == []


def test_unknown_group_is_not_found_with_its_name(
    client: Client, stub: pb_grpc.ParameterServerServiceStub
) -> None:
    with pytest.raises(NotFoundError) as err:
        client.describe_group("nope")
    assert (err.value.reason, err.value.metadata) == (
        "GROUP_NOT_FOUND",
        {"group": "nope"},
    )

    code, info, _ = raw_details(
        lambda: stub.DescribeGroup(pb.DescribeGroupRequest(group="nope"), timeout=10)
    )
    assert code == grpc.StatusCode.NOT_FOUND
    assert (info.reason, info.domain, dict(info.metadata)) == (
        "GROUP_NOT_FOUND",
        "onnxps.v1",
        {"group": "nope"},
    )


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_wrong_shape_gradient_names_the_field(
    server: ServerHandle, stub: pb_grpc.ParameterServerServiceStub, transport: Any
) -> None:
    with Client(server.address, transport=transport, timeout=30) as client:
        client.create_group("shape", Adagrad(), learning_rate=0.1, tensors={"w": W})
        with pytest.raises(InvalidArgumentError) as err:
            client.push("shape", np.ones(4, np.float32))
    assert err.value.reason == "SHAPE_MISMATCH"
    assert err.value.metadata == {
        "group": "shape",
        "expected": "(3,)",
        "received": "(4,)",
    }
    assert [field for field, _ in err.value.violations] == ["gradients[0].dims"]
    assert "must have shape (3,), got (4,)" in err.value.violations[0][1]

    g = np.ones(4, np.float32)
    if transport == "unary":
        request = pb.PushRequest(group="shape", gradients=[array_to_tensor(g)])
        code, info, violations = raw_details(lambda: stub.Push(request, timeout=10))
    else:
        header = pb.PushRequest(group="shape", gradients=[header_tensor(g)])
        messages = [pb.PushStreamRequest(header=header)]
        messages += chunk_messages(pb.PushStreamRequest, [g])
        code, info, violations = raw_details(
            lambda: stub.PushStream(iter(messages), timeout=10)
        )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.reason == "SHAPE_MISMATCH"
    assert [(v.field, "(4,)" in v.description) for v in violations] == [
        ("gradients[0].dims", True)
    ]


def test_a_malformed_tensor_is_invalid_tensor_naming_its_field_and_group(
    client: Client, stub: pb_grpc.ParameterServerServiceStub
) -> None:
    client.create_group("fmt", Adagrad(), learning_rate=0.1, tensors={"w": W})
    bad = pb.Tensor(dtype=pb.DATA_TYPE_FLOAT, dims=[3], raw_data=b"1234")
    request = pb.PushRequest(group="fmt", gradients=[bad])
    code, info, violations = raw_details(lambda: stub.Push(request, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert (info.reason, dict(info.metadata)) == ("INVALID_TENSOR", {"group": "fmt"})
    assert [v.field for v in violations] == ["gradients[0].raw_data"]


def test_details_of_a_huge_group_name_stay_within_the_metadata_limit(
    client: Client, stub: pb_grpc.ParameterServerServiceStub
) -> None:
    name = "é" * 3000  # 6000 bytes of UTF-8: over 8 KiB as the trailers carry it
    for _ in range(20):  # over the soft limit, grpc refuses calls at random
        with pytest.raises(NotFoundError) as err:
            client.describe_group(name)
        assert err.value.reason == "GROUP_NOT_FOUND"
        value = err.value.metadata["group"]
        assert value.endswith(" [...]") and name.startswith(value[:-6])
        assert len(value.encode()) <= 256
