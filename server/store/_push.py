"""The push pipeline: check a push, deduplicate it, log it, step or buffer it.

A push is atomic: every gradient is validated before any state changes; then every
tensor steps and T advances (``async``), or the push is buffered for the next sync
step (``sync``, ``_quorum``). With ``max_staleness`` an async push computed against
a T older than ``T - max_staleness`` is refused.

Exactly-once: a push carries (client_id, seq); the last ``DEDUP_WINDOW`` results per
client are remembered and a repeated push is answered with its first result. A
client's window is kept ``dedup_seconds`` after its last push, for at most
``dedup_clients`` clients per group (the least recently pushing are dropped first).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..errors import JOURNAL_REFUSALS, FailedPrecondition, InvalidArgument
from ..kernels._finite import all_finite  # one pass, no temporary the size of a
from ._checks import MAX_UPDATE_COUNT, check_learning_rate
from ._flat import FlatArrays, per_tensor
from ._group import DEDUP_WINDOW, Group, PushOutcome, StoreLimits, is_row_push
from ._ids import empty_part
from ._journaling import JournalEntry
from ._order import PushKey, alone
from ._quorum import logged_step_due, maybe_sync_step, quorum_reached
from ._rewind import DROPPED, rewound_error
from ._shared import SharedCopies
from ._sparse import INDEX_DTYPE, flatten
from ._waits import Cancellation, Wait, Waiting

__all__ = [
    "Emission",
    "PushPipeline",
    "PushRequest",
    "PushTicket",
    "ValuesSink",
    "check_flat_gradient",
    "check_gradient_specs",
    "check_gradient_values",
]

Array = np.ndarray[Any, Any]
Spec = tuple[np.dtype[Any], tuple[int, ...]]


@dataclass(frozen=True)
class PushTicket:
    """A push header the store accepted: its gradients may now be read and pushed."""

    group: str
    names: tuple[str, ...]  # the group's tensor names, in gradient order
    _group: Group = field(repr=False, compare=False)

    @property
    def dtype(self) -> np.dtype[Any]:
        """The gradients' dtype (the group's)."""
        return self._group.dtype

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """The gradients' shapes (the group's tensors'), in order."""
        return self._group.shapes

    @property
    def offsets(self) -> list[int]:
        """Where each tensor starts in the group's flat buffers (``_flat``)."""
        return self._group.layout.offsets

    @property
    def flat_x(self) -> Array:
        """The group's X as one flat array: read only while the store hands X to
        a ``ValuesSink`` (under the group's lock)."""
        return self._group.flat_x


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


class Emission:
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
class PushRequest:
    """How a push is identified (exactly-once) and what it asks besides its grads."""

    client_id: str
    seq: int  # the client's push number, not a log position
    base_version: int | None
    learning_rate: float | None
    # its gradients are gone: answered from the exactly-once window, or refused
    answered_only: bool = False
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


def check_gradient_specs(
    g: Group, specs: Iterable[Spec], layout: bytes = b""
) -> PushTicket:
    """Check gradient count, dtypes and shapes before any bytes are read (the
    flat form's one gradient with ``layout``: ``_flatform``)."""
    if layout:
        return check_flat_gradient(g, layout, specs)
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
    for (d, s), want in zip(specs, g.shapes, strict=True):
        if d != g.dtype or s != want:
            break
    else:  # every gradient as the group's tensor
        ticket = g.push_ticket  # one per group: every push would make the same
        if ticket is None:
            ticket = g.push_ticket = PushTicket(g.name, g.names, g)
        return ticket  # type: ignore[no-any-return]
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


