"""The client's exceptions; ``translate`` is the one place grpc errors map to them."""

from __future__ import annotations

import os
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


# What a plaintext client meets at a TLS port: the server closes the connection on
# the first bytes, which are not a TLS handshake.
_PLAINTEXT_AT_TLS = "Socket closed"
_TLS_HINT = (
    " (if the server uses TLS, this client spoke plaintext to it: pass the CA that "
    "signed its certificate, Client(address, root_certificates=ca_pem) with the PEM "
    "bytes, or --tls-ca ca.pem on the command line)"
)

# What a TLS client meets at a plaintext port: the answer to its TLS hello is not
# TLS (gRPC's details run to 300 characters of OpenSSL and say nothing of that).
_TLS_AT_PLAINTEXT = "WRONG_VERSION_NUMBER"
_PLAINTEXT_HINT = (
    "the TLS handshake failed: the server did not answer in TLS "
    "(WRONG_VERSION_NUMBER). If it runs without TLS, this client spoke TLS to it: "
    "leave out root_certificates (--tls-ca on the command line), or give the "
    "server --tls-cert and --tls-key"
)


def _hinted(code: grpc.StatusCode, details: str) -> str:
    """``details``, with what to do where gRPC's words do not say it."""
    if code == grpc.StatusCode.UNAVAILABLE and _PLAINTEXT_AT_TLS in details:
        return details + _TLS_HINT
    if code == grpc.StatusCode.UNAVAILABLE and _TLS_AT_PLAINTEXT in details:
        return _PLAINTEXT_HINT
    return details


def translate(error: grpc.RpcError) -> RpcError:
    """The library's exception for a grpc error (a grpc.Call carries code/details)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    details = _hinted(code, details or "")
    reason, metadata, violations = _status_details(error)
    cls = _BY_CODE.get(code, RpcError)
    return cls(
        details or code.name,
        code,
        reason=reason,
        metadata=metadata,
        violations=violations,
    )


_REFUSED_CALLERS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def surfaced(error: RpcError, call: str) -> RpcError:
    """``error`` as the public method ``call`` raises it.

    It says which of the client's calls a refused token or role stopped when the
    RPC the server names is another (``pull`` asks ``DescribeGroup`` first). And
    it drops the client's own frames from the traceback (the generator machinery
    of the operations, some 30 of them), which say nothing the status does not:
    the traceback is the user's call and the public method that raises this.
    ``ONNXPS_DEBUG=1`` keeps them."""
    rpc = error.metadata.get("method", "").lower()
    own = call.replace("_", "").lower()  # push_detailed: Push, PushStream
    if (
        error.code in _REFUSED_CALLERS
        and rpc
        and not (rpc.startswith(own) or own.startswith(rpc))
        and not error.details.startswith(f"{call}()")
    ):
        error.details = f"{call}() was refused: {error.details}"
    if os.environ.get("ONNXPS_DEBUG"):
        return error
    return error.with_traceback(None)
