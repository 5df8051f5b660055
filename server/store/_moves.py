"""Which groups this shard serves while a resharding moves them (docs/resharding.md).

A resharding moves a group (or a split group's part) from its source shard to its
target: the target first holds the group's calls (``importing``: the state is on
its way), the source then stops acknowledging it (``fence``: its calls are
answered MOVED, naming the target), the placement map in etcd flips, the target
serves it (``activate``) and the source deletes its copy (``release``). The map's
``owners`` (``adopt``) keep naming the owner of every moved name, so a call for it
to any other shard is MOVED (never NOT_FOUND), also after a restart. NumPy-free
and grpc-free: the store asks ``check`` before it looks a group up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ..errors import FailedPrecondition, Moved, NotFound, Unavailable
from ._group import Group, GroupRuntime

__all__ = [
    "HOLD_SECONDS",
    "Moves",
    "check_live",
    "runtime_from_json",
    "runtime_to_json",
]

# How long a call for a group being imported here waits for the cutover to end
# before it is answered UNAVAILABLE (retried by clients within their deadline).
HOLD_SECONDS = 5.0


class Moves:
    """The names this shard must not serve now, and why."""

    def __init__(self, shard: int | None = None) -> None:
        self.shard = shard
        self._cond = threading.Condition()
        self.version = 0  # of the last placement map adopted or told
        self._fenced: dict[str, int] = {}  # name -> the shard it moves to
        self._importing: set[str] = set()
        self._elsewhere: dict[str, int] = {}  # moved away: name -> its owner
        # this thread applies records to the group it imports (``applying``)
        self._local = threading.local()

    # -- what the resharding tool (and the map) say ------------------------------
    def adopt(
        self,
        version: int,
        owners: Mapping[str, int],
        incoming: Mapping[str, int],
        outgoing: Mapping[str, int] | None = None,
    ) -> None:
        """The placement map in etcd: ``owners`` (name -> shard) of the moved
        names, ``incoming`` (name -> source) and ``outgoing`` (name -> target) of
        the moves to and from this shard not finished. An outgoing move is fenced
        here (a primary that took over mid-move must not serve what is being
        copied away; the tool's UNFENCE ends it). An older map than one told
        already changes nothing."""
        with self._cond:
            if version < self.version:
                return
            self.version = version
            for name, target in (outgoing or {}).items():
                self._fenced.setdefault(name, target)
            self._elsewhere = {n: s for n, s in owners.items() if s != self.shard}
            for name in incoming:
                if owners.get(name) != self.shard:
                    self._importing.add(name)
            for name in [n for n in self._importing if owners.get(n) == self.shard]:
                self._importing.discard(name)
            self._cond.notify_all()

    def begin_import(self, name: str) -> None:
        with self._cond:
            self._importing.add(name)
            self._elsewhere.pop(name, None)

    def activate(self, name: str, version: int) -> None:
        with self._cond:
            self._importing.discard(name)
            self._elsewhere.pop(name, None)
            self._fenced.pop(name, None)
            self.version = max(self.version, version)
            self._cond.notify_all()

    def abort_import(self, name: str) -> None:
        with self._cond:
            self._importing.discard(name)
            self._cond.notify_all()

    @contextmanager
    def applying(self, name: str) -> Iterator[None]:
        """Within: this thread's calls on ``name`` (held: being imported here) are
        not held, so it applies the records its source sends (a move that follows
        the source's log)."""
        if not self.importing(name):
            raise FailedPrecondition(
                f"group {name!r} is not being imported here: send MoveGroup "
                "BEGIN_IMPORT and import its snapshot first",
                metadata={"group": name},
            )
        self._local.name = name
        try:
            yield
        finally:
            self._local.name = None

    def fence(self, name: str, to_shard: int) -> None:
        with self._cond:
            self._fenced[name] = to_shard

    def unfence(self, name: str) -> None:
        with self._cond:
            self._fenced.pop(name, None)

    def release(self, name: str, owner: int, version: int) -> None:
        with self._cond:
            self._fenced.pop(name, None)
            self._elsewhere[name] = owner
            self.version = max(self.version, version)

    # -- what the store asks -----------------------------------------------------
    def importing(self, name: str) -> bool:
        with self._cond:
            return name in self._importing

    def hidden(self, name: str) -> bool:
        """Not listed here: on its way in, or owned by another shard."""
        with self._cond:
            return name in self._importing or name in self._elsewhere

    def check(self, name: str, hold: float = HOLD_SECONDS) -> None:
        """Raise ``Moved`` for a name another shard owns (or is taking over);
        wait up to ``hold`` seconds while it is being imported here, then
        ``Unavailable`` (a client resends)."""
        # every call asks: no lock for a name no move concerns (a dict or set
        # lookup is atomic; a move that begins meanwhile fences under the group's
        # lock, which ``fenced`` is asked under)
        if (
            name not in self._importing
            and name not in self._fenced
            and name not in self._elsewhere
        ) or getattr(self._local, "name", None) == name:
            return
        with self._cond:
            end = time.monotonic() + hold
            while name in self._importing:
                left = end - time.monotonic()
                if left <= 0:
                    raise Unavailable(
                        f"group {name!r} is moving to this shard (a resharding's "
                        "cutover); retry",
                        reason="GROUP_IMPORTING",
                        metadata={"group": name},
                    )
                self._cond.wait(left)
            owner = self._fenced.get(name, self._elsewhere.get(name))
            if owner is not None:
                raise moved(name, owner, self.version)

    def fenced(self, name: str) -> int | None:
        """The shard ``name`` moves to, when it is fenced here (asked under the
        group's lock by every change; a dict lookup, atomic, with no lock)."""
        return self._fenced.get(name)


def check_live(moves: Moves, closing: threading.Event, g: Group) -> None:
    """Raise when the calls of ``g`` must end: it was deleted (NOT_FOUND), a
    resharding fenced it here (MOVED, naming its new shard), or the store is
    closing (UNAVAILABLE). Asked under the group's lock by every change and wait;
    the store binds it to its ``moves`` and ``closing`` once and hands it to the
    push pipeline and the waits, which call it here, beside the fence it reads."""
    if g.deleted:
        raise NotFound(f"group {g.name!r} was deleted", metadata={"group": g.name})
    owner = moves.fenced(g.name)
    if owner is not None:
        raise moved(g.name, owner, moves.version)
    if closing.is_set():
        raise Unavailable("the server is shutting down; retry on another server")


def moved(name: str, owner: int, version: int) -> Moved:
    return Moved(
        f"group {name!r} is served by shard {owner} now (a resharding moved it; "
        f"placement map version {version}): read the map again and resend there",
        metadata={"group": name, "shard": str(owner), "map_version": str(version)},
    )


def runtime_to_json(runtime: GroupRuntime) -> dict[str, Any]:
    """What a moved group's create record carries beside its image: its leases,
    the workers out of its sync quorum and its exactly-once windows (no buffered
    gradients: a group with a round in progress is not logged so)."""
    return {
        "workers": list(runtime.workers),
        "dead": list(runtime.dead),
        "dedup": {
            cid: [int(floor), [[int(s), int(t), bool(a)] for s, t, a in rows]]
            for cid, (floor, rows) in runtime.dedup.items()
        },
        "created_by": runtime.created_by,
    }


def runtime_from_json(doc: Mapping[str, Any]) -> GroupRuntime:
    return GroupRuntime(
        workers=tuple(str(w) for w in doc.get("workers", ())),
        dead=tuple(str(w) for w in doc.get("dead", ())),
        dedup={
            str(cid): (int(floor), [(int(s), int(t), bool(a)) for s, t, a in rows])
            for cid, (floor, rows) in dict(doc.get("dedup", {})).items()
        },
        created_by=str(doc.get("created_by", "")),
    )