def check_flat_gradient(g: Group, layout: bytes, specs: Iterable[Spec]) -> PushTicket:
    """Check a flat push's one gradient header against the group (its digest,
    then one tensor of the group's dtype and element count) before any bytes are
    read: the push's ticket (docs/protocol.md, "The flat form")."""
    g.check_layout(layout)
    specs = list(specs)
    total = g.layout.total
    if len(specs) != 1:
        raise InvalidArgument(
            f"a flat push (layout set) carries ONE gradient of group {g.name!r}'s "
            f"{total} elements back to back; got {len(specs)} gradients",
            reason="GRADIENT_COUNT",
            field="gradients",
            metadata={"group": g.name, "expected": 1, "received": len(specs)},
        )
    dtype, dims = specs[0]
    if np.dtype(dtype) != g.dtype:
        raise InvalidArgument(
            f"the flat gradient of group {g.name!r} must be {g.dtype}, the group's "
            f"dtype; got {np.dtype(dtype)}",
            reason="DTYPE_MISMATCH",
            field="gradients[0].dtype",
            metadata={"group": g.name, "expected": g.dtype, "received": dtype},
        )
    if tuple(dims) != (total,):
        raise InvalidArgument(
            f"the flat gradient of group {g.name!r} must have dims [{total}] (its "
            f"{len(g.shapes)} tensors' elements back to back), got {list(dims)}",
            reason="SHAPE_MISMATCH",
            field="gradients[0].dims",
            metadata={"group": g.name, "expected": (total,), "received": dims},
        )
    ticket = g.push_ticket
    if ticket is None:
        ticket = g.push_ticket = PushTicket(g.name, g.names, g)
    return ticket  # type: ignore[no-any-return]


def check_gradient_values(
    ticket: PushTicket,
    grads: Sequence[Array],
    learning_rate: float | None,
    known_finite: bool = False,
) -> None:
    """The push's learning rate, and finite gradients unless the group allows not
    (or the caller has checked them already: ``known_finite``)."""
    if learning_rate is not None:
        check_learning_rate(
            learning_rate, ticket._group.dtype, "the push's learning_rate"
        )
    if ticket._group.allow_non_finite or known_finite:
        return
    if isinstance(grads, FlatArrays) and all_finite(grads.flat):
        return  # one pass over the push (``_flat``); else find the gradient at fault
    for i, a in enumerate(per_tensor(grads)):
        if not all_finite(a):
            raise InvalidArgument(
                f"gradient {i + 1} ({ticket.names[i]!r}) holds NaN or inf, which "
                f"would poison group {ticket.group!r} for good; fix the worker, or "
                "create the group with allow_non_finite=True",
                reason="NON_FINITE_GRADIENT",
                field=f"gradients[{i}]",
                metadata={"group": ticket.group},
            )


