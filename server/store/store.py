"""The parameter store: optimizer groups and their state, with no knowledge of gRPC.

A group is one ONNX training node: operator and attributes, learning rate R, update
count T, and ordered tensors X_1..X_n with their V/H, all of one dtype. Each group has
its own lock (a condition variable, so pulls can wait for a version), so different
groups step concurrently. Only the store touches a group: callers get frozen records
(``GroupView``, ``PullResult``, ``LeaseView``, ``PushOutcome``) and, for a push, a
``PushTicket`` from ``validate_push``.

``ParameterStore`` is the one entry point; each concern lives in its own module:

- ``_push``: the push pipeline (validation, exactly-once, staleness, step or buffer);
- ``_quorum``: sync steps and the worker leases that size their quorum;
- ``_rows``: row pushes and row reads (``_sparse``, ids tables ``_ids``);
- ``_waits``: calls waiting for a version, cancellation, the waiting-call bound;
- ``_shared``: the read-only copies of a version shared by its readers;
- ``_journaling``: the order of a change (logged, durable, then applied);
- ``_order``: an async group's pushes in flight between their record and their step.

Durability: the ``Journal`` given to ``set_journal`` logs every change before it is
applied; the journal batches records into one fsync (group commit). An async push
appends its record under its group's lock and waits for the fsync without it, then
steps in its record's turn, so the pushes to one group share fsyncs too (``_order``);
every other change is logged and applied under the group's lock. The ``replay_*``
methods redo logged changes without logging them again.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
from onnxps.wire.image import GroupImage, TableDefinition

from ..errors import (
    JOURNAL_REFUSALS,
    AlreadyExists,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from ..kernels import OptimizerAttrs, make_attrs
from . import _quorum, _rewind, _rows
from ._checks import (
    check_learning_rate,
    check_lease_seconds,
    check_state,
    check_tables,
    check_tensors,
    check_update_count,
)
from ._group import (
    DEDUP_WINDOW,
    Consistency,
    Group,
    GroupCapture,
    GroupRuntime,
    GroupView,
    Journal,
    LeaseView,
    PullResult,
    PushOutcome,
    StoreLimits,
    WorkerLease,
    check_name,
    combine_contributions,
)
from ._ids import RowsPage
from ._journaling import JournalEntry
from ._moves import Moves, check_live, runtime_from_json
from ._order import alone
from ._push import (
    PushPipeline,
    PushRequest,
    PushTicket,
    ValuesSink,
    check_gradient_specs,
    check_gradient_values,
)
from ._resharding import MovingGroups
from ._shared import SharedCopies
from ._sparse import RowSpec
from ._waits import CURRENT_CALL, CallCancelled, CallLink, Cancellation, Wait, Waiting

__all__ = [
    "CURRENT_CALL",
    "DEDUP_WINDOW",
    "CallCancelled",
    "CallLink",
    "Cancellation",
    "Consistency",
    "GroupCapture",
    "GroupRuntime",
    "GroupView",
    "Journal",
    "LeaseView",
    "ParameterStore",
    "PullResult",
    "PushOutcome",
    "PushTicket",
    "StoreLimits",
    "ValuesSink",
    "WorkerLease",
    "combine_contributions",
]

log = logging.getLogger("onnxps.store")

Array = np.ndarray[Any, Any]
Spec = tuple[np.dtype[Any], tuple[int, ...]]
_W = TypeVar("_W")  # what a pull_into writer returns


class ParameterStore(MovingGroups):
    """All groups of one server."""

    def __init__(
        self,
        limits: StoreLimits | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        journal: Journal | None = None,
    ) -> None:
        self.limits = limits or StoreLimits()
        self._groups: dict[str, Group] = {}
        self._lock = threading.Lock()
        # the groups a resharding moves to or from this shard (``_moves``)
        self.moves = Moves()
        self._clock = clock
        self._journal = journal
        self._entry = JournalEntry(journal)  # what a push logs through (stateless)
        self._incarnations = itertools.count(1)
        self._closing = threading.Event()  # set by ``close``
        # check_live(g): raises when g's calls must end (``_moves.check_live``)
        self._check_live = functools.partial(check_live, self.moves, self._closing)
        # Why this server's whole state is being replaced now (a standby adopting
        # its primary's snapshot, a promoted one applying what it received), the
        # latest first: a group missing meanwhile is back in a moment, so it is
        # UNAVAILABLE (retried), not NOT_FOUND.
        self._replacing: list[str] = []
        self._reaper: threading.Thread | None = None
        self._stop = threading.Event()
        self._waiting = Waiting(self.limits.max_waiting_calls, clock, self._check_live)
        self._shared = SharedCopies()
        self._pushes = PushPipeline(
            self.limits,
            clock,
            self._waiting,
            self._shared,
            self._check_live,
            self._check_table_room,
        )

    @property
    def replacing(self) -> str | None:
        """Why this server's state is being replaced now (None: it is not)."""
        reasons = self._replacing
        return reasons[-1] if reasons else None

    @replacing.setter
    def replacing(self, why: str | None) -> None:
        self._replacing = [] if why is None else [why]

    @contextmanager
    def replacing_state(self, why: str) -> Iterator[None]:
        """``replacing`` says ``why`` within (nested or overlapping ones too)."""
        with self._lock:
            self._replacing = [*self._replacing, why]
        try:
            yield
        finally:
            with self._lock:
                kept = list(self._replacing)
                if why in kept:
                    kept.reverse()
                    kept.remove(why)
                    kept.reverse()
                self._replacing = kept

    # -- lifecycle -----------------------------------------------------------------
    def set_journal(self, journal: Journal | None) -> None:
        """Log every change from now on to ``journal`` (None: stop logging)."""
        self._journal = journal
        self._entry = JournalEntry(journal)

    def start(self, interval: float = 0.1) -> None:
        """Start the lease reaper, which lets a sync step go on without dead workers."""
        if self._reaper is None:
            self._reaper = threading.Thread(
                target=self._reap_loop,
                args=(interval,),
                name="onnxps-leases",
                daemon=True,
            )
            self._reaper.start()

    def drain(self) -> None:
        """Wake every waiting call with UNAVAILABLE: no new push can satisfy it now.

        Called when a graceful shutdown starts, so a pull waiting for a version (or a
        sync push waiting for its step) does not hold the drain for its whole grace.
        """
        self._waiting.draining = True
        self._wake_all()

    def close(self) -> None:
        self._closing.set()
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
        self._wake_all()

    def _wake_all(self) -> None:
        for g in self._live():
            with g.cond:
                g.cond.notify_all()

    def _reap_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.reap_leases()

    def reap_leases(self) -> None:
        """Drop expired leases now; a sync step that no longer needs them is taken.

        Exactly-once windows idle past ``dedup_seconds`` are dropped here too. A due
        step whose record could not be logged before is tried again here.
        """
        for g in self._live():
            with self._journaled() as journal, g.cond:
                if not g.deleted:
                    _quorum.reap(g, self._clock(), self.limits, journal)

    # -- groups --------------------------------------------------------------------
    def _live(self, prefix: str = "") -> list[Group]:
        with self._lock:
            return [g for n, g in sorted(self._groups.items()) if n.startswith(prefix)]

    def _group(self, name: str) -> Group:
        self.moves.check(name)
        with self._lock:
            g = self._groups.get(name)
        if g is None:
            replacing = self.replacing
            if replacing is not None:
                raise Unavailable(
                    f"no group named {name!r} yet: this server is {replacing}; retry",
                    reason="STATE_REPLACING",
                    metadata={"group": name},
                )
            raise NotFound(
                f"no group named {name!r}; create it first", metadata={"group": name}
            )
        return g

    def groups(self, prefix: str = "") -> list[GroupView]:
        """Every group whose name starts with ``prefix``, by name."""
        views = []
        for g in self._live(prefix):
            if self.moves.hidden(g.name):
                continue
            with g.cond:
                if not g.deleted:
                    views.append(g.view(self._clock()))
        return views

    def describe(self, name: str) -> GroupView:
        g = self._group(name)
        with g.cond:
            self._check_live(g)
            return g.view(self._clock())

    def total_state_bytes(self) -> int:
        return sum(v.state_bytes for v in self.groups())

    def create_group(
        self,
        name: str,
        attrs: OptimizerAttrs,
        learning_rate: float,
        tensors: Sequence[tuple[str, Array]],
        *,
        consistency: Consistency | None = None,
        allow_non_finite: bool = False,
        state: Sequence[Array] | None = None,
        update_count: int = 0,
        lease_seconds: float | None = None,
        tables: Sequence[TableDefinition] = (),
        table_arrays: Sequence[Sequence[Array]] = (),
        dtype: np.dtype[Any] | None = None,
        request_id: str = "",
    ) -> GroupView:
        """Create a group of ``tensors`` and ids ``tables`` (``_ids``; their rows
        ``table_arrays``, as an image has them, when resumed; else empty); a group
        of tables only takes its ``dtype`` (default float32). A create resent with
        the ``request_id`` of the one that made the group answers that group."""
        self._check_open()
        check_name(name)
        if request_id and (done := self._created_by(name, request_id)) is not None:
            return done
        if not tensors and not tables:
            raise InvalidArgument(
                f"group {name!r} needs at least one tensor or ids table"
            )
        check_update_count(update_count)
        if tensors:
            dtype = check_tensors(tensors, allow_non_finite)
        dtype = np.dtype(dtype or np.float32)
        table_bytes = check_tables(
            name, attrs, [n for n, _ in tensors], dtype, tables, table_arrays,
            allow_non_finite,
        )  # fmt: skip
        check_learning_rate(learning_rate, dtype)
        if lease_seconds is None:
            lease_seconds = self.limits.default_lease_seconds
        check_lease_seconds(lease_seconds)
        check_state(attrs, tensors, dtype, state, allow_non_finite)
        group_bytes = sum(a.nbytes for _, a in tensors) * (1 + len(attrs.state_names))
        group_bytes += table_bytes
        self.check_group_size(group_bytes)
        group = Group(
            name,
            attrs,
            learning_rate,
            tensors,
            consistency=consistency or Consistency(),
            allow_non_finite=allow_non_finite,
            lease_seconds=lease_seconds,
            incarnation=next(self._incarnations),
            state=state or None,
            update_count=update_count,
            tables=tables,
            table_arrays=table_arrays,
            dtype=dtype,
        )
        group.created_by = request_id
        try:
            self._add_group(group, group_bytes)
        except AlreadyExists:
            # the create of this request, under way when this resend came in
            done = self._created_by(name, request_id) if request_id else None
            if done is not None:
                return done
            raise
        _log_group("created", group)
        return group.view(self._clock())

    def _add_group(
        self, group: Group, group_bytes: int, extra: dict[str, Any] | None = None
    ) -> None:
        """Hold ``group`` under its name once its create record (with ``extra``)
        is durable."""
        name = group.name
        journal = JournalEntry(self._journal)
        # Held until the create record is durable: no call uses the group before.
        with group.cond:
            try:  # a log that refuses records at once raises in ``log``
                with self._lock:
                    self._check_room(name, group_bytes)
                    self._groups[name] = group
                    lsn = None
                    if self._journal is not None:
                        # The full definition and initial arrays, so replay
                        # recreates it; the request id, so a resend is answered.
                        image = group.image()
                        record = {
                            "op": "create",
                            "group": name,
                            "image": image.to_json(),
                        } | (
                            {"request_id": group.created_by} if group.created_by else {}
                        )
                        record |= extra or {}
                        lsn = journal.log(record, image.arrays)
                journal.wait(lsn)
            except JOURNAL_REFUSALS:
                with self._lock:
                    if self._groups.get(name) is group:
                        del self._groups[name]
                group.deleted = True
                raise

    def _created_by(self, name: str, request_id: str) -> GroupView | None:
        """Group ``name`` when the create of ``request_id`` made it (a resend: the
        first answer was lost, e.g. in a failover), once that create is durable and
        on a server that may take changes (a standby refuses: NOT_PRIMARY); None
        when no live group was created by it."""
        with self._lock:
            g = self._groups.get(name)
        if g is None or g.created_by != request_id:
            return None
        JournalEntry(self._journal).check_writable()
        with g.cond:  # the first create holds it until its record is durable
            return None if g.deleted else g.view(self._clock())

    def check_group_size(self, group_bytes: int) -> None:
        limit = self.limits.max_group_bytes
        if limit and group_bytes > limit:
            raise ResourceExhausted(
                f"a group of {group_bytes} bytes (X with its V/H) is over the "
                f"server's limit of {limit} bytes per group"
            )

    def _check_room(self, name: str, group_bytes: int) -> None:
        """Under the store's lock: the name is free and the server has room."""
        if name in self._groups:
            raise AlreadyExists(
                f"group {name!r} exists already; delete it first or pick another name",
                metadata={"group": name},
            )
        if self.limits.max_groups and len(self._groups) >= self.limits.max_groups:
            raise ResourceExhausted(
                f"the server holds its limit of {self.limits.max_groups} groups",
                metadata={"limit": "max_groups", "value": self.limits.max_groups},
            )
        total = sum(g.state_bytes for g in self._groups.values()) + group_bytes
        if self.limits.max_total_bytes and total > self.limits.max_total_bytes:
            raise ResourceExhausted(
                f"group {name!r} needs {group_bytes} bytes; the server would hold "
                f"{total}, over its limit of {self.limits.max_total_bytes}",
                metadata={"limit": "max_total_bytes", "group": name},
            )

    def delete_group(self, name: str) -> bool:
        self._check_open()
        return self._delete(name, replay=False)

    def _delete(self, name: str, *, replay: bool) -> bool:
        with self._lock:
            g = self._groups.get(name)
        if g is None:
            raise NotFound(f"no group named {name!r}", metadata={"group": name})
        # The group's lock first: a push holding it is logged before the delete, and
        # the name is free (for a create, logged after) only once the delete is.
        with self._journaled(replay) as journal, g.cond, alone(g.cond, g.order):
            if g.deleted:
                raise NotFound(f"no group named {name!r}", metadata={"group": name})
            journal.durable({"op": "delete", "group": name})
            with self._lock:
                if self._groups.get(name) is g:
                    del self._groups[name]
            g.deleted = True
            g.cond.notify_all()
        log.info("deleted group %s", name)
        return True

    def set_learning_rate(self, name: str, learning_rate: float) -> GroupView:
        self._check_open()
        return self._set_learning_rate(name, learning_rate, replay=False)

    def _set_learning_rate(
        self, name: str, learning_rate: float, *, replay: bool
    ) -> GroupView:
        g = self._group(name)
        check_learning_rate(learning_rate, g.dtype)
        with self._journaled(replay) as journal, g.cond, alone(g.cond, g.order):
            self._check_live(g)
            journal.durable({"op": "set_lr", "group": name, "lr": float(learning_rate)})
            g.learning_rate = float(learning_rate)
            return g.view(self._clock())

    # -- push ----------------------------------------------------------------------
    def validate_push(self, name: str, specs: Iterable[Spec]) -> PushTicket:
        """Check gradient count, dtypes and shapes before any bytes are read.

        ``specs`` is read after the group is found: an unknown group is NOT_FOUND
        even when the header is malformed too (pass a generator that parses it).
        """
        return check_gradient_specs(self._group(name), specs)

    def push(
        self,
        group: str | PushTicket,
        grads: Sequence[Array],
        *,
        client_id: str = "",
        seq: int = 0,
        base_version: int | None = None,
        learning_rate: float | None = None,
        return_values: bool = False,
        timeout: float | None = None,
        cancellation: Cancellation | None = None,
        sink: ValuesSink | None = None,
        known_finite: bool = False,
        spent: bool = False,
    ) -> PushOutcome:
        """Push gradients G_1..G_n; ``group`` is a name or a ticket for these grads.

        ``known_finite``: the caller has checked every element of ``grads`` finite
        (a stream checks its chunks as they arrive), so the store does not again.
        ``spent``: X was written over ``grads``: a resend, answered or refused.

        ``(client_id, seq)`` identifies the push for exactly-once delivery. With
        ``return_values`` a sync push waits for its step (see ``pull``); when every
        waiting slot is taken, a push that would wait is refused before anything
        changes (one that completes the step goes through). With ``return_values``
        and a ``sink``, X goes to the sink instead of ``values``: block by block
        while an async push steps, so the caller can send each block while the
        next one steps (whole, for a duplicate or a sync push)."""
        self._check_open()
        ticket = self._ticket(group, grads)
        if not client_id and ticket._group.consistency.mode == "sync":
            raise InvalidArgument(
                f"group {ticket.group!r} is sync: a sync step counts distinct clients, "
                "so every push needs a client_id (the Client sets one); set client_id"
            )
        check_gradient_values(ticket, grads, learning_rate, known_finite)
        request = PushRequest(client_id, seq, base_version, learning_rate, spent)
        return self._pushes.push(
            ticket,
            grads,
            request,
            self._entry,
            return_values=return_values,
            timeout=timeout,
            cancellation=cancellation,
            sink=sink,
        )

    def _ticket(self, group: str | PushTicket, grads: Sequence[Array]) -> PushTicket:
        if isinstance(group, PushTicket):
            return group
        return self.validate_push(group, [(a.dtype, a.shape) for a in grads])

    # -- row pushes and pulls (``_rows``) ------------------------------------------
    def validate_push_rows(self, name: str, specs: Iterable[RowSpec]) -> None:
        """Check a row push's header (tensor names, dtypes, shapes) before any bytes
        are read; ``specs`` is read after the group is found."""
        _rows.check_row_push_specs(self._group(name), specs)

    def push_rows(
        self,
        name: str,
        gradients: dict[str, Array | tuple[Array, Array]],
        *,
        client_id: str = "",
        seq: int = 0,
        base_version: int | None = None,
        learning_rate: float | None = None,
    ) -> PushOutcome:
        """One step in which only the given rows change.

        ``gradients`` maps a tensor name to ``(indices, rows)`` (int64 (k,) and
        (k, shape[1:]...)) or to a dense gradient; tensors not named keep every row.
        Repeated indices are summed first; an index out of [0, rows) is refused
        with the state unchanged. Exactly-once, staleness and sync mode are those of
        ``push`` (the same (client_id, seq) window).
        """
        self._check_open()
        g = self._group(name)
        if not client_id and g.consistency.mode == "sync":
            raise InvalidArgument(
                f"group {name!r} is sync: every push needs a client_id; set client_id"
            )
        flat = _rows.row_push_arrays(g, gradients)
        _rows.check_row_values(g, flat, learning_rate)
        request = PushRequest(client_id, seq, base_version, learning_rate, rows=True)
        return self._pushes.run(g, flat, request, JournalEntry(self._journal))

    def replay_push_rows(
        self,
        name: str,
        arrays: Sequence[Array],
        *,
        client_id: str,
        seq: int,
        base_version: int | None,
        learning_rate: float | None,
        logged: bool = False,
    ) -> PushOutcome:
        """Redo a logged row push (its rows are coalesced and checked already)."""
        g = self._group(name)
        _rows.check_logged_row_push(g, arrays)
        request = PushRequest(client_id, seq, base_version, learning_rate, rows=True)
        journal = JournalEntry(self._journal if logged else None)
        return self._pushes.run(g, list(arrays), request, journal, replay=True)

    def pull_rows(
        self,
        name: str,
        selections: dict[str, Array],
        *,
        with_state: bool = False,
        min_version: int | None = None,
        timeout: float | None = None,
        cancellation: Cancellation | None = None,
        reserve: Callable[[int], None] | None = None,
    ) -> PullResult:
        """Copies of rows of tensors (indices may repeat), of one version: the X
        rows per selection in order, then (``with_state``) V rows and H rows.

        An id an ids table does not hold reads as its initial row (V and H zeros)
        and is not created: a pull changes nothing."""
        self._check_open()
        g = self._group(name)
        checked = _rows.check_selections(g, selections)
        with g.cond:
            self._check_live(g)
            if min_version is not None:
                self._wait_version(g, min_version, timeout, cancellation)
            return _rows.read_rows_locked(g, checked, with_state, reserve)

    def list_rows(
        self,
        name: str,
        table: str,
        *,
        after: int | None = None,
        limit: int = 0,
        with_values: bool = False,
        with_state: bool = False,
    ) -> RowsPage:
        """A page of an ids table's ids ascending, above ``after`` (None: from the
        first), at most ``limit`` (0: all); with their X rows (and V, H rows)."""
        self._check_open()
        g = self._group(name)
        with g.cond:
            self._check_live(g)
            return _rows.rows_page_locked(
                g, table, after, limit, with_values, with_state
            )

    def _check_table_room(self, g: Group, grads: Sequence[Array]) -> None:
        _rows.check_table_room(g, grads, self.limits, lambda: self._others(g))

    def _others(self, g: Group) -> list[Group]:
        with self._lock:
            return [o for o in self._groups.values() if o is not g]

    # -- pull ----------------------------------------------------------------------
    def pull(
        self,
        name: str,
        *,
        with_state: bool = False,
        min_version: int | None = None,
        timeout: float | None = None,
        cancellation: Cancellation | None = None,
        reserve: Callable[[int], None] | None = None,
    ) -> PullResult:
        """X (with V, H when ``with_state``) of one version, read-only.

        With ``min_version`` the call waits (at most ``timeout`` seconds, until
        ``cancellation`` is set) for T to reach it. ``reserve(nbytes)`` is called with
        the size of the arrays before they are handed out; it may refuse by raising.
        """
        self._check_open()
        g = self._group(name)
        with g.cond:
            self._check_live(g)
            if min_version is not None:
                self._wait_version(g, min_version, timeout, cancellation)
            if reserve is not None:
                states = len(g.states) if with_state else 0
                reserve(g.element_count * g.dtype.itemsize * (1 + states))
            return PullResult(
                g.update_count,
                g.learning_rate,
                self._shared.values(g, with_state),
                g.array_names(with_state),
            )

    def pull_into(
        self,
        name: str,
        write: Callable[[Sequence[Array], tuple[str, ...]], _W],
        *,
        with_state: bool = False,
        min_version: int | None = None,
        timeout: float | None = None,
        cancellation: Cancellation | None = None,
    ) -> tuple[int, float, _W]:
        """Like ``pull``, but ``write(arrays, names)`` copies the live arrays out
        under the group's lock (one copy, straight into the caller's memory, e.g.
        a client's shared-memory segment); returns (T, R, what ``write`` returned).
        ``write`` must not keep the arrays."""
        self._check_open()
        g = self._group(name)
        with g.cond:
            self._check_live(g)
            if min_version is not None:
                self._wait_version(g, min_version, timeout, cancellation)
            arrays = g.xs + (g.state_arrays() if with_state else [])
            n = len(g.shapes)
            shaped = [a.reshape(g.shapes[i % n]) for i, a in enumerate(arrays)]
            written = write(shaped, g.array_names(with_state))
            return g.update_count, g.learning_rate, written

    @property
    def waiting_calls(self) -> int:
        """Calls waiting for a version now."""
        return self._waiting.count

    def _wait_version(
        self,
        g: Group,
        version: int,
        timeout: float | None,
        cancellation: Cancellation | None,
    ) -> None:
        self._waiting.wait_version(g, version, Wait(timeout, cancellation))

    # -- workers (``_quorum``) -----------------------------------------------------
    def join(self, name: str, worker_id: str) -> LeaseView:
        """Join or renew a worker's lease (a heartbeat of an unknown worker joins)."""
        self._check_open()
        check_name(worker_id, "worker id")
        g = self._group(name)
        with self._journaled() as journal, g.cond:
            self._check_live(g)
            return _quorum.join(g, worker_id, self._clock(), journal)

    def leave(self, name: str, worker_id: str) -> LeaseView:
        g = self._group(name)
        with self._journaled() as journal, g.cond:
            self._check_live(g)
            return _quorum.leave(g, worker_id, journal)

    # -- durability ----------------------------------------------------------------
    def capture(
        self,
        current_lsn: Callable[[], int] = lambda: 0,
        scratch: Callable[[int], Array] | None = None,
    ) -> Iterator[GroupCapture]:
        """Each group's image and runtime state, one group at a time, by name.

        A group is copied under its lock when the consumer asks for it, so a caller
        that writes each capture before taking the next can lend one ``scratch(n)``
        buffer (at least n bytes) for them all: copying into memory already touched
        is several times faster than into fresh pages, and the lock is held for the
        copy. ``current_lsn`` is read under the same lock: every journal record of
        the group up to that lsn is in the copy, and none after it.
        """
        for g in self._live():
            with g.cond, alone(g.cond, g.order):
                if g.deleted:
                    continue
                captured = GroupCapture(g.image(scratch), g.runtime(current_lsn()))
            yield captured

    def install(
        self, image: GroupImage, runtime: GroupRuntime | None = None
    ) -> GroupView:
        """Recreate a saved group with all its state (at start, before serving).

        The one path from a saved form back to a group: snapshot restore and the
        replay of a logged create. The arrays are taken over without a copy.
        """
        d = image.definition
        attrs = make_attrs(d.optimizer, d.attributes)
        check_update_count(d.update_count)
        check_learning_rate(d.learning_rate, d.dtype)
        check_lease_seconds(d.lease_seconds)
        g = Group.from_image(image, attrs, next(self._incarnations))
        if runtime is not None:
            g.restore_runtime(runtime, self._clock())
        with self._lock:
            if g.name in self._groups:
                raise AlreadyExists(
                    f"group {g.name!r} exists already; delete it first or pick "
                    "another name",
                    metadata={"group": g.name},
                )
            self._groups[g.name] = g
        _log_group("restored", g)
        return g.view(self._clock())

    def replay_create(
        self,
        image: GroupImage,
        request_id: str = "",
        moved: dict[str, Any] | None = None,
    ) -> None:
        """A logged create; ``moved``: a group a resharding moved here, with the
        exactly-once windows it came with (``runtime_to_json``)."""
        if moved is not None:
            self.install(image, runtime_from_json(moved))
            return
        self.install(image, GroupRuntime(created_by=request_id) if request_id else None)

    def replay_push(
        self,
        name: str,
        grads: Sequence[Array],
        *,
        client_id: str,
        seq: int,
        base_version: int | None,
        learning_rate: float | None,
        logged: bool = False,
    ) -> PushOutcome:
        ticket = self._ticket(name, grads)
        check_gradient_values(ticket, grads, learning_rate)
        request = PushRequest(client_id, seq, base_version, learning_rate)
        journal = JournalEntry(self._journal if logged else None)
        return self._pushes.run(ticket._group, grads, request, journal, replay=True)

    def replay_sync_step(self, name: str, count: int, logged: bool = False) -> None:
        """Replay a logged sync step (taken once ``count`` pushes are buffered)."""
        g = self._group(name)
        with self._journaled(not logged) as journal, g.cond:
            g.replay_step = count
            _quorum.maybe_sync_step(g, journal, _quorum.logged_step_due)

    # -- rewind and fork (``_rewind``; the state is computed by ``durability``) ------
    def rewind(self, image: GroupImage, *, replay: bool = False) -> tuple[int, int]:
        """Set group ``image.name`` back to the image's X, V, H, tables and T, as
        a logged change (its record carries the image, so a restart's replay and a
        standby apply it alone); returns (T before, T after)."""
        self._check_open()
        name = image.name
        g = self._group(name)
        with self._journaled(replay) as journal, g.cond, alone(g.cond, g.order):
            self._check_live(g)
            journal.check_writable()  # a standby refuses (NOT_PRIMARY)
            _rewind.check_image(g, image)
            to_step = int(image.definition.update_count)
            journal.durable(
                {
                    "op": "rewind",
                    "group": name,
                    "to_step": to_step,
                    "image": image.to_json(),
                },
                image.arrays,
            )
            before = _rewind.install_state(g, image, next(self._incarnations))
        return before, to_step

    def release(self, name: str) -> GroupImage:
        """Remove group ``name`` and hand its state over without a copy: for a
        store that is discarded next (a rewind's scratch store, ``durability``)."""
        g = self._group(name)
        with self._lock:
            del self._groups[name]
        with g.cond, alone(g.cond, g.order):
            g.deleted = True
            n = len(g.shapes)
            dense = g.xs + g.state_arrays()
            arrays = [a.reshape(g.shapes[i % n]) for i, a in enumerate(dense)]
            for t in g.tables.values():
                arrays += t.arrays()
            return GroupImage(g.definition(), arrays)

    def replay_rewind(self, image: GroupImage, logged: bool = False) -> None:
        self.rewind(image, replay=not logged)

    def fork(self, image: GroupImage) -> GroupView:
        """A new group ``image.name`` of the image's state (logged as its create)."""
        self._check_open()
        check_name(image.name)
        self._entry.check_writable()  # a standby refuses (NOT_PRIMARY)
        d = image.definition
        g = Group.from_image(
            image, make_attrs(d.optimizer, d.attributes), next(self._incarnations)
        )
        self.check_group_size(g.state_bytes)
        self._add_group(g, g.state_bytes)
        _log_group("forked", g)
        return g.view(self._clock())

    def replay_set_learning_rate(
        self, name: str, lr: float, logged: bool = False
    ) -> None:
        self._set_learning_rate(name, lr, replay=not logged)

    def replay_delete(self, name: str, logged: bool = False) -> None:
        self._delete(name, replay=not logged)

    # -- helpers -------------------------------------------------------------------
    @contextmanager
    def _journaled(self, replay: bool = False) -> Iterator[JournalEntry]:
        """The journal for the block's records (waited for inside the block, under
        the group's lock). A replayed change is not logged again."""
        yield JournalEntry(None if replay else self._journal)

    def _check_open(self) -> None:
        if self._closing.is_set():
            raise Unavailable("the server is shutting down; retry on another server")


def _log_group(what: str, g: Group) -> None:
    log.info(
        "%s group %s: %s %s, %d tensors, %d elements, T=%d",
        what, g.name, g.attrs.op, g.dtype, len(g.names), g.element_count,
        g.update_count,
    )  # fmt: skip
