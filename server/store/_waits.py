"""Calls that wait for a version, and the bound on how many wait at once.

A pull with ``min_version`` (and a sync push asking for the new values) may wait for
a group's T to reach a version. A wait ends when the version comes, the deadline
passes, the caller goes away (its ``Cancellation`` is set) or the server drains; at
most ``max_waiting_calls`` calls wait at once, the others are refused with
RESOURCE_EXHAUSTED, so waits cannot hold every worker thread of a server.

A change on a replicated shard waits for its standbys' acknowledgement through the
``CallLink`` the transport set for its call (``CURRENT_CALL``, a context variable:
the call's own data, on the call's thread): the wait ends when the caller left, and
when it ends unacknowledged the link says why, so the reply is not OK.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

from ..errors import DeadlineExceeded, ResourceExhausted, Unavailable
from ._group import Group
from ._quorum import quorum_reached
from ._rewind import rewound_error

__all__ = [
    "CURRENT_CALL",
    "CallCancelled",
    "CallLink",
    "Cancellation",
    "Wait",
    "Waiting",
]

# A wait wakes at least this often, to see a cancellation whose wake-up was missed.
WAKE_SECONDS = 0.5


class CallCancelled(Exception):
    """The caller of a waiting call went away (it cancelled, or its deadline passed)."""


class Cancellation:
    """Set by the transport when the caller of a store call has gone.

    A call waiting for a version checks it at each wake-up, and ``cancel`` wakes the
    wait at once, so a thread is never held for a caller that left.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._cond: threading.Condition | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            cond = self._cond
        # The transport calls this on its own thread: do not block it behind a long
        # step; the wait polls (``WAKE_SECONDS``) if the lock is busy.
        if cond is not None and cond.acquire(timeout=0.05):
            try:
                cond.notify_all()
            finally:
                cond.release()

    @contextmanager
    def watching(self, cond: threading.Condition) -> Iterator[None]:
        with self._lock:
            self._cond = cond
        try:
            yield
        finally:
            with self._lock:
                self._cond = None


class _Active(Protocol):
    def is_active(self) -> bool: ...


class CallLink:
    """One call as a wait deep in the store sees it: whether its caller is still
    there, and why its change was not acknowledged (None: it was, or none was
    made). Set by the transport for the call's duration (``CURRENT_CALL``)."""

    __slots__ = ("context", "unacknowledged")

    def __init__(self, context: _Active) -> None:
        self.context = context
        self.unacknowledged: Exception | None = None

    def gone(self) -> bool:
        return not self.context.is_active()


CURRENT_CALL: ContextVar[CallLink | None] = ContextVar("onnxps_call", default=None)


@dataclass(frozen=True)
class Wait:
    """How long a call may wait for a version, and how it learns its caller left."""

    timeout: float | None = None
    cancellation: Cancellation | None = None
    counted: bool = False  # the call holds a waiting slot already (a sync push)


class Waiting:
    """The server's waiting calls: at most ``limit`` at once (0: no limit).

    ``check_live(g)`` raises when a group's calls must end (it was deleted, or the
    store closed); ``drain`` ends every wait with UNAVAILABLE.
    """

    def __init__(
        self,
        limit: int,
        clock: Callable[[], float],
        check_live: Callable[[Group], None],
    ) -> None:
        self.limit = limit
        self._clock = clock
        self._check_live = check_live
        self._count = 0
        self._lock = threading.Lock()
        self.draining = False

    @property
    def count(self) -> int:
        """Calls waiting for a version now."""
        return self._count

    @contextmanager
    def slot(self, group: str, *, required: bool = True) -> Iterator[bool]:
        """Hold one of the server's waiting slots; when all are taken, refuse, or
        yield False (holding none) if the slot is not ``required``."""
        with self._lock:
            held = not self.limit or self._count < self.limit
            if held:
                self._count += 1
        if not held and required:
            raise no_room_to_wait(self.limit, group)
        try:
            yield held
        finally:
            if held:
                with self._lock:
                    self._count -= 1

    def check_room(self, g: Group, client_id: str, wait: Wait | None) -> None:
        """Under the lock, before a sync push changes anything: refuse it if it would
        wait for its step and found no waiting slot (one that completes the step
        needs none)."""
        if wait is None or wait.counted or g.consistency.mode != "sync":
            return
        key = client_id or "~probe"  # anonymous pushes get fresh keys
        if key in g.pending:
            return  # refused as a second push for this step
        g.expire_leases(self._clock())
        g.pending[key] = []  # as if buffered: would it complete the quorum?
        try:
            completes = quorum_reached(g)
        finally:
            del g.pending[key]
        if not completes:
            raise no_room_to_wait(self.limit, g.name)

    def wait_version(self, g: Group, version: int, wait: Wait) -> None:
        """Under the group's lock: wait until T reaches ``version``."""
        if g.update_count >= version:
            return
        deadline = None if wait.timeout is None else self._clock() + wait.timeout
        slot: AbstractContextManager[object] = (
            nullcontext() if wait.counted else self.slot(g.name)
        )
        gone = wait.cancellation
        woken = nullcontext() if gone is None else gone.watching(g.cond)
        rewinds = g.rewinds
        with slot, woken:
            while g.update_count < version:
                self._check_waiting(g, version, gone)
                if g.rewinds != rewinds:
                    raise rewound_error(g, f"a call waited for T={version}")
                remaining = None if deadline is None else deadline - self._clock()
                if remaining is not None and remaining <= 0:
                    raise DeadlineExceeded(
                        f"group {g.name!r} is at T={g.update_count}; it did not "
                        f"reach T={version} before the deadline"
                    )
                g.cond.wait(timeout=min(remaining or WAKE_SECONDS, WAKE_SECONDS))

    def _check_waiting(self, g: Group, version: int, gone: Cancellation | None) -> None:
        """A waiting call ends when its group goes, the server drains or it left."""
        self._check_live(g)
        if self.draining:
            raise Unavailable(
                f"the server is shutting down while group {g.name!r} is at "
                f"T={g.update_count}, before T={version}; retry after it restarts",
                metadata={"group": g.name, "update_count": g.update_count},
            )
        if gone is not None and gone.cancelled:
            raise CallCancelled(
                f"the caller waiting for T={version} of group {g.name!r} went away"
            )


def no_room_to_wait(limit: int, group: str) -> ResourceExhausted:
    return ResourceExhausted(
        f"the server has its limit of {limit} calls waiting for a version (of group "
        f"{group!r} and others); retry later, or pull without min_version"
    )
