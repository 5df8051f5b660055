"""A group's state and the records the store hands out (no locking policy, no grpc).

``Group`` holds one ONNX node's tensors, accumulators, update count, consistency
settings, worker leases, pending sync contributions and exactly-once window; the
``ParameterStore`` (``store.py``) decides when to step it, under ``Group.cond``, and
is the only holder of a ``Group``. Callers get the frozen records defined here.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from onnxps.wire.image import (
    ConsistencyDefinition,
    GroupDefinition,
    GroupImage,
    TableDefinition,
)

from ..errors import InvalidArgument
from ..kernels import OptimizerAttrs, Stepper
from ._flat import FlatArrays, FlatLayout, flat_views
from ._ids import IdsTable
from ._order import PushOrder
from ._sparse import (
    INDEX_DTYPE,
    RowGradient,
    combine_rows,
    split_row_push,
    step_rows,
)

__all__ = [
    "DEDUP_CLIENTS",
    "DEDUP_SECONDS",
    "DEDUP_WINDOW",
    "MAX_NAME_LENGTH",
    "ClientWindow",
    "Consistency",
    "Group",
    "GroupCapture",
    "GroupRuntime",
    "GroupView",
    "Journal",
    "LeaseView",
    "PullResult",
    "PushOutcome",
    "StoreLimits",
    "WorkerLease",
    "check_name",
    "combine_contributions",
    "is_row_push",
]

log = logging.getLogger("onnxps.store")

Array = np.ndarray[Any, Any]

DEDUP_WINDOW = 4096  # results kept per client
DEDUP_SECONDS = 600.0  # a client's window is kept this long after its last push
DEDUP_CLIENTS = 10_000  # windows per group at most: the least recently used go first
MAX_NAME_LENGTH = 256


@dataclass(frozen=True)
class Consistency(ConsistencyDefinition):
    """The saved consistency settings, checked: a group is created only with these."""

    def __post_init__(self) -> None:
        if self.mode not in ("async", "sync"):
            raise InvalidArgument(
                f"consistency mode must be 'async' or 'sync', got {self.mode!r}"
            )
        if self.reduction not in ("mean", "sum"):
            raise InvalidArgument(
                f"sync reduction must be 'mean' or 'sum', got {self.reduction!r}"
            )
        if self.mode == "sync" and self.sync_workers < 1:
            raise InvalidArgument(
                f"sync mode needs sync_workers >= 1, got {self.sync_workers}"
            )
        if self.mode == "sync" and self.max_staleness is not None:
            raise InvalidArgument(
                "max_staleness applies to async groups; sync groups take only "
                "pushes computed against the current T"
            )
        if self.max_staleness is not None and self.max_staleness < 0:
            raise InvalidArgument(
                f"max_staleness must be >= 0, got {self.max_staleness}"
            )


@dataclass(frozen=True)
class StoreLimits:
    max_group_bytes: int = 0  # 0: no limit
    max_total_bytes: int = 0
    max_groups: int = 0
    default_lease_seconds: float = 10.0
    max_waiting_calls: int = 0  # calls waiting for a version at once; 0: no limit
    dedup_seconds: float = DEDUP_SECONDS
    dedup_clients: int = DEDUP_CLIENTS


@dataclass(frozen=True)
class PushOutcome:
    update_count: int  # T after the push (sync: T when it was buffered)
    applied: bool  # False: buffered until the sync quorum has pushed
    duplicate: bool = False  # a resend answered with its first result
    values: tuple[Array, ...] | None = None  # X_1..X_n, when asked for


@dataclass(frozen=True)
class WorkerLease:
    worker_id: str
    lease_remaining_seconds: float


@dataclass(frozen=True)
class TableView:
    """An ids table's facts (``_ids``)."""

    definition: TableDefinition
    row_count: int

    @property
    def name(self) -> str:
        return self.definition.name


