"""The graceful stop's gate: refuse new calls with UNAVAILABLE, count the running ones.

``grpc.Server.stop`` cancels the calls gRPC has received but not yet handed to a
handler thread (the client sees a bare ``CANCELLED``: not retried, and it cannot tell
whether a push was applied). So a graceful stop first closes this gate: every call
that reaches a handler from then on is answered UNAVAILABLE, which clients retry (a
push with the same ``(client_id, seq)``, applied once), and the calls already past the
gate run to the end. Only when they have finished does the server itself stop, with
nothing left in flight to cancel.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc

from ._handlers import SERVICE, Call, CallHooks, Handler, HookInterceptor
from ._status import refuse

__all__ = ["DrainGate"]

REFUSAL = "the server is shutting down; retry (after it restarts or on another server)"


class DrainGate(HookInterceptor):
    """Counts the service's calls in flight; after ``close()`` refuses new ones."""

    def __init__(self) -> None:
        # every call takes the lock twice; only wait_idle waits on the condition
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._running = 0
        self._closed = False
        self._idle_waiters = 0  # calls of wait_idle waiting now
        self._admitted = _Admitted(self)  # the hooks of every service method

    @property
    def running(self) -> int:
        with self._cond:
            return self._running

    def close(self) -> None:
        """Answer every call that starts from now on with UNAVAILABLE."""
        with self._cond:
            self._closed = True

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no admitted call runs; False when ``timeout`` passed first."""
        end = time.monotonic() + timeout
        with self._cond:
            self._idle_waiters += 1
            try:
                while self._running:
                    left = end - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                return True
            finally:
                self._idle_waiters -= 1

    def method_hooks(
        self, handler: Handler, called: tuple[str, str]
    ) -> CallHooks | None:
        if called[0] != SERVICE:
            return None  # health and reflection: answered until the end
        return self._admitted

    def _enter(self) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._running += 1
            return True

    def _leave(self) -> None:
        with self._lock:
            self._running -= 1
            if not self._running and self._idle_waiters:
                self._cond.notify_all()


class _Admitted(CallHooks):
    __slots__ = ("gate",)

    def __init__(self, gate: DrainGate) -> None:
        self.gate = gate

    def before(self, call: Call, request: Any, context: grpc.ServicerContext) -> Any:
        call.admitted = self.gate._enter()
        if not call.admitted:
            refuse(context, grpc.StatusCode.UNAVAILABLE, REFUSAL, "SHUTTING_DOWN")
        return request

    def finish(self, call: Call, context: grpc.ServicerContext, failed: bool) -> None:
        if call.admitted:
            call.admitted = False
            self.gate._leave()
