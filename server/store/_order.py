"""A group's pushes in flight: logged, and not yet applied.

With a write-ahead log, an async push reserves its group's next slot and appends its
record under the group's lock, then waits for the fsync without the lock, so the
pushes to one group share fsyncs (group commit), as the pushes to different groups
do. The slots are then applied in the order they were taken, which is the order of
their records in the log, each once its record is durable; a slot whose record
could not be written is refused in its turn, and the slots after it are applied in
theirs, so the group's state is always the replay of its durable records in log
order. A change made another way (a learning rate, a delete, a snapshot's copy of
the group) is made with the group to itself (``alone``): it waits until no push of
the group is in flight, and no new push starts meanwhile.
"""

from __future__ import annotations

import threading
from types import TracebackType

__all__ = ["PushKey", "PushOrder", "alone"]

PushKey = tuple[str, int]  # (client_id, seq) of a push that has a client_id


class PushOrder:
    """One group's slots; guarded by the group's lock."""

    def __init__(self) -> None:
        self.taken = 0  # slots handed out
        self.done = 0  # slots applied or refused, in slot order
        self.keys: set[PushKey] = set()  # pushes in flight, by (client_id, seq)
        self.exclusive = 0  # callers waiting for, or holding, the group alone
        self.admitting = 0  # pushes waiting (on the group's condition) for ``admits``

    @property
    def in_flight(self) -> int:
        return self.taken - self.done

    def admits(self, key: PushKey | None) -> bool:
        """Whether a push may take a slot now: the group is not held alone, and a
        push with the same (client_id, seq) is not in flight (its resend waits for
        its outcome, then is answered as a duplicate, or runs if it was refused)."""
        return not self.exclusive and (key is None or key not in self.keys)

    def take(self, key: PushKey | None) -> int:
        slot = self.taken
        self.taken += 1
        if key is not None:
            self.keys.add(key)
        return slot

    def give_back(self, slot: int, key: PushKey | None) -> None:
        """Undo ``take`` before the lock was released (the record was not logged)."""
        assert slot == self.taken - 1
        self.taken -= 1
        if key is not None:
            self.keys.discard(key)

    def finish(self, slot: int, key: PushKey | None) -> None:
        assert slot == self.done
        self.done += 1
        if key is not None:
            self.keys.discard(key)


class alone:  # lower case: used as the function it was, ``with g.cond, alone(...)``
    """Under the group's lock: hold the group with no push in flight.

    A class, not a generator: every push takes it."""

    __slots__ = ("cond", "order")

    def __init__(self, cond: threading.Condition, order: PushOrder) -> None:
        self.cond = cond
        self.order = order

    def __enter__(self) -> None:
        order = self.order
        order.exclusive += 1
        try:
            while order.in_flight:
                self.cond.wait()
        except BaseException:
            self._leave()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._leave()

    def _leave(self) -> None:
        order = self.order
        order.exclusive -= 1
        # only pushes waiting to be admitted wait for this (most pushes wake nobody)
        if not order.exclusive and order.admitting:
            self.cond.notify_all()