@dataclass(frozen=True)
class GroupView:
    """A consistent copy of a group's facts, read under its lock."""

    name: str
    incarnation: int  # differs between a group and one created later with its name
    attrs: OptimizerAttrs
    learning_rate: float
    update_count: int  # T
    dtype: np.dtype[Any]
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    consistency: Consistency
    allow_non_finite: bool
    lease_seconds: float
    element_count: int
    state_bytes: int
    workers: tuple[WorkerLease, ...]  # live leases, by worker id
    dead_workers: tuple[str, ...]  # leases that ran out or were given up, sorted
    pending: int  # buffered sync contributions
    quorum: int  # pushes the pending sync step needs (0 for async groups)
    tables: tuple[TableView, ...] = ()  # ids tables, in order

    @property
    def op(self) -> str:
        return self.attrs.op


@dataclass(frozen=True)
class LeaseView:
    lease_seconds: float
    update_count: int
    live_workers: int
    quorum: int  # 0 for async groups


@dataclass(frozen=True)
class PullResult:
    update_count: int
    learning_rate: float
    arrays: tuple[Array, ...]  # X..., then V..., H... when pulled with state
    names: tuple[str, ...]  # one per array: "w", then "V:w", "H:w"


@dataclass(frozen=True)
class GroupRuntime:
    """What a snapshot keeps beside a group's image: the state of a running job."""

    covered_lsn: int = 0  # every log record of the group up to this one is in it
    workers: tuple[str, ...] = ()  # leased when captured (a fresh lease on restore)
    dead: tuple[str, ...] = ()  # out of the sync quorum
    pending: Mapping[str, Sequence[Array]] = field(default_factory=dict)
    # client id -> (floor, [(push seq, T, applied), ...] oldest first)
    dedup: Mapping[str, tuple[int, Sequence[tuple[int, int, int]]]] = field(
        default_factory=dict
    )
    created_by: str = ""  # the request id of the group's create ("": none)
    # the last rewind (``_rewind``): the T it went back to, the highest T one went
    # back from (0, 0: none), so that stale pushes stay refused after a restart
    rewound: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class GroupCapture:
    image: GroupImage
    runtime: GroupRuntime


class Journal(Protocol):
    """Durability hook: records every state change in order (see ``durability``)."""

    def log(self, record: dict[str, Any], arrays: Sequence[Array]) -> int:
        """Append under the group's lock; returns the record's lsn for ``wait``.

        Every record logged must be waited for."""
        ...

    def wait(self, lsn: int) -> None:
        """Block until the record with this lsn is durable; raise ``Unavailable``
        when it could not be written (the caller then applies nothing)."""
        ...

    def check_writable(self) -> None:
        """Raise when this server may not accept a change now (a replicated
        shard's standby refuses ``NOT_PRIMARY``); asked before a resend is answered
        from a group's exactly-once window."""
        ...


class ClientWindow:
    """One client's remembered pushes in one group (exactly-once)."""

    __slots__ = ("floor", "last_push", "results")

    def __init__(self, floor: int = -1, last_push: float = 0.0) -> None:
        # push seq -> (T, applied), oldest first (``_rewind.DROPPED``: dropped)
        self.results: dict[int, tuple[int, int]] = {}
        self.floor = floor  # every push seq <= floor has been forgotten
        self.last_push = last_push  # monotonic time of the client's last push


def combine_contributions(
    contributions: Mapping[str, Sequence[Array]], reduction: str, dtype: np.dtype[Any]
) -> list[Array]:
    """Sum the gradients in client-id order, then divide by their count for mean.

    A fixed order makes the combined gradient independent of arrival order, so a sync
    step is reproducible bit for bit.
    """
    if any(is_row_push(c) for c in contributions.values()):
        return combine_rows(contributions, reduction, dtype)
    keys = sorted(contributions)
    acc = [np.array(g, dtype=dtype, copy=True) for g in contributions[keys[0]]]
    for key in keys[1:]:
        for a, g in zip(acc, contributions[key], strict=True):
            np.add(a, g, out=a)
    if reduction == "mean" and len(keys) > 1:
        count = dtype.type(len(keys))
        for a in acc:
            np.divide(a, count, out=a)
    return acc