class PushPipeline:
    """Runs a checked push on its group: the steps after the gradients are read.

    ``check_live(g)`` raises when the group's calls must end; ``check_table_room``
    refuses a row push whose new rows would not fit (``_rows``).
    """

    def __init__(
        self,
        limits: StoreLimits,
        clock: Callable[[], float],
        waiting: Waiting,
        shared: SharedCopies,
        check_live: Callable[[Group], None],
        check_table_room: Callable[[Group, Sequence[Array]], None],
    ) -> None:
        self._limits = limits
        self._clock = clock
        self._waiting = waiting
        self._shared = shared
        self._check_live = check_live
        self._check_table_room = check_table_room

    def push(
        self,
        ticket: PushTicket,
        grads: Sequence[Array],
        request: PushRequest,
        journal: JournalEntry,
        *,
        return_values: bool,
        timeout: float | None,
        cancellation: Cancellation | None,
        sink: ValuesSink | None,
    ) -> PushOutcome:
        """A live push; one that may wait for its step holds a waiting slot."""
        g = ticket._group
        if not return_values:  # nothing to wait for, nothing to send
            return self.run(g, grads, request, journal)
        emit = Emission(sink) if sink is not None else None
        if g.consistency.mode != "sync":
            wait = Wait(timeout, cancellation)
            return self.run(g, grads, request, journal, True, wait, emit=emit)
        with self._waiting.slot(g.name, required=False) as held:
            wait = Wait(timeout, cancellation, counted=held)
            return self.run(g, grads, request, journal, True, wait, emit=emit)

    def run(
        self,
        g: Group,
        grads: Sequence[Array],
        request: PushRequest,
        journal: JournalEntry,
        return_values: bool = False,
        wait: Wait | None = None,
        *,
        replay: bool = False,
        emit: Emission | None = None,
    ) -> PushOutcome:
        if journal.logging or g.tables or g.consistency.mode != "async":
            # a WAL record, a sync round's buffer or a table's checks read the
            # gradients per tensor; an async step without a log reads one array
            grads = per_tensor(grads)
        if journal.logging and g.consistency.mode == "async" and not g.tables:
            return self._run_in_order(g, grads, request, journal, return_values, emit)
        with g.cond, alone(g.cond, g.order):
            self._check_live(g)
            journal.check_writable()
            cached = self._dedup_lookup(g, request.client_id, request.seq)
            if cached is None and request.answered_only:
                raise _not_answered(g, request)
            if cached is not None:
                journal.settle()  # (sync groups wait under the lock already)
                outcome = PushOutcome(cached[0], cached[1], duplicate=True)
            else:
                if return_values:
                    self._waiting.check_room(g, request.client_id, wait)
                due = logged_step_due if replay else quorum_reached
                outcome = self._step_or_buffer(g, grads, request, journal, due, emit)
            if return_values:
                if not outcome.applied:
                    self._waiting.wait_version(
                        g, outcome.update_count + 1, wait or Wait()
                    )
                return self._answer(g, outcome, return_values, emit)
            return outcome

    def _run_in_order(
        self,
        g: Group,
        grads: Sequence[Array],
        request: PushRequest,
        journal: JournalEntry,
        return_values: bool,
        emit: Emission | None,
    ) -> PushOutcome:
        """An async push with a log (``_order``): its record is appended in a slot
        under the lock, made durable without it (so the group's next pushes share
        the fsync), and applied in its slot's turn."""
        key = (request.client_id, request.seq) if request.client_id else None
        with g.cond:
            self._admit(g, key)
            journal.check_writable()
            cached = self._dedup_lookup(g, request.client_id, request.seq)
            if cached is None and request.answered_only:
                raise _not_answered(g, request)
            if cached is None:
                t = g.update_count + g.order.in_flight  # the T it steps at, in turn
                self._check_step(g, request, t)
                slot = g.order.take(key)
                try:
                    lsn = journal.log(request.record(g.name, t), grads)
                except BaseException:
                    g.order.give_back(slot, key)
                    raise
        if cached is not None:
            # Answered once acknowledged (it may have been applied here without
            # an acknowledgement: its caller left), waiting outside the lock
            journal.settle()
            with g.cond:
                duplicate = PushOutcome(cached[0], cached[1], duplicate=True)
                return self._answer(g, duplicate, return_values, emit)
        failure: BaseException | None = None
        try:
            journal.wait(lsn)
        except BaseException as exc:  # refused in its turn: later slots wait for it
            failure = exc
        with g.cond:
            try:
                while g.order.done != slot:
                    g.cond.wait()
                if failure is not None:
                    raise failure
                outcome = self._step_async(g, grads, request, emit)
                return self._answer(g, outcome, return_values, emit)
            finally:
                g.order.finish(slot, key)
                g.cond.notify_all()

    def _admit(self, g: Group, key: PushKey | None) -> None:
        """Under the lock: wait until the push may take a slot (``_order``)."""
        while True:
            self._check_live(g)
            if g.order.admits(key):
                return
            g.order.admitting += 1
            try:
                g.cond.wait()
            finally:
                g.order.admitting -= 1

    def _answer(
        self,
        g: Group,
        outcome: PushOutcome,
        return_values: bool,
        emit: Emission | None,
    ) -> PushOutcome:
        """Under the lock: the outcome, with X now when the push asked for it."""
        if not return_values:
            return outcome
        if emit is not None:
            if not emit.begun:
                emit.all_of(outcome, g.xs)
            return outcome
        return dataclasses.replace(outcome, values=self._shared.values(g, False))

    def _step_or_buffer(
        self,
        g: Group,
        grads: Sequence[Array],
        request: PushRequest,
        journal: JournalEntry,
        due: Callable[[Group], bool],
        emit: Emission | None = None,
    ) -> PushOutcome:
        if g.tables and due is not logged_step_due:  # replay: it fitted when logged
            self._check_table_room(g, grads)
        self._check_step(g, request, g.update_count)
        if g.consistency.mode == "async":
            if journal.logging:  # Unavailable: refused, nothing changed
                journal.durable(request.record(g.name, g.update_count), grads)
            return self._step_async(g, grads, request, emit)
        record = request.record(g.name, g.update_count)
        outcome = self._buffer(g, grads, request.client_id, record, journal, due)
        if request.client_id:
            g.remember(
                request.client_id, request.seq, outcome, self._clock(), self._limits
            )
        g.cond.notify_all()
        return outcome

    @staticmethod
    def _check_step(g: Group, request: PushRequest, t: int) -> None:
        """The push may step at T=``t``: its base version, and T's limit."""
        if request.base_version is not None:
            _check_base_version(g, request.base_version, t)
        if t >= MAX_UPDATE_COUNT:
            raise FailedPrecondition(
                f"group {g.name!r} is at T={t}, the most steps a group "
                f"takes (2**62 = {MAX_UPDATE_COUNT}); export it and create it again "
                "with a smaller update_count"
            )

    def _step_async(
        self,
        g: Group,
        grads: Sequence[Array],
        request: PushRequest,
        emit: Emission | None,
    ) -> PushOutcome:
        """Under the lock, once the push's record is durable: step, remember it."""
        if emit is None:
            g.step(grads, request.learning_rate)
        else:
            emit.begin(PushOutcome(g.update_count + 1, True), g.xs)
            g.step(grads, request.learning_rate, emit.sink.block)
        outcome = PushOutcome(g.update_count, True)
        if request.client_id:
            g.remember(
                request.client_id, request.seq, outcome, self._clock(), self._limits
            )
        g.cond.notify_all()
        return outcome

    def _buffer(
        self,
        g: Group,
        grads: Sequence[Array],
        client_id: str,
        record: dict[str, Any],
        journal: JournalEntry,
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
        except JOURNAL_REFUSALS:
            del g.pending[key]
            raise
        try:
            if maybe_sync_step(g, journal, due):
                return PushOutcome(g.update_count, True)
        except JOURNAL_REFUSALS:
            pass  # buffered and durable; the reaper takes the step once it is logged
        return PushOutcome(t, False)

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
            if hit[1] == DROPPED:
                raise rewound_error(
                    g, f"push seq {seq} from client {client_id!r} was resent"
                )
            return hit[0], bool(hit[1])
        if seq <= w.floor:
            raise FailedPrecondition(
                f"push seq {seq} from client {client_id!r} is older than the "
                f"{DEDUP_WINDOW} pushes remembered for it; it cannot be deduplicated",
                reason="SEQ_TOO_OLD",
                metadata={"group": g.name, "client_id": client_id, "seq": seq},
            )
        return None


def _check_base_version(g: Group, base_version: int | None, t: int) -> None:
    """A push's T must be one the worker pulled, and fresh enough for the group
    when it steps at T=``t`` (beyond ``g.update_count`` with pushes in flight)."""
    if base_version is None:
        return
    if g.rewinds and g.update_count < base_version <= g.rewound_from:
        raise rewound_error(g, f"push computed against T={base_version}")
    if base_version > g.update_count:
        raise InvalidArgument(
            f"push computed against T={base_version}, but group {g.name!r} is "
            f"only at T={g.update_count}: base_version must be a T the worker pulled",
            reason="BASE_VERSION_AHEAD",
            field="base_version",
            metadata={"group": g.name, "update_count": g.update_count},
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


def _not_answered(g: Group, request: PushRequest) -> InvalidArgument:
    """A resend whose gradients are gone that the exactly-once window no longer
    holds: nothing is applied."""
    return InvalidArgument(
        f"push seq {request.seq} of client {request.client_id!r} to group "
        f"{g.name!r} names a shared-memory segment that already holds X of an "
        "earlier answer to it (its gradients were spent), and this server no "
        "longer remembers that answer (its exactly-once window dropped it, or the "
        "server restarted): nothing was applied; pull the group to see where it "
        "stands, and push again with a new seq",
        reason="STALE_SEGMENT",
        field="gradients_region.generation",
        metadata={"group": g.name},
    )
