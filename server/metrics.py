"""Prometheus metrics (issue 7)."""

from __future__ import annotations

from typing import Any

import grpc

__all__ = ["attach", "interceptors"]


def interceptors(config: Any) -> list[grpc.ServerInterceptor]:
    return []


def attach(handle: Any) -> None:
    """Start the metrics endpoint for a server handle, if configured."""
