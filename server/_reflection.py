"""gRPC server reflection, v1 and v1alpha.

grpcio-reflection serves only ``grpc.reflection.v1alpha.ServerReflection``; current
tools (grpcurl, Postman, grpc-go's reflection client) ask for
``grpc.reflection.v1.ServerReflection`` first. The two protocols are wire-identical
(v1 is v1alpha under a new package), so one servicer answers both: v1 is served by a
generic handler with the v1alpha messages, and a v1 copy of the descriptor is added
to the pool so that v1 can itself be described.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

__all__ = ["V1", "V1ALPHA", "enable_reflection"]

V1ALPHA = reflection.SERVICE_NAME  # "grpc.reflection.v1alpha.ServerReflection"
V1 = "grpc.reflection.v1.ServerReflection"
_METHOD = "ServerReflectionInfo"


def _add_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(V1)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", ".grpc.reflection.v1."
    proto.name = "grpc/reflection/v1/reflection.proto"
    proto.package = "grpc.reflection.v1"
    proto.options.Clear()
    for message in proto.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = field.type_name.replace(old, new, 1)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new, 1)
            method.output_type = method.output_type.replace(old, new, 1)
    pool.Add(proto)


def enable_reflection(service_names: Sequence[str], server: grpc.Server) -> None:
    """Serve reflection (v1 and v1alpha) listing ``service_names`` and both."""
    _add_v1_descriptor()
    servicer = reflection.ReflectionServicer((*service_names, V1, V1ALPHA))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1, {_METHOD: v1}),)
    )
