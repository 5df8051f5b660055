"""The one table from domain errors to gRPC status codes, and their details.

A refused call carries a ``google.rpc.Status`` in its trailers: the code, the
message, a ``google.rpc.ErrorInfo`` (``reason``, ``domain``, ``metadata``) and, for
INVALID_ARGUMENT with a known field, a ``google.rpc.BadRequest`` field violation. A
client in any language reads them with its gRPC status library, without parsing the
message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from onnxps.wire.codec import TensorFormatError

from .. import errors

__all__ = [
    "DOMAIN",
    "details_of",
    "refuse",
    "rich_status",
    "status_for",
    "status_of",
]

DOMAIN = "onnxps.v1"  # ErrorInfo.domain of every onnxps error

# The status travels in the trailers twice (grpc-message, percent-encoded, and the
# details, base64): bounded so that a huge group name cannot take them past gRPC's
# default 8 KiB metadata limit, which the client would report as RESOURCE_EXHAUSTED.
MAX_MESSAGE_BYTES = 1024
MAX_VALUE_BYTES = 256

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
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
)

# Reasons of errors that are not DomainErrors.
_REASONS: tuple[tuple[type[BaseException], str], ...] = (
    (TensorFormatError, "INVALID_TENSOR"),
)


def status_for(exc: BaseException) -> grpc.StatusCode | None:
    """The status code of a domain error; None for anything unexpected (a bug)."""
    for cls, code in _TABLE:
        if isinstance(exc, cls):
            return code
    return None


def details_of(exc: BaseException) -> tuple[str, dict[str, str], str | None]:
    """``(reason, metadata, field)`` of an error."""
    if isinstance(exc, errors.DomainError):
        return exc.reason, dict(exc.metadata), exc.field
    for cls, reason in _REASONS:
        if isinstance(exc, cls):
            return reason, {}, None
    return "INTERNAL", {}, None


Trailers = Sequence[tuple[str, Any]]


@dataclass(frozen=True)
class _Status(grpc.Status):
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, Any], ...]


def _bounded(text: str, limit: int) -> str:
    raw = text.encode()
    if len(raw) <= limit:
        return text
    return raw[: limit - 6].decode(errors="ignore") + " [...]"


def _packed(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed


def rich_status(
    code: grpc.StatusCode,
    message: str,
    reason: str,
    metadata: Mapping[str, str] | None = None,
    field: str | None = None,
    trailers: Trailers = (),
) -> grpc.Status:
    """A status for ``context.abort_with_status`` with ErrorInfo (and BadRequest).

    ``trailers`` already set on the call (a request id...) are kept: the status
    replaces the call's trailing metadata.
    """
    message = _bounded(message, MAX_MESSAGE_BYTES)
    values = {k: _bounded(v, MAX_VALUE_BYTES) for k, v in (metadata or {}).items()}
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=values)
    details = [_packed(info)]
    if field is not None and code == grpc.StatusCode.INVALID_ARGUMENT:
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=field, description=_bounded(message, MAX_VALUE_BYTES)
        )
        details.append(
            _packed(error_details_pb2.BadRequest(field_violations=[violation]))
        )
    status = status_pb2.Status(code=code.value[0], message=message, details=details)
    plain = rpc_status.to_status(status)
    return _Status(plain.code, plain.details, (*trailers, *plain.trailing_metadata))


def status_of(
    exc: BaseException, trailers: Trailers = (), group: str | None = None
) -> grpc.Status | None:
    """The rich status of a domain error; None for anything unexpected. The
    ``group`` the call names goes in the metadata when the error left it out."""
    code = status_for(exc)
    if code is None:
        return None
    reason, metadata, field = details_of(exc)
    if group is not None:
        metadata.setdefault("group", group)
    return rich_status(code, str(exc), reason, metadata, field, trailers)


def refuse(
    context: grpc.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    reason: str,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """End the call with a rich status (an interceptor's refusal); raises.

    The trailers already set on the call (the request id echo) are kept.
    """
    kept = tuple(context.trailing_metadata() or ())
    context.abort_with_status(rich_status(code, message, reason, metadata, None, kept))
