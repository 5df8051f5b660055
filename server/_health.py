"""What this server's ``grpc.health.v1`` service says, and the health-only port.

- ``""`` and ``onnxps.v1.ParameterServerService``: SERVING while the server serves;
  NOT_SERVING before it starts, while its write-ahead log cannot be written, and
  once it drains.
- ``onnxps.ready`` (``READY``): SERVING when the server serves *and* holds what its
  shard acknowledged: always on an unreplicated server; on a replica, when it is the
  primary (a promoted standby: once it applied every record it received), or a
  standby following the current term's primary (which names it in etcd) and
  holding every record the primary had logged when it last published its
  position in etcd (about every lease TTL / 3). Kubernetes' readiness
  probe asks this one, so a rolling update waits for a restarted replica to catch
  up (it can then be promoted) before it restarts the next one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from onnxps.wire.codec import SERVICE

__all__ = ["READY", "Health", "health_host", "health_server"]

READY = "onnxps.ready"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# listens on an address with credentials (None: plaintext), returns the port
Bind = Callable[[grpc.Server, str, "grpc.ServerCredentials | None"], int]


class Health:
    """The statuses of one health servicer (shared by the main port and the
    plaintext health port): whether the server serves, and whether it holds what
    its shard acknowledged (``caught_up``; True from the start when unreplicated)."""

    def __init__(self, servicer: health.HealthServicer, *, replicated: bool) -> None:
        self.servicer = servicer
        self._lock = threading.Lock()
        self._serving = False
        self._caught_up = not replicated
        self._publish()

    def set_serving(self, serving: bool) -> None:
        with self._lock:
            self._serving = serving
            self._publish()

    def set_caught_up(self, caught_up: bool) -> None:
        with self._lock:
            self._caught_up = caught_up
            self._publish()

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING from now on, for good (a server draining)."""
        self.servicer.enter_graceful_shutdown()

    def _publish(self) -> None:
        status = SERVING if self._serving else NOT_SERVING
        self.servicer.set("", status)
        self.servicer.set(SERVICE, status)
        ready = self._serving and self._caught_up
        self.servicer.set(READY, SERVING if ready else NOT_SERVING)


def health_server(
    address: str, port: int | None, servicer: health.HealthServicer, bind: Bind
) -> tuple[grpc.Server | None, int | None]:
    """The plaintext health-only server on ``port`` (none when None), beside the
    main server's ``address``. It shares the
    main server's health servicer (SERVING, NOT_SERVING, draining) and serves
    nothing else, so it needs no TLS and no token (health is open anyway)."""
    if port is None:
        return None, None
    server = grpc.server(futures.ThreadPoolExecutor(2, "onnxps-health"))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return server, bind(server, f"{health_host(address)}:{port}", None)


def health_host(address: str) -> str:
    """The host the plaintext health port listens on (loopback beside a socket)."""
    if address.startswith("unix"):
        return "127.0.0.1"
    return address.rsplit(":", 1)[0]
