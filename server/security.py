"""Transport security, token authentication and the safe-bind policy (issue 7)."""

from __future__ import annotations

from typing import Any

import grpc

__all__ = ["check_bind_policy", "interceptors", "server_credentials"]


def check_bind_policy(config: Any) -> None:
    """Refuse a non-loopback bind without TLS and auth unless ``insecure``."""


def interceptors(config: Any) -> list[grpc.ServerInterceptor]:
    return []


def server_credentials(config: Any) -> grpc.ServerCredentials | None:
    return None