def is_row_push(arrays: Sequence[Array]) -> bool:
    """Whether a store-level gradient list is a row push (it holds indices, see
    ``_sparse``); beside ``Group.step``, which asks on every push."""
    for a in arrays:  # a loop, not any(generator): every dense push asks
        if a.dtype == INDEX_DTYPE:
            return True
    return False


class Group:
    """One optimizer node's state. Every field is guarded by ``cond``.

    Only ``ParameterStore`` holds a ``Group``; everyone else gets the records above.
    """

    def __init__(
        self,
        name: str,
        attrs: OptimizerAttrs,
        learning_rate: float,
        tensors: Sequence[tuple[str, Array]],
        *,
        consistency: Consistency,
        allow_non_finite: bool,
        lease_seconds: float,
        incarnation: int,
        state: Sequence[Array] | None = None,
        update_count: int = 0,
        adopt: bool = False,
        tables: Sequence[TableDefinition] = (),
        table_arrays: Sequence[Sequence[Array]] = (),
        dtype: np.dtype[Any] | None = None,
    ) -> None:
        self.name = name
        self.incarnation = incarnation
        self.attrs = attrs
        self.learning_rate = float(learning_rate)
        self.update_count = int(update_count)
        given = tensors[0][1].dtype if tensors else dtype
        self.dtype = np.dtype(given).newbyteorder("=")
        self.names = tuple(n for n, _ in tensors)
        self.shapes = tuple(tuple(int(d) for d in a.shape) for _, a in tensors)

        # X, V and H each in one flat buffer, self.xs and self.states[...] views
        # of it, tensor by tensor (``_flat``)
        self.layout = FlatLayout([math.prod(s) for s in self.shapes])
        n = len(self.shapes)
        self.flat_x = self._own([a for _, a in tensors], adopt)
        self.xs = flat_views(self.flat_x, [(k,) for k in self._sizes()])
        self.flat_states: dict[str, Array] = {}
        self.states: dict[str, list[Array]] = {}
        for k, sname in enumerate(attrs.state_names):
            if state is not None:
                flat = self._own(state[k * n : (k + 1) * n], adopt)
            else:
                # np.zeros: calloc'd pages cost no memory until a step writes them
                flat = np.zeros(self.layout.total, self.dtype)
            self.flat_states[sname] = flat
            self.states[sname] = flat_views(flat, [(k,) for k in self._sizes()])
        self.stepper = Stepper(attrs, self.dtype, [self.layout.total])
        # gradients that are not one flat buffer step tensor by tensor (made on use)
        self._tensor_stepper: Stepper | None = None
        # ids tables (``_ids``), after the tensors in a row push's parts
        self.tables: dict[str, IdsTable] = {}
        for k, t in enumerate(tables):
            table = self.tables[t.name] = IdsTable(t, self.dtype, attrs.state_names)
            if k < len(table_arrays):
                ids, *rows = table_arrays[k]
                table.load(ids, rows)
        self.row_steppers: dict[int, Stepper] = {}  # row pushes, by size (_sparse)
        self.consistency = consistency
        self.allow_non_finite = allow_non_finite
        self.lease_seconds = lease_seconds
        self.cond = threading.Condition(threading.Lock())
        self.order = PushOrder()  # pushes logged and not yet applied (``_order``)
        # client id -> window, least recently pushed first
        self.dedup: OrderedDict[str, ClientWindow] = OrderedDict()
        self.workers: dict[str, float] = {}  # worker id -> lease expiry (monotonic)
        self.dead: set[str] = set()
        self.pending: dict[str, list[Array]] = {}
        self.replay_step: int | None = None  # contributors of a logged sync step
        self.deleted = False
        # The request id of the create that made the group ("": none given): a
        # resend of that create is answered with the group (exactly once)
        self.created_by = ""
        # the PushTicket every well-formed push gets (``_push``), made on first use
        self.push_ticket: Any = None
        # rewinds (``_rewind``): how many, the T the last one went back to, and the
        # highest T one went back from (a push computed above it is refused)
        self.rewinds = 0
        self.rewound_to = 0
        self.rewound_from = 0

    def _sizes(self) -> list[int]:
        o = self.layout.offsets
        return [o[i + 1] - o[i] for i in range(len(o) - 1)]

    def _own(self, arrays: Sequence[Array], adopt: bool) -> Array:
        """One flat buffer holding ``arrays`` back to back.

        adopt: a restore hands over arrays it owns; a lone one is taken without a
        copy (a log record's arrays are read-only views of its frame: copied)."""
        if adopt and len(arrays) == 1 and arrays[0].flags.writeable:
            return np.ascontiguousarray(arrays[0], dtype=self.dtype).reshape(-1)
        flat = np.empty(self.layout.total, self.dtype)
        for view, a in zip(flat_views(flat, self.shapes), arrays, strict=True):
            np.copyto(view, np.asarray(a).reshape(view.shape), casting="unsafe")
        return flat

    @classmethod
    def from_image(
        cls, image: GroupImage, attrs: OptimizerAttrs, incarnation: int
    ) -> Group:
        """The one rebuild path from a saved form; adopts the image's arrays."""
        d = image.definition
        n = len(d.names)
        arrays = list(image.arrays[: d.dense_array_count])
        return cls(
            d.name,
            attrs,
            d.learning_rate,
            list(zip(d.names, arrays[:n], strict=True)),
            tables=d.tables,
            table_arrays=image.table_arrays(),
            dtype=d.dtype,
            consistency=Consistency(**dataclasses.asdict(d.consistency)),
            allow_non_finite=d.allow_non_finite,
            lease_seconds=d.lease_seconds,
            incarnation=incarnation,
            state=arrays[n:],
            update_count=d.update_count,
            adopt=True,
        )

    # -- read-only facts -----------------------------------------------------------
    @property
    def element_count(self) -> int:
        return self.layout.total

    @property
    def state_bytes(self) -> int:
        per = self.element_count * self.dtype.itemsize
        tables = sum(t.state_bytes for t in self.tables.values())
        return per * (1 + len(self.states)) + tables

    def state_arrays(self) -> list[Array]:
        """V..., H... in ONNX order (flat)."""
        return [a for sname in self.attrs.state_names for a in self.states[sname]]

    def quorum(self) -> int:
        """Pushes the pending sync step needs.

        ``sync_workers`` less the workers that are missing: a dead worker counts as
        missing only while fewer than ``sync_workers`` workers are present, so a
        worker that restarted under a new id, or an extra id that joined and left,
        does not shrink the quorum below the live workers. A worker that pushed for
        this step and then died is present: its gradient is in the step, so
        dropping it too would let the step go before a live worker has pushed (and
        then refuse that worker's push as late).
        """
        n = self.consistency.sync_workers
        if not self.dead:
            return max(1, n)
        pushed_then_died = sum(1 for w in self.dead if w in self.pending)
        present = len(self.workers) + pushed_then_died
        missing = min(len(self.dead) - pushed_then_died, max(0, n - present))
        return max(1, n - missing)

    # -- records for callers (under the lock) ----------------------------------------
    def view(self, now: float) -> GroupView:
        sync = self.consistency.mode == "sync"
        return GroupView(
            name=self.name,
            incarnation=self.incarnation,
            attrs=self.attrs,
            learning_rate=self.learning_rate,
            update_count=self.update_count,
            dtype=self.dtype,
            names=self.names,
            shapes=self.shapes,
            consistency=self.consistency,
            allow_non_finite=self.allow_non_finite,
            lease_seconds=self.lease_seconds,
            element_count=self.element_count,
            state_bytes=self.state_bytes,
            workers=tuple(
                WorkerLease(w, until - now) for w, until in sorted(self.workers.items())
            ),
            dead_workers=tuple(sorted(self.dead)),
            pending=len(self.pending),
            quorum=self.quorum() if sync else 0,
            tables=tuple(
                TableView(t.definition, t.count) for t in self.tables.values()
            ),
        )

    def lease_view(self) -> LeaseView:
        sync = self.consistency.mode == "sync"
        return LeaseView(
            lease_seconds=self.lease_seconds,
            update_count=self.update_count,
            live_workers=len(self.workers),
            quorum=self.quorum() if sync else 0,
        )

    def array_names(self, with_state: bool) -> tuple[str, ...]:
        states = self.attrs.state_names if with_state else ()
        return self.names + tuple(f"{s}:{n}" for s in states for n in self.names)

    def definition(self) -> GroupDefinition:
        c = self.consistency
        return GroupDefinition(
            name=self.name,
            optimizer=self.attrs.op,
            attributes=dataclasses.asdict(self.attrs),
            learning_rate=self.learning_rate,
            update_count=self.update_count,
            dtype=self.dtype,
            names=self.names,
            shapes=self.shapes,
            consistency=ConsistencyDefinition(**dataclasses.asdict(c)),
            allow_non_finite=self.allow_non_finite,
            lease_seconds=self.lease_seconds,
            tables=tuple(t.definition for t in self.tables.values()),
        )

    def image(self, scratch: Callable[[int], Array] | None = None) -> GroupImage:
        """X, V and H copied; ``scratch(n)`` may lend a reusable buffer of n bytes."""
        arrays = self.copy_into(scratch) if scratch else self.copy_values(True)
        for t in self.tables.values():
            arrays += t.arrays()
        return GroupImage(self.definition(), arrays)

    def runtime(self, covered_lsn: int) -> GroupRuntime:
        return GroupRuntime(
            covered_lsn=covered_lsn,
            workers=tuple(sorted(self.workers)),
            dead=tuple(sorted(self.dead)),
            pending={k: [a.copy() for a in v] for k, v in self.pending.items()},
            dedup={
                cid: (w.floor, [(s, t, a) for s, (t, a) in w.results.items()])
                for cid, w in self.dedup.items()
            },
            created_by=self.created_by,
            rewound=(self.rewound_to, self.rewound_from),
        )

    def restore_runtime(self, runtime: GroupRuntime, now: float) -> None:
        self.workers = dict.fromkeys(runtime.workers, now + self.lease_seconds)
        self.dead = set(runtime.dead)
        self.pending = {k: list(v) for k, v in runtime.pending.items()}
        self.created_by = runtime.created_by
        self.rewound_to, self.rewound_from = runtime.rewound
        self.rewinds = 1 if self.rewound_from else 0
        for cid, (floor, rows) in runtime.dedup.items():
            # restored windows count their age from the restart
            w = self.dedup[cid] = ClientWindow(int(floor), now)
            for s, t, a in rows:
                # a: 0 buffered, 1 applied, 2 dropped by a rewind (``_rewind``)
                w.results[int(s)] = (int(t), int(a) if int(a) > 1 else bool(a))

    # -- changes (under the lock) -----------------------------------------------------
    def step(
        self,
        grads: Sequence[Array],
        learning_rate: float | None,
        done: Callable[[int, int, int], None] | None = None,
    ) -> None:
        """One step; ``done(i, start, stop)`` is called as each block of X_i's flat
        elements is final, in order (a dense push only)."""
        r = self.learning_rate if learning_rate is None else learning_rate
        # one flat buffer of the group's dtype (``_flat``) is never a row push
        if not isinstance(grads, FlatArrays) and is_row_push(grads):
            parts = split_row_push(grads)
            n = len(self.xs)
            if n:
                step_rows(
                    self.attrs, r, self.update_count, self.xs, self.shapes,
                    self.states, parts[:n], self.row_steppers,
                )  # fmt: skip
            for table, part in zip(self.tables.values(), parts[n:], strict=True):
                assert isinstance(part, RowGradient)
                table.step(self.attrs, r, self.update_count, part, self.row_steppers)
            self.update_count += 1
            return
        if not self.xs:  # a group of ids tables only: a dense push steps nothing
            self.update_count += 1
            return
        if isinstance(grads, FlatArrays) or len(grads) == 1:
            flat = grads.flat if isinstance(grads, FlatArrays) else grads[0]
            stepper = self.stepper
            xs, gs = [self.flat_x], [flat.reshape(-1)]
            v, h = self.flat_states.get("V"), self.flat_states.get("H")
            vs = None if v is None else [v]
            hs = None if h is None else [h]
            args = (r, self.update_count, xs, gs, vs, hs)
            if done is not None:
                done = self.layout.per_tensor(done)
        else:  # e.g. read in place from a client's shared memory
            stepper = self._tensor_stepper or self._new_tensor_stepper()
            gs = [g.reshape(-1) for g in grads]
            vl, hl = self.states.get("V"), self.states.get("H")
            args = (r, self.update_count, self.xs, gs, vl, hl)
        if done is None:
            stepper.step(*args)
        else:
            stepper.step_in_order(*args, done)
        self.update_count += 1

    def _new_tensor_stepper(self) -> Stepper:
        self._tensor_stepper = Stepper(self.attrs, self.dtype, self._sizes())
        return self._tensor_stepper

    def remember(
        self,
        client_id: str,
        seq: int,
        outcome: PushOutcome,
        now: float,
        limits: StoreLimits,
    ) -> None:
        """Keep a push's result for its client's resends (the client becomes the
        most recently used), then drop the windows ``limits`` no longer keep
        (``forget_clients``): one call of the push pipeline, under the lock."""
        result = (outcome.update_count, outcome.applied)
        w = self.dedup.get(client_id)
        if w is None:
            w = self.dedup[client_id] = ClientWindow()
        else:
            self.dedup.move_to_end(client_id)
        w.last_push = now
        w.results[seq] = result
        while len(w.results) > DEDUP_WINDOW:
            old = next(iter(w.results))
            del w.results[old]
            w.floor = max(w.floor, old)
        self.forget_clients(now, limits.dedup_seconds, limits.dedup_clients)

    def forget_clients(self, now: float, max_seconds: float, max_clients: int) -> int:
        """Drop windows idle longer than max_seconds, and the least recently used
        beyond max_clients; returns how many were dropped."""
        dropped = 0
        while self.dedup:
            cid, w = next(iter(self.dedup.items()))
            if len(self.dedup) <= max_clients and now - w.last_push <= max_seconds:
                break
            del self.dedup[cid]
            dropped += 1
        return dropped

    def expire_leases(self, now: float) -> bool:
        """Drop workers whose lease ran out; True when the quorum shrank."""
        expired = [w for w, until in self.workers.items() if until <= now]
        for w in expired:
            del self.workers[w]
            self.dead.add(w)
            log.warning(
                "group %s: worker %s lease expired; it leaves the quorum", self.name, w
            )
        return bool(expired)

    def copy_values(self, with_state: bool) -> list[Array]:
        arrays = self.xs + (self.state_arrays() if with_state else [])
        n = len(self.shapes)
        return [a.reshape(self.shapes[i % n]).copy() for i, a in enumerate(arrays)]

    def copy_into(self, scratch: Callable[[int], Array]) -> list[Array]:
        arrays = self.xs + self.state_arrays()
        sizes = [-(-a.nbytes // 64) * 64 for a in arrays]  # 64-byte aligned slots
        buf = scratch(sum(sizes))
        out, offset, n = [], 0, len(self.shapes)
        for i, (a, size) in enumerate(zip(arrays, sizes, strict=True)):
            view = buf[offset : offset + a.nbytes].view(a.dtype)
            np.copyto(view, a)
            out.append(view.reshape(self.shapes[i % n]))
            offset += size
        return out


def check_name(name: str, what: str = "group name") -> None:
    if not name:
        raise InvalidArgument(f"{what} must be a non-empty string")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidArgument(
            f"{what} must be at most {MAX_NAME_LENGTH} characters, got {len(name)}"
        )
    if not name.isprintable():
        raise InvalidArgument(f"{what} must be printable, got {name!r}")
