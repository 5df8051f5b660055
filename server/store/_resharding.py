"""The store's part in a resharding (docs/resharding.md): export a group fenced,
import one held until activated, release one moved away. ``ParameterStore`` is
made of this and its own methods; ``_moves.Moves`` keeps which names are where.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ..errors import FailedPrecondition, NotFound
from ..kernels import make_attrs
from ._checks import check_update_count
from ._group import Group, GroupCapture, GroupRuntime, GroupView
from ._moves import Moves, runtime_to_json
from ._order import alone

__all__ = ["MovingGroups"]

log = logging.getLogger("onnxps.store")


class MovingGroups:
    """Resharding's methods of ``ParameterStore`` (over its groups and lock)."""

    moves: Moves
    _groups: dict[str, Group]
    _lock: threading.Lock
    _journal: Any
    _incarnations: Any
    _clock: Callable[[], float]

    def _delete(self, name: str, *, replay: bool) -> bool:
        raise NotImplementedError

    def _add_group(
        self, group: Group, group_bytes: int, extra: dict[str, Any] | None = None
    ) -> None:
        raise NotImplementedError

    def install(self, image: Any, runtime: GroupRuntime | None = None) -> GroupView:
        raise NotImplementedError

    def export_group(
        self,
        name: str,
        to_shard: int,
        fence: bool,
        current_lsn: Callable[[], int] = lambda: 0,
    ) -> GroupCapture:
        """One group's image and runtime (exactly-once windows, sync rounds);
        ``fence``: from now on its calls are MOVED to ``to_shard``, and the
        changes in flight finish first (the copy is final). ``current_lsn`` is
        read under the group's lock (the runtime's ``covered_lsn``): every log
        record of the group up to it is in the copy, and none after it."""
        return self._export(name, to_shard, fence, current_lsn, True)  # type: ignore[return-value]

    def fence_group(self, name: str, to_shard: int) -> None:
        """``export_group`` fenced, with no copy: the changes in flight are done
        (their log records durable) when this returns."""
        self._export(name, to_shard, True, lambda: 0, False)

    def _export(
        self,
        name: str,
        to_shard: int,
        fence: bool,
        current_lsn: Callable[[], int],
        copy: bool,
    ) -> GroupCapture | None:
        with self._lock:
            g = self._groups.get(name)
        if g is None or g.deleted:
            raise NotFound(
                f"no group named {name!r} on this shard to move",
                metadata={"group": name},
            )
        with g.cond:
            if fence:
                self.moves.fence(name, to_shard)
                g.cond.notify_all()  # waiting calls end: MOVED
            with alone(g.cond, g.order):
                if g.deleted:
                    raise NotFound(
                        f"group {name!r} was deleted", metadata={"group": name}
                    )
                if not copy:
                    return None
                return GroupCapture(g.image(None), g.runtime(current_lsn()))

    def holds(self, name: str) -> bool:
        """Whether a live group ``name`` is here (served or not)."""
        with self._lock:
            g = self._groups.get(name)
        return g is not None and not g.deleted

    def update_count_of(self, name: str) -> int:
        with self._lock:
            g = self._groups.get(name)
        if g is None:
            return 0
        with g.cond:
            return int(g.update_count)

    def begin_import(self, name: str) -> None:
        """Hold the calls of ``name`` until ``activate``; a copy left here by an
        unfinished earlier move is deleted (logged)."""
        self.moves.begin_import(name)
        with self._lock:
            stale = name in self._groups
        if stale:
            self._delete(name, replay=False)

    def import_group(self, captured: GroupCapture) -> tuple[GroupView, bool]:
        """Install a moved group (held until ``activate``): logged as a create
        record that carries its exactly-once windows, so it is durable here (and
        shipped to this shard's standbys) when this returns. A sync group with a
        round in progress (buffered gradients, which a record does not carry) is
        installed unlogged: the second value is False, and the caller makes it
        durable with a snapshot."""
        name = captured.image.name
        if not self.moves.importing(name):
            raise FailedPrecondition(
                f"group {name!r} is not being imported here: send MoveGroup "
                "BEGIN_IMPORT first",
                metadata={"group": name},
            )
        runtime = captured.runtime
        if runtime.pending or self._journal is None:
            return self.install(captured.image, runtime), False
        d = captured.image.definition
        attrs = make_attrs(d.optimizer, d.attributes)
        check_update_count(d.update_count)
        g = Group.from_image(captured.image, attrs, next(self._incarnations))
        g.restore_runtime(runtime, self._clock())
        self._add_group(
            g,
            sum(a.nbytes for a in captured.image.arrays),
            {"moved": runtime_to_json(runtime)},
        )
        log.info("imported group %s (a resharding moved it here)", g.name)
        return g.view(self._clock()), True

    def release_moved(self, name: str, owner: int, version: int) -> bool:
        """The map names ``owner``: delete the copy here (logged), answer MOVED."""
        self.moves.release(name, owner, version)
        with self._lock:
            present = name in self._groups
        return present and self._delete(name, replay=False)
