"""The client's exceptions; ``translate`` is the one place grpc errors map to them."""

from __future__ import annotations

import grpc

__all__ = [
    "AlreadyExistsError",
    "ClientClosedError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "OnnxpsError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "RpcError",
    "UnauthenticatedError",
    "UnavailableError",
    "translate",
]


class OnnxpsError(Exception):
    """Base of every error the onnxps client raises."""


class ClientClosedError(OnnxpsError):
    """The client was closed; create a new one."""


class RpcError(OnnxpsError):
    """The server answered with a non-OK status."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


class InvalidArgumentError(RpcError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(RpcError, LookupError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(RpcError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPreconditionError(RpcError):
    """E.g. a stale push; pull and recompute."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(RpcError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnauthenticatedError(RpcError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(RpcError):
    code = grpc.StatusCode.PERMISSION_DENIED


class UnavailableError(RpcError):
    """The server is down or shutting down (retried before this is raised)."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(RpcError, TimeoutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class InternalError(RpcError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[RpcError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        AlreadyExistsError,
        FailedPreconditionError,
        ResourceExhaustedError,
        UnauthenticatedError,
        PermissionDeniedError,
        UnavailableError,
        DeadlineExceededError,
        InternalError,
    )
}


def translate(error: grpc.RpcError) -> RpcError:
    """The library's exception for a grpc error (a grpc.Call carries code/details)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    cls = _BY_CODE.get(code, RpcError)
    return cls(details or code.name, code)
