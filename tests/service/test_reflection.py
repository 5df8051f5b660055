"""Server reflection answers under v1 and v1alpha, as grpcurl and others ask."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2
from onnxps.server.app import ServerHandle

SERVICES = {
    "onnxps.v1.ParameterServerService",
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
}


def _ask(
    server: ServerHandle, version: str, request: reflection_pb2.ServerReflectionRequest
) -> reflection_pb2.ServerReflectionResponse:
    # v1 is wire-identical to v1alpha: the same messages on another path
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        (reply,) = list(call(iter([request]), timeout=5))
    return reply


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_every_service(server: ServerHandle, version: str) -> None:
    reply = _ask(
        server, version, reflection_pb2.ServerReflectionRequest(list_services="")
    )
    assert {s.name for s in reply.list_services_response.service} == SERVICES


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
@pytest.mark.parametrize(
    ("symbol", "file"),
    [
        ("onnxps.v1.ParameterServerService", "onnxps/v1/parameter_server.proto"),
        ("grpc.reflection.v1.ServerReflection", "grpc/reflection/v1/reflection.proto"),
    ],
)
def test_reflection_describes_a_service(
    server: ServerHandle, version: str, symbol: str, file: str
) -> None:
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
    reply = _ask(server, version, request)
    assert reply.WhichOneof("message_response") == "file_descriptor_response"
    raw = reply.file_descriptor_response.file_descriptor_proto
    names = [descriptor_pb2.FileDescriptorProto.FromString(r).name for r in raw]
    assert names[0] == file
