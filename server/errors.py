"""Domain errors of the server core.

Neither the kernels nor the store import grpc: they raise these, and the servicer maps
each class to one gRPC status code (``onnxps.server._status``). Every message says what
was expected and what came.
"""

from __future__ import annotations

__all__ = [
    "AlreadyExists",
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "OnnxpsError",
    "PermissionDenied",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
]


class OnnxpsError(Exception):
    """Base class of every error the server core raises on purpose."""


class InvalidArgument(OnnxpsError, ValueError):
    """Wrong dtype, shape, count, attribute or value."""


class NotFound(OnnxpsError, LookupError):
    """An unknown group."""


class AlreadyExists(OnnxpsError):
    """A group of that name exists already."""


class FailedPrecondition(OnnxpsError):
    """The request is well-formed but the state does not allow it (stale push...)."""


class ResourceExhausted(OnnxpsError):
    """Over a configured limit."""


class Unauthenticated(OnnxpsError):
    """No or an unknown credential."""


class PermissionDenied(OnnxpsError):
    """A known credential that may not do this."""


class Unavailable(OnnxpsError):
    """The server is shutting down or cannot serve now; the client may retry."""
