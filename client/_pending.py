"""The parts of a cluster push that have not landed yet, kept per push.

A push to a split group fans out to its parts with one (client_id, seq). A part
that did not answer (its shard down, the deadline passed, the call cancelled) may or
may not have applied the push; a part that refused for a reason that can pass later
(``RESOURCE_EXHAUSTED``, a shard restarted with the wrong ``--shard`` index, a
token not yet known to one shard) did not, while the others did. Either way the
push is remembered here, one entry per push (never one per group: pushes that fail
at once from several threads each keep theirs), and the next push or pull of the
group resends the entries in order, with their seqs, before it sends its own: a
part that took the push already answers a resend with its first result, so every
part applies every push exactly once.

A refusal the shard makes before anything is written (``NOT_ENOUGH_REPLICAS``: a
replicated shard without its synchronous standbys refuses the change before it is
logged, and after its exactly-once window was read, so the push was not applied
and is not being applied) is final for a push no other part took: the push is
dropped, and the caller who retries it applies it once. One that others took is
kept and resent like any refusal that can pass later.

A refusal that can never pass (a wrong shape, dtype, a NaN the group refuses) is
found before any part is sent (``_sharded``, ``_rowsplit``), so parts never
disagree about it. One that reaches a part all the same while others applied is
``PartsDivergedError``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from onnxps.v1 import parameter_server_pb2 as pb

from ._errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    PermissionDeniedError,
    ResourceExhaustedError,
    RpcError,
    UnauthenticatedError,
    UnavailableError,
)

__all__ = [
    "PartPush",
    "PendingPush",
    "PendingPushes",
    "maybe_applied",
    "not_applied",
    "resend_later",
    "resend_now",
]

# shard, request (a dense push's, or a row push's header), gradients
PartPush = tuple[int, pb.PushRequest | pb.PushRowsHeader, list[Any]]

# Refusals of a shard that an operator's fix lets pass (the other parts applied).
_FIXABLE_REASONS = frozenset({"SHARD_LAYOUT_MISMATCH"})


# UNAVAILABLE reasons of a change refused before it was written: not applied.
_NOT_APPLIED_REASONS = frozenset({"NOT_ENOUGH_REPLICAS"})


def not_applied(exc: BaseException) -> bool:
    """The shard refused the push before writing anything (and found it in no
    exactly-once window): it did not apply it, and does not later."""
    return isinstance(exc, UnavailableError) and exc.reason in _NOT_APPLIED_REASONS


def maybe_applied(exc: BaseException) -> bool:
    """The part may have applied the push: no answer came (or one that does not
    say it was not applied)."""
    if not_applied(exc):
        return False
    if isinstance(exc, UnavailableError | DeadlineExceededError):
        return True
    return isinstance(exc, RpcError) and exc.code == grpc.StatusCode.CANCELLED


def _over_the_limit(exc: ResourceExhaustedError) -> bool:
    """A call larger than the shard's whole in-flight budget: it passes only once
    the shard's limit is raised."""
    try:
        return int(exc.metadata["requested"]) > int(exc.metadata["limit"])
    except (KeyError, ValueError):
        return False


# RESOURCE_EXHAUSTED reasons of a busy server ("retry later"; None: gRPC's own
# limit of calls); others (DISK_FULL, a table's max_rows) are reported at once
_BUSY_REASONS = frozenset({"INFLIGHT_BYTES", "STREAM_LIMIT", None})


def resend_now(exc: BaseException) -> bool:
    """Sent again within the call's deadline: the shard is busy or restarting."""
    if isinstance(exc, ResourceExhaustedError):
        return exc.reason in _BUSY_REASONS and not _over_the_limit(exc)
    return isinstance(exc, UnavailableError)


def resend_later(exc: BaseException) -> bool:
    """Kept pending when another part applied the push: the refusal can pass later
    (no answer, a busy shard, a shard started with another identity or tokens)."""
    if maybe_applied(exc) or not_applied(exc):
        return True
    if isinstance(exc, ResourceExhaustedError):
        return True
    if isinstance(exc, UnauthenticatedError | PermissionDeniedError):
        return True
    return isinstance(exc, FailedPreconditionError) and exc.reason in _FIXABLE_REASONS


def _seq(parts: Sequence[PartPush]) -> int:
    return int(parts[0][1].seq)


@dataclass(frozen=True, eq=False)
class PendingPush:
    """One push's parts still to land (``parts``, then ``after``: with
    ``base_version`` part 0 decides alone before the others are sent);
    ``applied_elsewhere``: some other part applied it (or may have)."""

    group: str
    parts: tuple[PartPush, ...]
    after: tuple[PartPush, ...]
    applied_elsewhere: bool
    why: str  # the last refusal or failure, for the error of the next call

    @property
    def seq(self) -> int:
        return _seq(self.parts or self.after)


class PendingPushes:
    """Per group, the pushes whose parts did not all land, oldest first. Safe for
    threads (a ``Client`` shared by several) and for tasks (its lock is never held
    across a yield)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_group: dict[str, list[PendingPush]] = {}

    def add(self, entry: PendingPush) -> None:
        with self._lock:
            self._by_group.setdefault(entry.group, []).append(entry)

    def first(self, group: str) -> PendingPush | None:
        with self._lock:
            queue = self._by_group.get(group)
            return queue[0] if queue else None

    def of(self, group: str) -> list[PendingPush]:
        with self._lock:
            return list(self._by_group.get(group, ()))

    def replace(self, old: PendingPush, new: PendingPush | None) -> None:
        """``old`` becomes ``new`` in its place (None: it is done); nothing when
        another caller finished ``old`` meanwhile."""
        with self._lock:
            queue = self._by_group.get(old.group, [])
            for i, entry in enumerate(queue):
                if entry is old:
                    if new is None:
                        del queue[i]
                    else:
                        queue[i] = new
                    break
            if not queue:
                self._by_group.pop(old.group, None)

    def every(self) -> list[PendingPush]:
        """Every group's entries."""
        with self._lock:
            return [e for queue in self._by_group.values() for e in queue]

    def forget(self, group: str) -> list[PendingPush]:
        """Drop the group's entries (it was deleted); what was dropped."""
        with self._lock:
            return self._by_group.pop(group, [])
