"""The client's exceptions; ``translate`` is the one place grpc errors map to them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from onnxps.wire.errors import OnnxpsError

__all__ = [
    "AlreadyExistsError",
    "ClientClosedError",
    "DataChannelError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "OnnxpsError",
    "PartsDivergedError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "RpcError",
    "SharedMemoryError",
    "UnauthenticatedError",
    "UnavailableError",
    "translate",
]


class ClientClosedError(OnnxpsError):
    """The client was closed; create a new one."""


class SharedMemoryError(OnnxpsError):
    """``shared_memory="on"`` where client and server cannot share memory (another
    host, another user, no shared /dev/shm, or the server turned it off)."""


class DataChannelError(OnnxpsError):
    """``data_channel="on"`` where the server gives no data channel (it serves
    none, its port cannot be reached, or it refused the connection)."""


class RpcError(OnnxpsError):
    """The server answered with a non-OK status.

    ``reason`` (e.g. ``"STALE_PUSH"``, ``"GROUP_NOT_FOUND"``) and ``metadata`` (e.g.
    ``{"group": "g", "update_count": "7"}``) come from the status' ErrorInfo;
    ``violations`` lists ``(field, description)`` from its BadRequest. They are
    None / empty when the server sent no details (an older server, a proxy).
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        details: str,
        code: grpc.StatusCode | None = None,
        *,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
        violations: Sequence[tuple[str, str]] = (),
    ) -> None:
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code
        self.reason = reason
        self.metadata: dict[str, str] = dict(metadata or {})
        self.violations: list[tuple[str, str]] = list(violations)

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


class PartsDivergedError(FailedPreconditionError):
    """The parts of a split group disagree: they are at different T after waiting
    for the pushes in flight (``reason`` ``"PARTS_APART"``), or a part refused for
    good a push the others applied (``"PART_REFUSED"``). ``group`` names the group;
    ``update_counts`` is each part's T in part order (empty when not known).
    docs/cluster.md, "When the parts of a split group disagree", says how to repair
    it."""

    def __init__(
        self,
        details: str,
        *,
        group: str,
        update_counts: Sequence[int] = (),
        reason: str = "PARTS_APART",
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        meta = {"group": group, **(metadata or {})}
        if update_counts:
            meta["update_counts"] = ",".join(str(t) for t in update_counts)
        super().__init__(details, reason=reason, metadata=meta)
        self.group = group
        self.update_counts = [int(t) for t in update_counts]


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


def _status_details(
    error: grpc.RpcError,
) -> tuple[str | None, dict[str, str], list[tuple[str, str]]]:
    """ErrorInfo reason and metadata, and BadRequest violations, of a failed call."""
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except (AttributeError, ValueError):  # not a call, or inconsistent trailers
        status = None
    reason: str | None = None
    metadata: dict[str, str] = {}
    violations: list[tuple[str, str]] = []
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, metadata = info.reason, dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations += [(v.field, v.description) for v in bad.field_violations]
    return reason, metadata, violations


def translate(error: grpc.RpcError) -> RpcError:
    """The library's exception for a grpc error (a grpc.Call carries code/details)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    reason, metadata, violations = _status_details(error)
    cls = _BY_CODE.get(code, RpcError)
    return cls(
        details or code.name,
        code,
        reason=reason,
        metadata=metadata,
        violations=violations,
    )
