"""The one table from domain errors to gRPC status codes."""

from __future__ import annotations

import grpc
from onnxps.client.codec import TensorFormatError

from . import errors
from .store import DeadlineExceeded

__all__ = ["status_for"]

_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (TensorFormatError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def status_for(exc: BaseException) -> grpc.StatusCode | None:
    """The status code of a domain error; None for anything unexpected (a bug)."""
    for cls, code in _TABLE:
        if isinstance(exc, cls):
            return code
    return None
