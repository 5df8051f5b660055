"""The order of a change: validated, logged, durable, then applied.

Every change to a group is validated, then logged to the store's ``Journal`` (its
records are numbered by ``lsn``), and applied only once its record is durable; so
the change applied is exactly the one logged, and an acknowledged change is durable.
When the log cannot be written the call is refused with ``Unavailable`` and nothing
changes. A replayed change is not logged again. Most changes hold the group's lock
from their check to their step; an async push lets it go while its record is
written, and steps in its record's turn (``_order``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._group import Journal

__all__ = ["JournalEntry"]

Array = np.ndarray[Any, Any]


class JournalEntry:
    """Logs a store call's records; ``wait`` blocks until one is durable.

    Called under the group's lock, before the change is applied: ``wait`` raises
    ``Unavailable`` when the log could not be written, and the caller then leaves the
    group as it was. Without a journal (memory only, or replay) both do nothing.
    """

    __slots__ = ("_journal", "logging")

    def __init__(self, journal: Journal | None) -> None:
        self._journal = journal
        # whether records are logged (False: memory only, or replay); a plain
        # attribute: every push reads it
        self.logging = journal is not None

    def log(self, record: dict[str, Any], arrays: Sequence[Array] = ()) -> int | None:
        return None if self._journal is None else self._journal.log(record, arrays)

    def check_writable(self) -> None:
        """Raise when this server may not accept a change now (a replicated shard's
        standby: ``NOT_PRIMARY``); asked before a resend is answered from the
        exactly-once window, so a standby never answers one as done."""
        if self._journal is not None:
            self._journal.check_writable()

    def settle(self) -> None:
        """Before a resend is answered from a group's exactly-once window: wait
        until what was logged before it is acknowledged (a replicated shard's
        journal; a log alone acknowledges each record once it is durable)."""
        settle = getattr(self._journal, "settle", None)
        if settle is not None:
            settle()

    def wait(self, lsn: int | None) -> None:
        if self._journal is not None and lsn is not None:
            self._journal.wait(lsn)

    def durable(self, record: dict[str, Any], arrays: Sequence[Array] = ()) -> None:
        """Log ``record`` and wait until it is durable."""
        self.wait(self.log(record, arrays))
