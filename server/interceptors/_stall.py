"""Request streams whose client stopped sending end, deadline or not.

A request stream holds a worker thread while the server waits for its next
message, and gRPC Python's request iterator waits without a timeout: a client that
sends a header and then nothing (with no deadline, as grpcurl and most other
languages' clients call by default) would hold that thread for ever. ``StallWatch``
keeps, for every stream being read, when the server started waiting for its next
message; one thread ends a stream that has waited ``stall_seconds`` with
DEADLINE_EXCEEDED and a message that says so, and frees its thread.

gRPC Python has no public way to finish a call from another thread while its
handler is blocked in the request iterator: ``end_call`` cancels the call in the
core with a status (the client sees that code and message; the handler's iterator
then raises and the handler ends, releasing what it held). Time spent by the server
itself (a step, a wait for a version) is never counted: only the waits for the
client's next message.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from ..errors import DeadlineExceeded

__all__ = ["StallWatch", "end_call"]

log = logging.getLogger("onnxps.rpc")

STALL_REASON = "STREAM_STALLED"


def end_call(context: Any, code: grpc.StatusCode, details: str) -> None:
    """Finish a call from any thread with ``code`` and ``details`` (best effort:
    a plain cancellation where the grpc internals differ)."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        call.cancel(code.value[0], details)  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - another grpc version: cancel it plainly
        context.cancel()


class _Reading:
    """One stream being read: since when the server waits for its next message
    (None: not waiting), and whether the watch ended it."""

    __slots__ = ("context", "method", "since", "ended")

    def __init__(self, context: Any, method: str) -> None:
        self.context = context
        self.method = method
        self.since: float | None = None
        self.ended = False


class StallWatch:
    """Ends request streams that send nothing for ``seconds`` (one thread)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._reading: set[_Reading] = set()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.ended = 0  # streams ended for stalling (tests, logs)

    def start(self) -> StallWatch:
        self._thread = threading.Thread(
            target=self._run, name="onnxps-stall-watch", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def reading(
        self, requests: Any, context: Any, method: str, *, first_only: bool = False
    ) -> Iterator[Any]:
        """``requests`` unchanged, ended when its client stalls (with
        ``first_only``, only before its first message: a stream that may then be
        silent by design must still say who it is in time)."""
        entry = _Reading(context, method)
        it = iter(requests)
        with self._lock:
            self._reading.add(entry)
        try:
            while True:
                with self._lock:
                    entry.since = time.monotonic()
                try:
                    msg = next(it)
                except StopIteration:
                    return
                except grpc.RpcError:
                    self._raise_if_ended(entry)
                    raise
                finally:
                    with self._lock:
                        entry.since = None
                self._raise_if_ended(entry)
                if first_only:
                    with self._lock:
                        self._reading.discard(entry)
                    yield msg
                    yield from it
                    return
                yield msg
        finally:
            with self._lock:
                self._reading.discard(entry)

    def _raise_if_ended(self, entry: _Reading) -> None:
        with self._lock:
            ended = entry.ended
        if ended:
            raise DeadlineExceeded(self._message(entry.method), reason=STALL_REASON)

    def _message(self, method: str) -> str:
        return (
            f"the {method} stream sent nothing for {self.seconds:g} s "
            "(--stall-seconds): the server ended it"
        )

    def _run(self) -> None:
        tick = min(0.25, self.seconds / 4)
        while not self._stopped.wait(tick):
            now = time.monotonic()
            with self._lock:
                stalled = [
                    e
                    for e in self._reading
                    if e.since is not None and now - e.since >= self.seconds
                ]
                for e in stalled:
                    e.ended = True
                    self._reading.discard(e)
            for e in stalled:
                self.ended += 1
                log.info("%s", self._message(e.method))
                end_call(
                    e.context,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    self._message(e.method),
                )
