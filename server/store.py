"""The parameter store: optimizer groups and their state, with no knowledge of gRPC.

A group is one ONNX training node: operator and attributes, learning rate R, update
count T, and ordered tensors X_1..X_n with their V/H, all of one dtype. Each group has
its own lock (a condition variable, so pulls can wait for a version), so different
groups step concurrently. A push is atomic: every gradient is validated before any
state changes; then every tensor steps and T advances. Only the store touches a
group: callers get frozen records (``GroupView``, ``PullResult``, ``LeaseView``,
``PushOutcome``) and, for a push, a ``PushTicket`` from ``validate_push``.

Consistency is chosen per group:

- ``async``: each push steps at once; with ``max_staleness`` a push computed against a
  T older than ``T - max_staleness`` is refused.
- ``sync``: pushes computed against the current T are buffered; when the quorum has
  pushed, they are combined in client-id order (sum, then divided by their count for
  ``mean``) and one step is applied. The quorum is ``sync_workers`` less the workers
  whose lease ran out, so a dead worker never hangs a step.

Waiting: a pull with ``min_version`` (and a sync push asking for the new values) may
wait for a version. A wait ends when the version comes, the deadline passes, the
caller goes away (its ``Cancellation`` is set) or the server drains; at most
``max_waiting_calls`` calls wait at once, the others are refused with
RESOURCE_EXHAUSTED, so waits cannot hold every worker thread of a server.

Reading: a pull's arrays are a read-only copy of one version, shared by every caller
that reads that version while any of them still holds it, so slow readers of a large
group hold one copy between them, not one each.

Exactly-once: a push carries (client_id, seq); the last ``DEDUP_WINDOW`` results per
client are remembered and a repeated push is answered with its first result. A
client's window is kept ``dedup_seconds`` after its last push, for at most
``dedup_clients`` clients per group (the least recently pushing are dropped first).

Durability: every change is validated, then logged to the ``Journal`` given to
``set_journal`` (its records are numbered by ``lsn``), and applied only once its record
is durable, all under the group's lock; so the change applied is exactly the one
logged, and an acknowledged change is durable. When the log cannot be written the call
is refused with ``Unavailable`` and nothing changes. The journal batches the records
of different groups into one fsync (group commit). The ``replay_*`` methods redo
logged changes without logging them again.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
from onnxps.client.image import GroupImage, TableDefinition

from ._checks import (
    MAX_UPDATE_COUNT,
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
    all_finite,
    check_name,
    combine_contributions,
)
from ._ids import (
    IdsTable,
    RowsPage,
    check_ids,
    check_table_spec,
    empty_part,
    new_row_counts,
    table_part,
)
from ._sparse import (
    INDEX_DTYPE,
    RowSpec,
    check_indices,
    check_row_specs,
    flatten,
    gather_rows,
    is_row_push,
    row_push_parts,
    split_row_push,
)
from .errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from .kernels import OptimizerAttrs, make_attrs

__all__ = [
    "DEDUP_WINDOW",
    "CallCancelled",
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
        # step; the wait polls (``_WAKE_SECONDS``) if the lock is busy.
        if cond is not None and cond.acquire(timeout=0.05):
            try:
                cond.notify_all()
            finally:
                cond.release()

    @contextmanager
    def _watching(self, cond: threading.Condition) -> Iterator[None]:
        with self._lock:
            self._cond = cond
        try:
            yield
        finally:
            with self._lock:
                self._cond = None


@dataclass(frozen=True)
class _Wait:
    """How long a call may wait for a version, and how it learns its caller left."""

    timeout: float | None = None
    cancellation: Cancellation | None = None
    counted: bool = False  # the call holds a waiting slot already (a sync push)


# A wait wakes at least this often, to see a cancellation whose wake-up was missed.
_WAKE_SECONDS = 0.5
_W = TypeVar("_W")  # what a pull_into writer returns


@dataclass(frozen=True)
class PushTicket:
    """A push header the store accepted: its gradients may now be read and pushed."""

    group: str
    names: tuple[str, ...]  # the group's tensor names, in gradient order
    _group: Group = field(repr=False, compare=False)


class ValuesSink(Protocol):
    """Takes a push's X_1..X_n as the push makes them (``push(..., sink=)``).

    Both methods are called under the group's lock and must not raise (a push
    they interrupted would be half applied): they copy what they need at once.
    ``begin`` gets the push's outcome and the group's flat X arrays, readable only
    during these calls; ``block(i, start, stop)`` says that elements
    ``start:stop`` of ``xs[i]`` hold their final values. Blocks come in order and
    cover every element once.
    """

    def begin(self, outcome: PushOutcome, xs: Sequence[Array]) -> None: ...

    def block(self, index: int, start: int, stop: int) -> None: ...


class _Emission:
    """A ``ValuesSink`` and whether the push has started sending to it."""

    def __init__(self, sink: ValuesSink) -> None:
        self.sink = sink
        self.begun = False

    def begin(self, outcome: PushOutcome, xs: Sequence[Array]) -> None:
        self.begun = True
        self.sink.begin(outcome, xs)

    def all_of(self, outcome: PushOutcome, xs: Sequence[Array]) -> None:
        """Send X whole (a duplicate, or a sync push whose step is taken)."""
        self.begin(outcome, xs)
        for i, x in enumerate(xs):
            self.sink.block(i, 0, x.size)


@dataclass(frozen=True)
class _PushRequest:
    """How a push is identified (exactly-once) and what it asks besides its grads."""

    client_id: str
    seq: int  # the client's push number, not a log position
    base_version: int | None
    learning_rate: float | None
    rows: bool = False  # a row push (``_sparse``): logged as its rows, not a table

    def record(self, group: str, update_count: int) -> dict[str, Any]:
        return {
            "op": "push_rows" if self.rows else "push",
            "group": group,
            "client_id": self.client_id,
            "seq": self.seq,
            "base_version": self.base_version,
            "lr": self.learning_rate,
            "t": update_count,  # the T it steps at (sync: the step it is buffered for)
        }


class _JournalEntry:
    """Logs a store call's records; ``wait`` blocks until one is durable.

    Called under the group's lock, before the change is applied: ``wait`` raises
    ``Unavailable`` when the log could not be written, and the caller then leaves the
    group as it was. Without a journal (memory only, or replay) both do nothing.
    """

    def __init__(self, journal: Journal | None) -> None:
        self._journal = journal

    def log(self, record: dict[str, Any], arrays: Sequence[Array] = ()) -> int | None:
        return None if self._journal is None else self._journal.log(record, arrays)

    def wait(self, lsn: int | None) -> None:
        if self._journal is not None and lsn is not None:
            self._journal.wait(lsn)

    def durable(self, record: dict[str, Any], arrays: Sequence[Array] = ()) -> None:
        """Log ``record`` and wait until it is durable."""
        self.wait(self.log(record, arrays))


def _quorum_reached(g: Group) -> bool:
    return bool(g.pending) and len(g.pending) >= g.quorum()


def _logged_step_due(g: Group) -> bool:
    # Replay steps where the log says a step was taken: the sync_step record precedes
    # the push that triggered it, so wait for that many contributions.
    if g.replay_step is None or len(g.pending) < g.replay_step:
        return False
    g.replay_step = None
    return True


class ParameterStore:
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
        self._clock = clock
        self._journal = journal
        self._incarnations = itertools.count(1)
        self._closed = False
        self._draining = False
        self._reaper: threading.Thread | None = None
        self._stop = threading.Event()
        self._waiting = 0
        self._waiting_lock = threading.Lock()
        # (incarnation, T, with_state) -> the buffer under a version's shared copy
        self._shared: weakref.WeakValueDictionary[tuple[int, int, bool], Array] = (
            weakref.WeakValueDictionary()
        )
        self._shared_lock = threading.Lock()

    # -- lifecycle -----------------------------------------------------------------
    def set_journal(self, journal: Journal | None) -> None:
        """Log every change from now on to ``journal`` (None: stop logging)."""
        self._journal = journal

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
        self._draining = True
        self._wake_all()

    def close(self) -> None:
        self._closed = True
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
        limits = self.limits
        for g in self._live():
            with self._journaled() as journal, g.cond:
                if g.deleted:
                    continue
                now = self._clock()
                g.forget_clients(now, limits.dedup_seconds, limits.dedup_clients)
                expired = bool(g.workers) and g.expire_leases(now)
                if expired or _quorum_reached(g):
                    try:
                        self._maybe_sync_step(g, journal)
                    except Unavailable:
                        pass  # the journal logged why; the next round tries again
                    g.cond.notify_all()

    # -- groups --------------------------------------------------------------------
    def _live(self, prefix: str = "") -> list[Group]:
        with self._lock:
            return [g for n, g in sorted(self._groups.items()) if n.startswith(prefix)]

    def _group(self, name: str) -> Group:
        with self._lock:
            g = self._groups.get(name)
        if g is None:
            raise NotFound(
                f"no group named {name!r}; create it first", metadata={"group": name}
            )
        return g

    def groups(self, prefix: str = "") -> list[GroupView]:
        """Every group whose name starts with ``prefix``, by name."""
        views = []
        for g in self._live(prefix):
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
    ) -> GroupView:
        """Create a group of ``tensors`` and ids ``tables`` (``_ids``; their rows
        ``table_arrays``, as an image has them, when resumed; else empty); a group
        of tables only takes its ``dtype`` (default float32)."""
        self._check_open()
        check_name(name)
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
        journal = _JournalEntry(self._journal)
        # Held until the create record is durable: no call uses the group before.
        with group.cond:
            with self._lock:
                self._check_room(name, group_bytes)
                self._groups[name] = group
                lsn = None
                if self._journal is not None:
                    # The full definition and initial arrays, so replay recreates it.
                    image = group.image()
                    record = {"op": "create", "group": name, "image": image.to_json()}
                    lsn = journal.log(record, image.arrays)
            try:
                journal.wait(lsn)
            except Unavailable:
                with self._lock:
                    if self._groups.get(name) is group:
                        del self._groups[name]
                group.deleted = True
                raise
        _log_group("created", group)
        return group.view(self._clock())

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
        with self._journaled(replay) as journal, g.cond:
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
        with self._journaled(replay) as journal, g.cond:
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
        g = self._group(name)
        specs = list(specs)
        n = len(g.shapes)
        if len(specs) != n:
            raise InvalidArgument(
                f"group {g.name!r} holds {n} tensors ({', '.join(g.names)}): expected "
                f"{n} gradients in that order, got {len(specs)}",
                reason="GRADIENT_COUNT",
                field="gradients",
                metadata={"group": g.name, "expected": n, "received": len(specs)},
            )
        for i, (dtype, shape) in enumerate(specs):
            if np.dtype(dtype) != g.dtype:
                raise InvalidArgument(
                    f"gradient {i + 1} ({g.names[i]!r}) must be {g.dtype}, the "
                    f"group's dtype; got {np.dtype(dtype)}",
                    reason="DTYPE_MISMATCH",
                    field=f"gradients[{i}].dtype",
                    metadata={"group": g.name, "expected": g.dtype, "received": dtype},
                )
            if tuple(shape) != g.shapes[i]:
                raise InvalidArgument(
                    f"gradient {i + 1} ({g.names[i]!r}) must have shape "
                    f"{g.shapes[i]}, got {tuple(shape)}",
                    reason="SHAPE_MISMATCH",
                    field=f"gradients[{i}].dims",
                    metadata={
                        "group": g.name,
                        "expected": g.shapes[i],
                        "received": shape,
                    },
                )
        return PushTicket(g.name, g.names, g)

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
    ) -> PushOutcome:
        """Push gradients G_1..G_n; ``group`` is a name or a ticket for these grads.

        ``known_finite``: the caller has checked every element of ``grads`` finite
        (a stream checks its chunks as they arrive), so the store does not again.

        ``(client_id, seq)`` identifies the push for exactly-once delivery. With
        ``return_values`` a sync push waits for its step (see ``pull``); when every
        waiting slot is taken, a push that would wait is refused before anything
        changes (one that completes the step goes through). With ``return_values``
        and a ``sink``, X goes to the sink instead of ``values``: block by block
        while an async push steps, so the caller can send each block while the
        next one steps (whole, for a duplicate or a sync push).
        """
        self._check_open()
        ticket = self._ticket(group, grads)
        if not client_id and ticket._group.consistency.mode == "sync":
            raise InvalidArgument(
                f"group {ticket.group!r} is sync: a sync step counts distinct "
                "clients, so every push needs a client_id (the Client sets one); "
                "set client_id"
            )
        self._check_values(ticket, grads, learning_rate, known_finite)
        request = _PushRequest(client_id, seq, base_version, learning_rate)
        g = ticket._group
        may_wait = return_values and g.consistency.mode == "sync"
        slot = self._waiting_slot(g.name, required=False)
        with slot if may_wait else nullcontext(False) as held:
            wait = _Wait(timeout, cancellation, counted=held)
            emit = _Emission(sink) if sink is not None and return_values else None
            return self._push(g, grads, request, return_values, wait, emit=emit)

    def _ticket(self, group: str | PushTicket, grads: Sequence[Array]) -> PushTicket:
        if isinstance(group, PushTicket):
            return group
        return self.validate_push(group, [(a.dtype, a.shape) for a in grads])

    def _check_values(
        self,
        ticket: PushTicket,
        grads: Sequence[Array],
        learning_rate: float | None,
        known_finite: bool = False,
    ) -> None:
        if learning_rate is not None:
            check_learning_rate(
                learning_rate, ticket._group.dtype, "the push's learning_rate"
            )
        if ticket._group.allow_non_finite or known_finite:
            return
        for i, a in enumerate(grads):
            if not all_finite(a):
                raise InvalidArgument(
                    f"gradient {i + 1} ({ticket.names[i]!r}) holds NaN or inf, which "
                    f"would poison group {ticket.group!r} for good; fix the worker, or "
                    "create the group with allow_non_finite=True",
                    reason="NON_FINITE_GRADIENT",
                    field=f"gradients[{i}]",
                    metadata={"group": ticket.group},
                )

    def _push(
        self,
        g: Group,
        grads: Sequence[Array],
        request: _PushRequest,
        return_values: bool = False,
        wait: _Wait | None = None,
        *,
        replay: bool = False,
        emit: _Emission | None = None,
    ) -> PushOutcome:
        with self._journaled(replay) as journal, g.cond:
            self._check_live(g)
            cached = self._dedup_lookup(g, request.client_id, request.seq)
            if cached is not None:
                outcome = PushOutcome(cached[0], cached[1], duplicate=True)
            else:
                if return_values:
                    self._check_room_to_wait(g, request, wait)
                due = _logged_step_due if replay else _quorum_reached
                outcome = self._step_or_buffer(g, grads, request, journal, due, emit)
            if return_values:
                if not outcome.applied:
                    self._wait_version(g, outcome.update_count + 1, wait or _Wait())
                if emit is not None:
                    if not emit.begun:
                        emit.all_of(outcome, g.xs)
                    return outcome
                values = self._frozen_values(g, False)
                outcome = dataclasses.replace(outcome, values=values)
            return outcome

    def _step_or_buffer(
        self,
        g: Group,
        grads: Sequence[Array],
        request: _PushRequest,
        journal: _JournalEntry,
        due: Callable[[Group], bool],
        emit: _Emission | None = None,
    ) -> PushOutcome:
        _check_base_version(g, request.base_version)
        if g.tables and due is not _logged_step_due:  # replay: it fitted when logged
            self._check_table_room(g, grads)
        if g.update_count >= MAX_UPDATE_COUNT:
            raise FailedPrecondition(
                f"group {g.name!r} is at T={g.update_count}, the most steps a group "
                f"takes (2**62 = {MAX_UPDATE_COUNT}); export it and create it again "
                "with a smaller update_count"
            )
        record = request.record(g.name, g.update_count)
        if g.consistency.mode == "async":
            journal.durable(record, grads)  # Unavailable: refused, nothing changed
            if emit is None:
                g.step(grads, request.learning_rate)
            else:
                emit.begin(PushOutcome(g.update_count + 1, True), g.xs)
                g.step(grads, request.learning_rate, emit.sink.block)
            outcome = PushOutcome(g.update_count, True)
        else:
            outcome = self._buffer(g, grads, request.client_id, record, journal, due)
        if request.client_id:
            self._dedup_store(g, request.client_id, request.seq, outcome)
        g.cond.notify_all()
        return outcome

    def _buffer(
        self,
        g: Group,
        grads: Sequence[Array],
        client_id: str,
        record: dict[str, Any],
        journal: _JournalEntry,
        due: Callable[[Group], bool],
    ) -> PushOutcome:
        """A sync push: buffer the contribution; step if it completes the quorum.

        The contribution is kept once its record is durable, and the step it
        completes is logged only then (never a logged step without its push) and
        taken once that record is durable too.
        """
        t = g.update_count
        g.expire_leases(self._clock())
        key = client_id or f"~anonymous-{len(g.pending)}-{time.monotonic_ns()}"
        if key in g.pending:
            raise FailedPrecondition(
                f"client {client_id!r} already pushed for step T={t} of sync group "
                f"{g.name!r}; wait for the step (pull min_version={t + 1})",
                reason="DUPLICATE_SYNC_PUSH",
                metadata={"group": g.name, "update_count": t},
            )
        kept = list(grads)
        if g.tables and not is_row_push(grads):
            # a dense push to a group with ids tables: no rows of them (so every
            # contribution has a part per table)
            kept += flatten([empty_part(t) for t in g.tables.values()])
        g.pending[key] = [
            np.array(a, dtype=a.dtype if a.dtype == INDEX_DTYPE else g.dtype, order="C")
            for a in kept
        ]
        try:
            journal.durable(record, grads)
        except Unavailable:
            del g.pending[key]
            raise
        try:
            if self._maybe_sync_step(g, journal, due):
                return PushOutcome(g.update_count, True)
        except Unavailable:
            pass  # buffered and durable; the reaper takes the step once it is logged
        return PushOutcome(t, False)

    def _maybe_sync_step(
        self,
        g: Group,
        journal: _JournalEntry,
        due: Callable[[Group], bool] = _quorum_reached,
    ) -> bool:
        if not due(g):
            return False
        journal.durable(_sync_step_record(g))  # Unavailable: no step, nothing changed
        self._take_sync_step(g)
        return True

    def _take_sync_step(self, g: Group) -> None:
        combined = combine_contributions(g.pending, g.consistency.reduction, g.dtype)
        g.pending = {}
        g.step(combined, None)
        g.cond.notify_all()

    def _dedup_lookup(
        self, g: Group, client_id: str, seq: int
    ) -> tuple[int, bool] | None:
        if not client_id:
            return None
        w = g.dedup.get(client_id)
        if w is None:
            return None
        hit = w.results.get(seq)
        if hit is not None:
            w.last_push = self._clock()  # a resend: its client is alive
            g.dedup.move_to_end(client_id)
            return hit
        if seq <= w.floor:
            raise FailedPrecondition(
                f"push seq {seq} from client {client_id!r} is older than the "
                f"{DEDUP_WINDOW} pushes remembered for it; it cannot be deduplicated",
                reason="SEQ_TOO_OLD",
                metadata={"group": g.name, "client_id": client_id, "seq": seq},
            )
        return None

    def _dedup_store(
        self, g: Group, client_id: str, seq: int, outcome: PushOutcome
    ) -> None:
        now = self._clock()
        g.remember(client_id, seq, (outcome.update_count, outcome.applied), now)
        g.forget_clients(now, self.limits.dedup_seconds, self.limits.dedup_clients)

    # -- row pushes and pulls (``_sparse``) ----------------------------------------
    def validate_push_rows(self, name: str, specs: Iterable[RowSpec]) -> None:
        """Check a row push's header (tensor names, dtypes, shapes) before any bytes
        are read; ``specs`` is read after the group is found."""
        g = self._group(name)
        specs = list(specs)
        dense = [s for s in specs if s[0] not in g.tables]
        check_row_specs(g.name, g.names, g.shapes, g.dtype, dense)
        seen: set[str] = set()
        for j, (tname, index_spec, value_spec) in enumerate(specs):
            if tname in g.tables:
                self._check_table_once(g, tname, seen, f"gradients[{j}]")
                where = f"gradients[{j}]"
                check_table_spec(g.name, g.tables[tname], where, index_spec, value_spec)

    @staticmethod
    def _check_table_once(g: Group, tname: str, seen: set[str], where: str) -> None:
        if tname in seen:
            raise InvalidArgument(
                f"ids table {tname!r} is named twice in one row push; put its rows "
                "in one gradient (repeated ids are summed)",
                reason="DUPLICATE_TENSOR",
                field=f"{where}.name",
                metadata={"group": g.name, "tensor": tname},
            )
        seen.add(tname)

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
        dense = {k: v for k, v in gradients.items() if k not in g.tables}
        parts = row_push_parts(g.name, g.names, g.shapes, g.dtype, dense)
        where = {k: f"gradients[{j}]" for j, k in enumerate(gradients)}
        for tname, table in g.tables.items():
            grad = gradients.get(tname)
            if grad is None:
                parts.append(empty_part(table))
                continue
            if not isinstance(grad, tuple):
                raise InvalidArgument(
                    f"{tname!r} is an ids table: its gradient is (ids, rows), not a "
                    "dense gradient",
                    reason="ROW_INDICES",
                    field=f"{where[tname]}.indices",
                    metadata={"group": name, "tensor": tname},
                )
            parts.append(table_part(name, table, where[tname], grad[0], grad[1]))
        flat = flatten(parts)
        self._check_row_values(g, flat, learning_rate)
        request = _PushRequest(client_id, seq, base_version, learning_rate, rows=True)
        return self._push(g, flat, request)

    def _check_row_values(
        self, g: Group, flat: Sequence[Array], learning_rate: float | None
    ) -> None:
        if learning_rate is not None:
            check_learning_rate(learning_rate, g.dtype, "the push's learning_rate")
        if g.allow_non_finite:
            return
        for a in flat:
            if a.dtype != INDEX_DTYPE and not all_finite(a):
                raise InvalidArgument(
                    f"a row gradient holds NaN or inf, which would poison group "
                    f"{g.name!r} for good; fix the worker, or create the group with "
                    "allow_non_finite=True",
                    reason="NON_FINITE_GRADIENT",
                    field="gradients",
                    metadata={"group": g.name},
                )

    def replay_push_rows(
        self,
        name: str,
        arrays: Sequence[Array],
        *,
        client_id: str,
        seq: int,
        base_version: int | None,
        learning_rate: float | None,
    ) -> PushOutcome:
        """Redo a logged row push (its rows are coalesced and checked already)."""
        g = self._group(name)
        parts = split_row_push(arrays)
        if len(parts) != len(g.names) + len(g.tables):
            raise InvalidArgument(
                f"logged row push has {len(parts)} tensors, group {name!r} has "
                f"{len(g.names)} and {len(g.tables)} ids tables"
            )
        for i, p in enumerate(parts[: len(g.names)]):
            if isinstance(p, np.ndarray):
                continue
            check_indices(p.indices, g.shapes[i][0], f"tensor {g.names[i]!r}", name)
        request = _PushRequest(client_id, seq, base_version, learning_rate, rows=True)
        return self._push(g, list(arrays), request, replay=True)

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
        checked: list[tuple[str, int, Array]] = []  # (name, tensor or -1, indices)
        for j, (tname, idx) in enumerate(selections.items()):
            where = f"tensors[{j}].indices"
            if tname in g.tables:
                checked.append((tname, -1, check_ids(idx, where, name)))
                continue
            if tname not in g.names:
                held = [*g.names, *g.tables]
                raise InvalidArgument(
                    f"group {name!r} has no tensor {tname!r}; it holds "
                    f"{', '.join(held)}",
                    reason="UNKNOWN_TENSOR",
                    field=f"tensors[{j}].name",
                    metadata={"group": name, "tensor": tname},
                )
            i = g.names.index(tname)
            if not g.shapes[i]:
                raise InvalidArgument(
                    f"tensor {tname!r} is a scalar: it has no rows",
                    reason="NOT_A_TABLE",
                    field=where,
                )
            checked.append((tname, i, check_indices(idx, g.shapes[i][0], where, name)))
        with g.cond:
            self._check_live(g)
            if min_version is not None:
                self._wait_version(g, min_version, _Wait(timeout, cancellation))
            states = g.attrs.state_names if with_state else ()
            if reserve is not None:
                row_bytes = sum(
                    idx.size
                    * (
                        g.tables[t].dim
                        if i < 0
                        else g.xs[i].size // max(1, g.shapes[i][0])
                    )
                    for t, i, idx in checked
                )
                reserve(row_bytes * g.dtype.itemsize * (1 + len(states)))
            per_selection = [
                g.tables[t].read(idx, with_state)
                if i < 0
                else [
                    gather_rows(src[i], g.shapes[i], idx)
                    for src in [g.xs] + [g.states[s] for s in states]
                ]
                for t, i, idx in checked
            ]
            arrays = tuple(
                rows[k] for k in range(1 + len(states)) for rows in per_selection
            )
            names = tuple(
                (f"{s}:" if s else "") + t for s in ("", *states) for t, _, _ in checked
            )
            return PullResult(g.update_count, g.learning_rate, arrays, names)

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
            t = self._table(g, table)
            page, rows, last = t.page(
                after, limit or max(1, t.count), with_values, with_state
            )
            states = t.state_names if with_state else ()
            names = (table, *(f"{s}:{table}" for s in states)) if with_values else ()
            return RowsPage(page, tuple(rows), names, last, t.count, g.update_count)

    @staticmethod
    def _table(g: Group, table: str) -> IdsTable:
        t = g.tables.get(table)
        if t is None:
            held = ", ".join(g.tables) or "none"
            raise InvalidArgument(
                f"group {g.name!r} has no ids table {table!r}; its ids tables: {held}",
                reason="UNKNOWN_TENSOR",
                field="table",
                metadata={"group": g.name, "tensor": table},
            )
        return t

    def _check_table_room(self, g: Group, grads: Sequence[Array]) -> None:
        """Under the lock, before a row push is logged: the rows it (and, in a sync
        group, the step it joins) would create fit the tables' max_rows and the
        server's byte limits; RESOURCE_EXHAUSTED otherwise, nothing changed."""
        limits = self.limits.max_group_bytes or self.limits.max_total_bytes
        if not is_row_push(grads) or not (
            limits or any(t.max_rows for t in g.tables.values())
        ):
            return  # nothing to count against
        n = len(g.names)
        mine = split_row_push(grads)[n:]
        pushes = [split_row_push(c)[n:] for c in g.pending.values()] + [mine]
        new = new_row_counts(g.tables, pushes)  # type: ignore[arg-type]
        new_bytes = 0
        for tname, k in new.items():
            t = g.tables[tname]
            if t.max_rows and t.count + k > t.max_rows:
                raise ResourceExhausted(
                    f"the push would create {k} rows in ids table {tname!r} of group "
                    f"{g.name!r}, which holds {t.count} of its max_rows={t.max_rows}; "
                    "nothing was changed",
                    metadata={"limit": "max_rows", "group": g.name, "table": tname},
                )
            new_bytes += k * t.row_bytes
        if not new_bytes:
            return
        limit = self.limits.max_group_bytes
        if limit and g.state_bytes + new_bytes > limit:
            raise ResourceExhausted(
                f"the push would grow group {g.name!r} by {new_bytes} bytes of new "
                f"rows to {g.state_bytes + new_bytes}, over the server's limit of "
                f"{limit} bytes per group; nothing was changed",
                metadata={"limit": "max_group_bytes", "group": g.name},
            )
        limit = self.limits.max_total_bytes
        if limit:
            with self._lock:
                others = [o for o in self._groups.values() if o is not g]
            # other groups' sizes read without their locks: a moment's estimate
            total = sum(o.state_bytes for o in others) + g.state_bytes + new_bytes
            if total > limit:
                raise ResourceExhausted(
                    f"the push would grow group {g.name!r} by {new_bytes} bytes of "
                    f"new rows; the server would hold {total}, over its limit of "
                    f"{limit}; nothing was changed",
                    metadata={"limit": "max_total_bytes", "group": g.name},
                )

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
                self._wait_version(g, min_version, _Wait(timeout, cancellation))
            if reserve is not None:
                states = len(g.states) if with_state else 0
                reserve(g.element_count * g.dtype.itemsize * (1 + states))
            return PullResult(
                g.update_count,
                g.learning_rate,
                self._frozen_values(g, with_state),
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
                self._wait_version(g, min_version, _Wait(timeout, cancellation))
            arrays = g.xs + (g.state_arrays() if with_state else [])
            n = len(g.shapes)
            shaped = [a.reshape(g.shapes[i % n]) for i, a in enumerate(arrays)]
            written = write(shaped, g.array_names(with_state))
            return g.update_count, g.learning_rate, written

    def _frozen_values(self, g: Group, with_state: bool) -> tuple[Array, ...]:
        """Under the group's lock: read-only arrays of its current version.

        One copy per version serves every reader that asks while another still holds
        it (a copy with state serves readers of X alone too); it is freed with the
        last reader's arrays.
        """
        arrays = g.xs + (g.state_arrays() if with_state else [])
        key = (g.incarnation, g.update_count, with_state)
        base = self._shared_copy(key)
        if base is None and not with_state:
            base = self._shared_copy(key[:2] + (True,))
        if base is None:
            base = np.empty(sum(_slot_bytes(a) for a in arrays), np.uint8)
            for a, view in zip(arrays, _slots(base, arrays), strict=True):
                np.copyto(view, a)
            base.flags.writeable = False
            with self._shared_lock:
                self._shared[key] = base
        n = len(g.shapes)
        return tuple(
            v.reshape(g.shapes[i % n]) for i, v in enumerate(_slots(base, arrays))
        )

    def _shared_copy(self, key: tuple[int, int, bool]) -> Array | None:
        with self._shared_lock:
            return self._shared.get(key)

    @property
    def waiting_calls(self) -> int:
        """Calls waiting for a version now."""
        return self._waiting

    @contextmanager
    def _waiting_slot(self, group: str, *, required: bool = True) -> Iterator[bool]:
        """Hold one of the server's waiting slots; when all are taken, refuse, or
        yield False (holding none) if the slot is not ``required``."""
        limit = self.limits.max_waiting_calls
        with self._waiting_lock:
            held = not limit or self._waiting < limit
            if held:
                self._waiting += 1
        if not held and required:
            raise _no_room_to_wait(limit, group)
        try:
            yield held
        finally:
            if held:
                with self._waiting_lock:
                    self._waiting -= 1

    def _check_room_to_wait(
        self, g: Group, request: _PushRequest, wait: _Wait | None
    ) -> None:
        """Under the lock, before a sync push changes anything: refuse it if it would
        wait for its step and found no waiting slot (one that completes the step
        needs none)."""
        if wait is None or wait.counted or g.consistency.mode != "sync":
            return
        key = request.client_id or "~probe"  # anonymous pushes get fresh keys
        if key in g.pending:
            return  # refused as a second push for this step
        g.expire_leases(self._clock())
        g.pending[key] = []  # as if buffered: would it complete the quorum?
        try:
            completes = _quorum_reached(g)
        finally:
            del g.pending[key]
        if not completes:
            raise _no_room_to_wait(self.limits.max_waiting_calls, g.name)

    def _wait_version(self, g: Group, version: int, wait: _Wait) -> None:
        """Under the group's lock: wait until T reaches ``version``."""
        if g.update_count >= version:
            return
        deadline = None if wait.timeout is None else self._clock() + wait.timeout
        slot = nullcontext() if wait.counted else self._waiting_slot(g.name)
        gone = wait.cancellation
        woken = nullcontext() if gone is None else gone._watching(g.cond)
        with slot, woken:
            while g.update_count < version:
                self._check_waiting(g, version, gone)
                remaining = None if deadline is None else deadline - self._clock()
                if remaining is not None and remaining <= 0:
                    raise DeadlineExceeded(
                        f"group {g.name!r} is at T={g.update_count}; it did not "
                        f"reach T={version} before the deadline"
                    )
                g.cond.wait(timeout=min(remaining or _WAKE_SECONDS, _WAKE_SECONDS))

    def _check_waiting(self, g: Group, version: int, gone: Cancellation | None) -> None:
        """A waiting call ends when its group goes, the server drains or it left."""
        self._check_live(g)
        if self._draining:
            raise Unavailable(
                f"the server is shutting down while group {g.name!r} is at "
                f"T={g.update_count}, before T={version}; retry after it restarts",
                metadata={"group": g.name, "update_count": g.update_count},
            )
        if gone is not None and gone.cancelled:
            raise CallCancelled(
                f"the caller waiting for T={version} of group {g.name!r} went away"
            )

    # -- workers -------------------------------------------------------------------
    def join(self, name: str, worker_id: str) -> LeaseView:
        """Join or renew a worker's lease (a heartbeat of an unknown worker joins)."""
        self._check_open()
        check_name(worker_id, "worker id")
        g = self._group(name)
        with self._journaled() as journal, g.cond:
            self._check_live(g)
            # A heartbeat may be the first to see a lease run out: the quorum shrinks
            # here, so the pending step may be due now (the reaper will not retry it).
            if g.expire_leases(self._clock()):
                self._maybe_sync_step(g, journal)
            if worker_id not in g.workers:
                if worker_id in g.dead:
                    log.info("group %s: worker %s rejoined", name, worker_id)
                else:
                    log.info("group %s: worker %s joined", name, worker_id)
            g.dead.discard(worker_id)
            g.workers[worker_id] = self._clock() + g.lease_seconds
            return g.lease_view()

    def leave(self, name: str, worker_id: str) -> LeaseView:
        g = self._group(name)
        with self._journaled() as journal, g.cond:
            self._check_live(g)
            if g.workers.pop(worker_id, None) is not None:
                g.dead.add(worker_id)
                log.info("group %s: worker %s left", name, worker_id)
                self._maybe_sync_step(g, journal)
                g.cond.notify_all()
            return g.lease_view()

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
            with g.cond:
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

    def replay_create(self, image: GroupImage) -> None:
        self.install(image)

    def replay_push(
        self,
        name: str,
        grads: Sequence[Array],
        *,
        client_id: str,
        seq: int,
        base_version: int | None,
        learning_rate: float | None,
    ) -> PushOutcome:
        ticket = self._ticket(name, grads)
        self._check_values(ticket, grads, learning_rate)
        request = _PushRequest(client_id, seq, base_version, learning_rate)
        return self._push(ticket._group, grads, request, replay=True)

    def replay_sync_step(self, name: str, contributors: int) -> None:
        """Replay a logged sync step: it is taken once that many pushes are buffered."""
        g = self._group(name)
        with g.cond:
            g.replay_step = contributors
            self._maybe_sync_step(g, _JournalEntry(None), _logged_step_due)

    def replay_set_learning_rate(self, name: str, learning_rate: float) -> None:
        self._set_learning_rate(name, learning_rate, replay=True)

    def replay_delete(self, name: str) -> None:
        self._delete(name, replay=True)

    # -- helpers -------------------------------------------------------------------
    @contextmanager
    def _journaled(self, replay: bool = False) -> Iterator[_JournalEntry]:
        """The journal for the block's records (waited for inside the block, under
        the group's lock). A replayed change is not logged again."""
        yield _JournalEntry(None if replay else self._journal)

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("the server is shutting down; retry on another server")

    def _check_live(self, g: Group) -> None:
        if g.deleted:
            raise NotFound(f"group {g.name!r} was deleted", metadata={"group": g.name})
        if self._closed:
            raise Unavailable("the server is shutting down; retry on another server")


def _sync_step_record(g: Group) -> dict[str, Any]:
    return {"op": "sync_step", "group": g.name, "contributors": sorted(g.pending)}


def _no_room_to_wait(limit: int, group: str) -> ResourceExhausted:
    return ResourceExhausted(
        f"the server has its limit of {limit} calls waiting for a version (of group "
        f"{group!r} and others); retry later, or pull without min_version"
    )


def _slot_bytes(a: Array) -> int:
    return -(-a.nbytes // 64) * 64  # 64-byte aligned


def _slots(base: Array, arrays: Sequence[Array]) -> Iterator[Array]:
    """Flat views of ``base`` shaped like each of ``arrays``, one after another."""
    offset = 0
    for a in arrays:
        yield base[offset : offset + a.nbytes].view(a.dtype)
        offset += _slot_bytes(a)


def _log_group(what: str, g: Group) -> None:
    log.info(
        "%s group %s: %s %s, %d tensors, %d elements, T=%d",
        what, g.name, g.attrs.op, g.dtype, len(g.names), g.element_count,
        g.update_count,
    )  # fmt: skip


def _check_base_version(g: Group, base_version: int | None) -> None:
    """A push's T must be one the worker pulled, and fresh enough for the group."""
    if base_version is None:
        return
    t = g.update_count
    if base_version > t:
        raise InvalidArgument(
            f"push computed against T={base_version}, but group {g.name!r} is "
            f"only at T={t}: base_version must be a T the worker pulled",
            reason="BASE_VERSION_AHEAD",
            field="base_version",
            metadata={"group": g.name, "update_count": t},
        )
    s = g.consistency.max_staleness
    if g.consistency.mode == "async" and s is not None and base_version < t - s:
        raise FailedPrecondition(
            f"stale push to {g.name!r}: computed against T={base_version}, the "
            f"group is at T={t} and max_staleness={s} accepts T >= {t - s}; "
            "pull and recompute",
            reason="STALE_PUSH",
            metadata={"group": g.name, "update_count": t, "max_staleness": s},
        )
    if g.consistency.mode == "sync" and base_version < t:
        raise FailedPrecondition(
            f"stale push to sync group {g.name!r}: computed against "
            f"T={base_version}, but that step was already taken (T={t}); pull "
            f"min_version={t} and recompute",
            reason="STALE_PUSH",
            metadata={"group": g.name, "update_count": t},
        )
