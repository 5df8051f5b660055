"""A group's state and the small records around it (no locking policy, no grpc).

``Group`` holds one ONNX node's tensors, accumulators, update count, consistency
settings, worker leases, pending sync contributions and exactly-once window; the
``ParameterStore`` (``store.py``) decides when to step it, under ``Group.cond``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .errors import InvalidArgument
from .kernels import OptimizerAttrs, Stepper

__all__ = [
    "DEDUP_WINDOW",
    "ClientWindow",
    "MAX_NAME_LENGTH",
    "Consistency",
    "DeadlineExceeded",
    "Group",
    "Journal",
    "PushOutcome",
    "StoreLimits",
    "all_finite",
    "check_name",
    "combine_contributions",
    "copy_into",
    "group_definition",
]

log = logging.getLogger("onnxps.store")

Array = np.ndarray[Any, Any]

DEDUP_WINDOW = 4096
MAX_NAME_LENGTH = 256


class DeadlineExceeded(Exception):
    """A wait (pull with min_version, push waiting for its sync step) timed out."""


@dataclass(frozen=True)
class Consistency:
    mode: str = "async"  # "async" or "sync"
    sync_workers: int = 0
    reduction: str = "mean"  # "mean" or "sum"
    max_staleness: int | None = None

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


@dataclass
class PushOutcome:
    update_count: int
    applied: bool
    duplicate: bool = False
    values: list[Array] | None = None


class Journal(Protocol):
    """Durability hook: records every state change in order (see ``durability``)."""

    def log(self, record: dict[str, Any], arrays: Sequence[Array]) -> int:
        """Append under the group's lock; returns a ticket for ``wait``."""
        ...

    def wait(self, ticket: int) -> None:
        """Block until the record with this ticket is durable."""
        ...


@dataclass
class ClientWindow:
    results: OrderedDict[int, tuple[int, bool]] = field(default_factory=OrderedDict)
    floor: int = -1  # every seq <= floor has been forgotten


def combine_contributions(
    contributions: Mapping[str, Sequence[Array]], reduction: str, dtype: np.dtype[Any]
) -> list[Array]:
    """Sum the gradients in client-id order, then divide by their count for mean.

    A fixed order makes the combined gradient independent of arrival order, so a sync
    step is reproducible bit for bit.
    """
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


class Group:
    """One optimizer node's state. Every field is guarded by ``cond``."""

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
        state: Sequence[Array] | None = None,
        update_count: int = 0,
        adopt: bool = False,
    ) -> None:
        self.name = name
        self.attrs = attrs
        self.learning_rate = float(learning_rate)
        self.update_count = int(update_count)
        self.dtype = np.dtype(tensors[0][1].dtype).newbyteorder("=")
        self.names = [n for n, _ in tensors]
        self.shapes = [tuple(int(d) for d in a.shape) for _, a in tensors]

        def own(a: Array) -> Array:
            # adopt: a restore hands over arrays it owns; take them without a copy
            if adopt:
                return np.ascontiguousarray(a, dtype=self.dtype).reshape(-1)
            return np.array(a, dtype=self.dtype, order="C").reshape(-1)

        self.xs = [own(a) for _, a in tensors]
        n = len(self.xs)
        self.states: dict[str, list[Array]] = {}
        for k, sname in enumerate(attrs.state_names):
            if state is not None:
                part = state[k * n : (k + 1) * n]
                self.states[sname] = [own(a) for a in part]
            else:
                self.states[sname] = [np.zeros_like(x) for x in self.xs]
        self.stepper = Stepper(attrs, self.dtype, [x.size for x in self.xs])
        self.consistency = consistency
        self.allow_non_finite = allow_non_finite
        self.lease_seconds = lease_seconds
        self.cond = threading.Condition(threading.Lock())
        self.dedup: dict[str, ClientWindow] = {}
        self.workers: dict[str, float] = {}  # worker id -> lease expiry (monotonic)
        self.dead: set[str] = set()
        self.pending: dict[str, list[Array]] = {}
        self.replay_step: int | None = None  # contributors of a logged sync step
        self.deleted = False
        self.created_at = time.time()

    # -- read-only facts -----------------------------------------------------------
    @property
    def element_count(self) -> int:
        return sum(x.size for x in self.xs)

    @property
    def state_bytes(self) -> int:
        per = self.element_count * self.dtype.itemsize
        return per * (1 + len(self.states))

    def state_arrays(self) -> list[Array]:
        """V..., H... in ONNX order (flat)."""
        return [a for sname in self.attrs.state_names for a in self.states[sname]]

    def quorum(self) -> int:
        """Pushes the pending sync step needs.

        A worker that pushed for this step and then died still counts: its gradient
        is in the step, so dropping it from the quorum too would let the step go
        before a live worker has pushed (and then refuse that worker's push as late).
        """
        missing = sum(1 for w in self.dead if w not in self.pending)
        return max(1, self.consistency.sync_workers - missing)

    def live_workers(self) -> int:
        return len(self.workers)

    # -- under the lock ------------------------------------------------------------
    def step(self, grads: Sequence[Array], learning_rate: float | None) -> None:
        r = self.learning_rate if learning_rate is None else learning_rate
        self.stepper.step(
            r,
            self.update_count,
            self.xs,
            [g.reshape(-1) for g in grads],
            self.states.get("V"),
            self.states.get("H"),
        )
        self.update_count += 1

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


def copy_into(g: Group, scratch: Callable[[int], Array]) -> list[Array]:
    arrays = g.xs + g.state_arrays()
    sizes = [-(-a.nbytes // 64) * 64 for a in arrays]  # 64-byte aligned slots
    buf = scratch(sum(sizes))
    out, offset, n = [], 0, len(g.shapes)
    for i, (a, size) in enumerate(zip(arrays, sizes, strict=True)):
        view = buf[offset : offset + a.nbytes].view(a.dtype)
        np.copyto(view, a)
        out.append(view.reshape(g.shapes[i % n]))
        offset += size
    return out


def group_definition(g: Group) -> dict[str, Any]:
    """Everything that defines a group except its arrays, as JSON-ready values."""
    return {
        "group": g.name,
        "optimizer": g.attrs.op,
        "attrs": dataclasses.asdict(g.attrs),
        "learning_rate": g.learning_rate,
        "update_count": g.update_count,
        "dtype": g.dtype.str,
        "names": list(g.names),
        "shapes": [list(s) for s in g.shapes],
        "consistency": dataclasses.asdict(g.consistency),
        "allow_non_finite": g.allow_non_finite,
        "lease_seconds": g.lease_seconds,
    }


def check_name(name: str, what: str = "group name") -> None:
    if not name:
        raise InvalidArgument(f"{what} must be a non-empty string")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidArgument(
            f"{what} must be at most {MAX_NAME_LENGTH} characters, got {len(name)}"
        )
    if not name.isprintable():
        raise InvalidArgument(f"{what} must be printable, got {name!r}")


def all_finite(a: Array) -> bool:
    # min/max propagate NaN and expose inf, without a temporary the size of ``a``.
    return a.size == 0 or bool(np.isfinite(a.min()) and np.isfinite(a.max()))
