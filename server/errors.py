"""Domain errors of the server core.

Neither the kernels nor the store import grpc: they raise these, and the servicer maps
each class to one gRPC status code (``onnxps.server.interceptors._status``). Every
message says what was expected and what came; ``reason``, ``metadata`` and ``field``
say it to a program (they travel as ``google.rpc.ErrorInfo`` and ``BadRequest`` in the
status details).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

__all__ = [
    "AlreadyExists",
    "DeadlineExceeded",
    "DomainError",
    "FailedPrecondition",
    "InvalidArgument",
    "Moved",
    "NotFound",
    "JOURNAL_REFUSALS",
    "NotLogged",
    "PermissionDenied",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
]


class DomainError(Exception):
    """Base class of every error the server core raises on purpose.

    ``reason`` is an UPPER_SNAKE constant a client can branch on (each class has a
    default); ``metadata`` the values that matter (group, update_count, expected,
    received...); ``field`` the request field at fault, when one is.
    """

    default_reason: ClassVar[str] = "ERROR"

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        metadata: Mapping[str, object] | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason or self.default_reason
        self.metadata = {k: str(v) for k, v in (metadata or {}).items()}
        self.field = field


class InvalidArgument(DomainError, ValueError):
    """Wrong dtype, shape, count, attribute or value."""

    default_reason = "INVALID_ARGUMENT"


class NotFound(DomainError, LookupError):
    """An unknown group."""

    default_reason = "GROUP_NOT_FOUND"


class AlreadyExists(DomainError):
    """A group of that name exists already."""

    default_reason = "GROUP_EXISTS"


class FailedPrecondition(DomainError):
    """The request is well-formed but the state does not allow it (stale push...)."""

    default_reason = "FAILED_PRECONDITION"


class Moved(FailedPrecondition):
    """The group is owned by another shard now (or is about to be): a resharding
    moved it (docs/resharding.md). ``metadata``: ``group``, ``shard`` (its owner,
    when known) and ``map_version``; the client reads the placement map again and
    resends there."""

    default_reason = "MOVED"


class ResourceExhausted(DomainError):
    """Over a configured limit."""

    default_reason = "LIMIT_EXCEEDED"


class Unauthenticated(DomainError):
    """No or an unknown credential."""

    default_reason = "UNAUTHENTICATED"


class PermissionDenied(DomainError):
    """A known credential that may not do this."""

    default_reason = "PERMISSION_DENIED"


class Unavailable(DomainError):
    """The server is shutting down or cannot serve now; the client may retry."""

    default_reason = "SHUTTING_DOWN"


class DeadlineExceeded(DomainError):
    """A wait (pull with min_version, push waiting for its sync step) timed out."""

    default_reason = "VERSION_NOT_REACHED"


class NotLogged(DomainError):
    """The journal could not keep a change, which was therefore not applied (a
    write-ahead log write that failed, a full disk, a log no longer on disk); the
    concrete class also derives from the status class that says so."""

    default_reason = "WAL_WRITE_FAILED"


# What a journal (the log, a replicated shard's) refuses a change with: the change
# was not applied, and what was prepared for it is undone.
JOURNAL_REFUSALS = (Unavailable, NotLogged)
