"""Chunk (de)serializers for the streaming RPCs, each byte copied once.

The generated handlers parse every stream message with protobuf, which copies a
chunk's bytes into the message and again when the servicer reads the field. This
interceptor, the innermost, gives the streaming methods the parsers and serializers
of ``onnxps.client._wire``: a chunk arrives as a zero-copy view of the received bytes
and leaves written straight from the array. Anything that is not a canonical chunk
goes through protobuf as before, with its usual errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from onnxps.client._wire import deserializer, serializer
from onnxps.v1 import parameter_server_pb2 as pb

from ._handlers import SERVICE, method_of, rewrap

__all__ = ["FastChunkInterceptor"]

Parse = Callable[[bytes], Any] | None
Write = Callable[[Any], bytes] | None

_METHODS: dict[str, tuple[Parse, Write]] = {
    "CreateGroupStream": (deserializer(pb.CreateGroupStreamRequest, 2), None),
    "PushStream": (deserializer(pb.PushStreamRequest, 2), None),
    "PullStream": (None, serializer(2)),
    "ApplyStream": (deserializer(pb.ApplyStreamRequest, 3), serializer(3)),
}


class FastChunkInterceptor(grpc.ServerInterceptor):
    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = continuation(handler_call_details)
        service, method = method_of(handler_call_details)
        codecs = _METHODS.get(method) if service == SERVICE else None
        if handler is None or codecs is None:
            return handler
        parse, write = codecs
        return rewrap(handler, None, parse, write)
