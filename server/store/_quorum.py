"""Sync steps and the worker leases that size their quorum.

In a ``sync`` group, pushes computed against the current T are buffered; when the
quorum has pushed, they are combined in client-id order (sum, then divided by their
count for ``mean``) and one step is applied. The quorum is ``sync_workers`` less the
workers whose lease ran out, so a dead worker never hangs a step. A step is logged
(``sync_step``) only after the push that completes it, and taken once that record is
durable. Every function here runs under the group's lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..errors import JOURNAL_REFUSALS
from ._group import Group, LeaseView, StoreLimits, combine_contributions
from ._journaling import JournalEntry

__all__ = [
    "join",
    "leave",
    "logged_step_due",
    "maybe_sync_step",
    "quorum_reached",
    "reap",
]

log = logging.getLogger("onnxps.store")


def quorum_reached(g: Group) -> bool:
    return bool(g.pending) and len(g.pending) >= g.quorum()


def logged_step_due(g: Group) -> bool:
    # Replay steps where the log says a step was taken: the sync_step record precedes
    # the push that triggered it, so wait for that many contributions.
    if g.replay_step is None or len(g.pending) < g.replay_step:
        return False
    g.replay_step = None
    return True


def maybe_sync_step(
    g: Group,
    journal: JournalEntry,
    due: Callable[[Group], bool] = quorum_reached,
) -> bool:
    """Take the pending step if ``due``; False when it is not."""
    if not due(g):
        return False
    journal.durable(_sync_step_record(g))  # Unavailable: no step, nothing changed
    combined = combine_contributions(g.pending, g.consistency.reduction, g.dtype)
    g.pending = {}
    g.step(combined, None)
    g.cond.notify_all()
    return True


def _sync_step_record(g: Group) -> dict[str, Any]:
    return {"op": "sync_step", "group": g.name, "contributors": sorted(g.pending)}


def join(g: Group, worker_id: str, now: float, journal: JournalEntry) -> LeaseView:
    """Join or renew a worker's lease (a heartbeat of an unknown worker joins)."""
    # A heartbeat may be the first to see a lease run out: the quorum shrinks here,
    # so the pending step may be due now (the reaper will not retry it).
    if g.expire_leases(now):
        maybe_sync_step(g, journal)
    if worker_id not in g.workers:
        if worker_id in g.dead:
            log.info("group %s: worker %s rejoined", g.name, worker_id)
        else:
            log.info("group %s: worker %s joined", g.name, worker_id)
    g.dead.discard(worker_id)
    g.workers[worker_id] = now + g.lease_seconds
    return g.lease_view()


def leave(g: Group, worker_id: str, journal: JournalEntry) -> LeaseView:
    if g.workers.pop(worker_id, None) is not None:
        g.dead.add(worker_id)
        log.info("group %s: worker %s left", g.name, worker_id)
        maybe_sync_step(g, journal)
        g.cond.notify_all()
    return g.lease_view()


def reap(g: Group, now: float, limits: StoreLimits, journal: JournalEntry) -> None:
    """Drop expired leases and idle exactly-once windows; take a step now due.

    A due step whose record could not be logged before is tried again here.
    """
    g.forget_clients(now, limits.dedup_seconds, limits.dedup_clients)
    expired = bool(g.workers) and g.expire_leases(now)
    if expired or quorum_reached(g):
        try:
            maybe_sync_step(g, journal)
        except JOURNAL_REFUSALS:
            pass  # the journal logged why; the next round tries again
        g.cond.notify_all()
