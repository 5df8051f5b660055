"""The parameter store: optimizer groups and their state, with no knowledge of gRPC.

A group is one ONNX training node: operator and attributes, learning rate R, update
count T, and ordered tensors X_1..X_n with their V/H, all of one dtype. Each group has
its own lock (a condition variable, so pulls can wait for a version), so different
groups step concurrently. A push is atomic: every gradient is validated before any
state changes; then every tensor steps and T advances.

Consistency is chosen per group:

- ``async``: each push steps at once; with ``max_staleness`` a push computed against a
  T older than ``T - max_staleness`` is refused.
- ``sync``: pushes computed against the current T are buffered; when the quorum has
  pushed, they are combined in client-id order (sum, then divided by their count for
  ``mean``) and one step is applied. The quorum is ``sync_workers`` less the workers
  whose lease ran out, so a dead worker never hangs a step.

Exactly-once: a push carries (client_id, seq); the last ``DEDUP_WINDOW`` results per
client are remembered and a repeated push is answered with its first result.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ._group import (
    DEDUP_WINDOW,
    ClientWindow,
    Consistency,
    DeadlineExceeded,
    Group,
    Journal,
    PushOutcome,
    StoreLimits,
    all_finite,
    check_name,
    combine_contributions,
    copy_into,
    group_definition,
)
from .errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from .kernels import STATE_DTYPES, OptimizerAttrs, make_attrs

__all__ = [
    "DEDUP_WINDOW",
    "Consistency",
    "DeadlineExceeded",
    "Group",
    "Journal",
    "ParameterStore",
    "PushOutcome",
    "StoreLimits",
    "combine_contributions",
    "group_definition",
]

log = logging.getLogger("onnxps.store")

Array = np.ndarray[Any, Any]


class ParameterStore:
    """All groups of one server."""

    def __init__(
        self,
        limits: StoreLimits | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits or StoreLimits()
        self._groups: dict[str, Group] = {}
        self._lock = threading.Lock()
        self._clock = clock
        self.journal: Journal | None = None
        self.replaying = False
        self._closed = False
        self._draining = False
        self._reaper: threading.Thread | None = None
        self._stop = threading.Event()

    # -- lifecycle -----------------------------------------------------------------
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
        for g in self.groups():
            with g.cond:
                g.cond.notify_all()

    def close(self) -> None:
        self._closed = True
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
        for g in self.groups():
            with g.cond:
                g.cond.notify_all()

    def _reap_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            for g in self.groups():
                self._reap(g)

    def _reap(self, g: Group) -> None:
        with g.cond:
            if g.deleted or not g.workers:
                return
            if g.expire_leases(self._clock()):
                self._maybe_sync_step(g)
                g.cond.notify_all()

    # -- groups --------------------------------------------------------------------
    def groups(self, prefix: str = "") -> list[Group]:
        with self._lock:
            return [g for n, g in sorted(self._groups.items()) if n.startswith(prefix)]

    def get(self, name: str) -> Group:
        with self._lock:
            g = self._groups.get(name)
        if g is None:
            raise NotFound(
                f"no group named {name!r}; create it first", metadata={"group": name}
            )
        return g

    def total_state_bytes(self) -> int:
        return sum(g.state_bytes for g in self.groups())

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
    ) -> Group:
        self._check_open()
        check_name(name)
        if not tensors:
            raise InvalidArgument(f"group {name!r} needs at least one tensor")
        if not math.isfinite(learning_rate):
            raise InvalidArgument(
                f"learning_rate must be finite, got {learning_rate}",
                field="learning_rate",
            )
        if update_count < 0:
            raise InvalidArgument(f"update_count must be >= 0, got {update_count}")
        seen: set[str] = set()
        dtype = np.dtype(tensors[0][1].dtype)
        if dtype not in STATE_DTYPES:
            raise InvalidArgument(
                f"group tensors must be float32 or float64, got {dtype} for "
                f"{tensors[0][0]!r}"
            )
        for tname, arr in tensors:
            check_name(tname, "tensor name")
            if tname in seen:
                raise InvalidArgument(f"tensor name {tname!r} appears twice")
            seen.add(tname)
            if arr.dtype != dtype:
                raise InvalidArgument(
                    f"a group has one dtype: {tensors[0][0]!r} is {dtype}, "
                    f"{tname!r} is {arr.dtype}"
                )
            if not allow_non_finite and not all_finite(arr):
                raise InvalidArgument(
                    f"initial value of {tname!r} holds NaN or inf; pass "
                    "allow_non_finite=True to keep it"
                )
        n = len(tensors)
        if state is not None and len(state) not in (0, n * len(attrs.state_names)):
            raise InvalidArgument(
                f"{attrs.op} state is {', '.join(attrs.state_names)} for each of the "
                f"{n} tensors: {n * len(attrs.state_names)} arrays, got {len(state)}"
            )
        if state:
            for j, arr in enumerate(state):
                tname, x = tensors[j % n]
                sname = attrs.state_names[j // n]
                if arr.dtype != dtype or arr.shape != x.shape:
                    raise InvalidArgument(
                        f"state {sname} of {tname!r} must be {dtype} {x.shape}, got "
                        f"{arr.dtype} {arr.shape}"
                    )
        group_bytes = sum(a.nbytes for _, a in tensors) * (1 + len(attrs.state_names))
        self.check_group_size(group_bytes)
        lease = lease_seconds or self.limits.default_lease_seconds
        group = Group(
            name,
            attrs,
            learning_rate,
            tensors,
            consistency=consistency or Consistency(),
            allow_non_finite=allow_non_finite,
            lease_seconds=lease,
            state=state or None,
            update_count=update_count,
        )
        with self._lock:
            if name in self._groups:
                raise AlreadyExists(
                    f"group {name!r} exists already; delete it first or pick another "
                    "name",
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
            self._groups[name] = group
            ticket = None
            if self.journal is not None and not self.replaying:
                ticket = self._log_create(group)
        if ticket is not None and self.journal is not None:
            self.journal.wait(ticket)
        log.info(
            "created group %s: %s %s, %d tensors, %d elements, T=%d",
            name,
            attrs.op,
            group.dtype,
            n,
            group.element_count,
            group.update_count,
        )
        return group

    def check_group_size(self, group_bytes: int) -> None:
        limit = self.limits.max_group_bytes
        if limit and group_bytes > limit:
            raise ResourceExhausted(
                f"a group of {group_bytes} bytes (X with its V/H) is over the "
                f"server's limit of {limit} bytes per group"
            )

    def _log_create(self, group: Group) -> int:
        # The full definition and initial tensors, so replay can recreate the group.
        assert self.journal is not None
        record = {"op": "create", **group_definition(group)}
        with group.cond:
            return self.journal.log(record, group.copy_values(True))

    def delete_group(self, name: str) -> bool:
        self._check_open()
        with self._lock:
            g = self._groups.pop(name, None)
        if g is None:
            raise NotFound(f"no group named {name!r}", metadata={"group": name})
        with g.cond:
            g.deleted = True
            ticket = None
            if self.journal is not None and not self.replaying:
                ticket = self.journal.log({"op": "delete", "group": name}, [])
            g.cond.notify_all()
        if ticket is not None and self.journal is not None:
            self.journal.wait(ticket)
        log.info("deleted group %s", name)
        return True

    def set_learning_rate(self, name: str, learning_rate: float) -> Group:
        self._check_open()
        if not math.isfinite(learning_rate):
            raise InvalidArgument(
                f"learning_rate must be finite, got {learning_rate}",
                field="learning_rate",
            )
        g = self.get(name)
        with g.cond:
            self._check_live(g)
            g.learning_rate = float(learning_rate)
            ticket = None
            if self.journal is not None and not self.replaying:
                record = {"op": "set_lr", "group": name, "lr": float(learning_rate)}
                ticket = self.journal.log(record, [])
        if ticket is not None and self.journal is not None:
            self.journal.wait(ticket)
        return g

    # -- push ----------------------------------------------------------------------
    def validate_push_header(
        self, g: Group, specs: Sequence[tuple[np.dtype[Any], tuple[int, ...]]]
    ) -> None:
        """Check gradient count, dtypes and shapes before any bytes are read."""
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

    def push(
        self,
        name: str,
        grads: Sequence[Array],
        *,
        client_id: str = "",
        seq: int = 0,
        base_version: int | None = None,
        learning_rate: float | None = None,
        return_values: bool = False,
        timeout: float | None = None,
    ) -> PushOutcome:
        self._check_open()
        g = self.get(name)
        self.validate_push_header(g, [(a.dtype, a.shape) for a in grads])
        if learning_rate is not None and not math.isfinite(learning_rate):
            raise InvalidArgument(
                f"learning_rate must be finite, got {learning_rate}",
                field="learning_rate",
            )
        if not g.allow_non_finite:
            for i, a in enumerate(grads):
                if not all_finite(a):
                    raise InvalidArgument(
                        f"gradient {i + 1} ({g.names[i]!r}) holds NaN or inf, which "
                        f"would poison group {name!r} for good; fix the worker, or "
                        "create the group with allow_non_finite=True",
                        reason="NON_FINITE_GRADIENT",
                        field=f"gradients[{i}]",
                        metadata={"group": name},
                    )
        ticket = None
        with g.cond:
            self._check_live(g)
            cached = self._dedup_lookup(g, client_id, seq)
            if cached is not None:
                outcome = PushOutcome(cached[0], cached[1], duplicate=True)
            else:
                outcome = self._push_locked(
                    g, grads, client_id, seq, base_version, learning_rate
                )
                if self.journal is not None and not self.replaying:
                    record = {
                        "op": "push",
                        "group": name,
                        "client_id": client_id,
                        "seq": seq,
                        "base_version": base_version,
                        "lr": learning_rate,
                    }
                    ticket = self.journal.log(record, grads)
            if return_values:
                if not outcome.applied:
                    self._wait_version(g, outcome.update_count + 1, timeout)
                outcome.values = g.copy_values(False)
        if ticket is not None and self.journal is not None:
            self.journal.wait(ticket)
        return outcome

    def _push_locked(
        self,
        g: Group,
        grads: Sequence[Array],
        client_id: str,
        seq: int,
        base_version: int | None,
        learning_rate: float | None,
    ) -> PushOutcome:
        t = g.update_count
        if base_version is not None and base_version > t:
            raise InvalidArgument(
                f"push computed against T={base_version}, but group {g.name!r} is "
                f"only at T={t}: base_version must be a T the worker pulled",
                reason="BASE_VERSION_AHEAD",
                field="base_version",
                metadata={"group": g.name, "update_count": t},
            )
        c = g.consistency
        if c.mode == "async":
            s = c.max_staleness
            if base_version is not None and s is not None and base_version < t - s:
                raise FailedPrecondition(
                    f"stale push to {g.name!r}: computed against T={base_version}, the "
                    f"group is at T={t} and max_staleness={s} accepts T >= {t - s}; "
                    "pull and recompute",
                    reason="STALE_PUSH",
                    metadata={"group": g.name, "update_count": t, "max_staleness": s},
                )
            g.step(grads, learning_rate)
            outcome = PushOutcome(g.update_count, True)
        else:
            if base_version is not None and base_version < t:
                raise FailedPrecondition(
                    f"stale push to sync group {g.name!r}: computed against "
                    f"T={base_version}, but that step was already taken (T={t}); pull "
                    f"min_version={t} and recompute",
                    reason="STALE_PUSH",
                    metadata={"group": g.name, "update_count": t},
                )
            g.expire_leases(self._clock())
            key = client_id or f"~anonymous-{len(g.pending)}-{time.monotonic_ns()}"
            if key in g.pending:
                raise FailedPrecondition(
                    f"client {client_id!r} already pushed for step T={t} of sync group "
                    f"{g.name!r}; wait for the step (pull min_version={t + 1})",
                    reason="DUPLICATE_SYNC_PUSH",
                    metadata={"group": g.name, "update_count": t},
                )
            g.pending[key] = [np.array(a, dtype=g.dtype, order="C") for a in grads]
            outcome = PushOutcome(t, False)
            if self._maybe_sync_step(g):
                outcome = PushOutcome(g.update_count, True)
        if client_id:
            self._dedup_store(g, client_id, seq, outcome)
        g.cond.notify_all()
        return outcome

    def _maybe_sync_step(self, g: Group) -> bool:
        if self.replaying:
            # Replay steps where the log says a step was taken: the sync_step record
            # precedes the push that triggered it, so wait for that many contributions.
            if g.replay_step is None or len(g.pending) < g.replay_step:
                return False
            g.replay_step = None
        elif not g.pending or len(g.pending) < g.quorum():
            return False
        combined = combine_contributions(g.pending, g.consistency.reduction, g.dtype)
        contributors = sorted(g.pending)
        g.pending = {}
        g.step(combined, None)
        if self.journal is not None and not self.replaying:
            self.journal.log(
                {"op": "sync_step", "group": g.name, "contributors": contributors}, []
            )
        g.cond.notify_all()
        return True

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
        w = g.dedup.setdefault(client_id, ClientWindow())
        w.results[seq] = (outcome.update_count, outcome.applied)
        while len(w.results) > DEDUP_WINDOW:
            old, _ = w.results.popitem(last=False)
            w.floor = max(w.floor, old)

    # -- pull ----------------------------------------------------------------------
    def pull(
        self,
        name: str,
        *,
        with_state: bool = False,
        min_version: int | None = None,
        timeout: float | None = None,
    ) -> tuple[int, list[Array], float]:
        self._check_open()
        g = self.get(name)
        with g.cond:
            self._check_live(g)
            if min_version is not None:
                self._wait_version(g, min_version, timeout)
            return g.update_count, g.copy_values(with_state), g.learning_rate

    def read_locked(
        self,
        name: str,
        min_version: int | None,
        timeout: float | None,
        reader: Callable[[Group], Any],
    ) -> Any:
        """Run ``reader`` on the group under its lock (after waiting for a version)."""
        g = self.get(name)
        with g.cond:
            self._check_live(g)
            if min_version is not None:
                self._wait_version(g, min_version, timeout)
            return reader(g)

    def _wait_version(self, g: Group, version: int, timeout: float | None) -> None:
        deadline = None if timeout is None else self._clock() + timeout
        while g.update_count < version:
            self._check_live(g)
            if self._draining:
                raise Unavailable(
                    f"the server is shutting down while group {g.name!r} is at "
                    f"T={g.update_count}, before T={version}; retry after it restarts",
                    metadata={"group": g.name, "update_count": g.update_count},
                )
            remaining = None if deadline is None else deadline - self._clock()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded(
                    f"group {g.name!r} is at T={g.update_count}; it did not reach "
                    f"T={version} before the deadline"
                )
            g.cond.wait(timeout=0.5 if remaining is None else min(remaining, 0.5))

    # -- workers -------------------------------------------------------------------
    def join(self, name: str, worker_id: str) -> Group:
        """Join or renew a worker's lease (a heartbeat of an unknown worker joins)."""
        self._check_open()
        check_name(worker_id, "worker id")
        g = self.get(name)
        with g.cond:
            self._check_live(g)
            # A heartbeat may be the first to see a lease run out: the quorum shrinks
            # here, so the pending step may be due now (the reaper will not retry it).
            if g.expire_leases(self._clock()) and self._maybe_sync_step(g):
                g.cond.notify_all()
            if worker_id not in g.workers:
                if worker_id in g.dead:
                    log.info("group %s: worker %s rejoined", name, worker_id)
                else:
                    log.info("group %s: worker %s joined", name, worker_id)
            g.dead.discard(worker_id)
            g.workers[worker_id] = self._clock() + g.lease_seconds
            return g

    def leave(self, name: str, worker_id: str) -> Group:
        g = self.get(name)
        with g.cond:
            self._check_live(g)
            if g.workers.pop(worker_id, None) is not None:
                g.dead.add(worker_id)
                log.info("group %s: worker %s left", name, worker_id)
                self._maybe_sync_step(g)
                g.cond.notify_all()
            return g

    # -- durability ----------------------------------------------------------------
    def capture(
        self,
        g: Group,
        journal_seq: Callable[[], int] | None = None,
        scratch: Callable[[int], Array] | None = None,
    ) -> dict[str, Any] | None:
        """A copy of the group's whole state taken under its lock (None if deleted).

        ``journal_seq`` is read under the same lock: every journal record of this group
        up to that sequence number is in the copy, and none after it. ``scratch(n)``
        may lend a reusable uint8 buffer of at least n bytes for X, V and H: copying
        into memory already touched is several times faster than into fresh pages,
        and the lock is held for the copy.
        """
        with g.cond:
            if g.deleted:
                return None
            return {
                **group_definition(g),
                "covered_seq": journal_seq() if journal_seq is not None else 0,
                "arrays": copy_into(g, scratch) if scratch else g.copy_values(True),
                "workers": sorted(g.workers),
                "dead": sorted(g.dead),
                "pending": {k: [a.copy() for a in v] for k, v in g.pending.items()},
                "dedup": {
                    cid: (w.floor, [(s, t, a) for s, (t, a) in w.results.items()])
                    for cid, w in g.dedup.items()
                },
            }

    def install(self, image: Mapping[str, Any]) -> Group:
        """Recreate a captured group (at start, before serving) with all its state."""
        attrs = make_attrs(image["optimizer"], image["attrs"])
        n = len(image["names"])
        arrays = list(image["arrays"])
        g = Group(
            image["group"],
            attrs,
            image["learning_rate"],
            list(zip(image["names"], arrays[:n], strict=True)),
            consistency=Consistency(**image["consistency"]),
            allow_non_finite=image["allow_non_finite"],
            lease_seconds=image["lease_seconds"],
            state=arrays[n:] or None,
            update_count=image["update_count"],
            adopt=True,
        )
        now = self._clock()
        g.workers = dict.fromkeys(image.get("workers", ()), now + g.lease_seconds)
        g.dead = set(image.get("dead", ()))
        g.pending = {k: list(v) for k, v in image.get("pending", {}).items()}
        for cid, (floor, rows) in image.get("dedup", {}).items():
            w = g.dedup[cid] = ClientWindow(floor=int(floor))
            for s, t, a in rows:
                w.results[int(s)] = (int(t), bool(a))
        with self._lock:
            self._groups[g.name] = g
        log.info(
            "restored group %s: %s %s, %d tensors, %d elements, T=%d",
            g.name, attrs.op, g.dtype, n, g.element_count, g.update_count,
        )  # fmt: skip
        return g

    def replay_sync_step(self, name: str, contributors: int) -> None:
        """Replay a logged sync step: it is taken once that many pushes are buffered."""
        g = self.get(name)
        with g.cond:
            g.replay_step = contributors
            self._maybe_sync_step(g)

    # -- helpers -------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("the server is shutting down; retry on another server")

    def _check_live(self, g: Group) -> None:
        if g.deleted:
            raise NotFound(f"group {g.name!r} was deleted", metadata={"group": g.name})
        if self._closed:
            raise Unavailable("the server is shutting down; retry on another server")
