"""What the server answers, as both clients return it: records and their decoders."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import PROTO_TO_DTYPE
from onnxps.wire.initializers import Initializer, Normal, Uniform, Zeros

from ._optimizers import Adagrad, Adam, Async, Momentum, OptimizerSpec, Sync

__all__ = [
    "GroupInfo",
    "HistoryInfo",
    "HistoryStep",
    "LeaseInfo",
    "PartInfo",
    "PushResult",
    "RowsPage",
    "RewindInfo",
    "SaveInfo",
    "TableInfo",
    "WorkerInfo",
    "group_info",
    "history_info",
    "lease_info",
    "optimizer_from_proto",
    "rewind_info",
]

Array = np.ndarray[Any, Any]


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    alive: bool
    lease_remaining_seconds: float


@dataclass(frozen=True)
class PartInfo:
    """One part of a group on a cluster (an unsplit group has one)."""

    name: str  # the group's name on that shard
    shard: int
    address: str
    update_count: int
    element_count: int


@dataclass(frozen=True)
class TableInfo:
    """An ids table of a group (``IdsTable``) and the rows it holds."""

    name: str
    dim: int
    initializer: Initializer
    max_rows: int  # 0: no limit
    row_count: int


@dataclass(frozen=True)
class RowsPage:
    """A page of an ids table (``list_rows``): ids ascending, and their rows when
    asked (``{table: X rows, "V:table": ..., "H:table": ...}``)."""

    ids: Array
    rows: dict[str, Array]
    next_page_token: str  # "": this was the last page
    row_count: int  # rows the table holds
    update_count: int


@dataclass(frozen=True)
class GroupInfo:
    name: str
    optimizer: OptimizerSpec
    learning_rate: float
    update_count: int
    dtype: np.dtype[Any]
    tensors: list[tuple[str, tuple[int, ...]]]
    consistency: Async | Sync
    allow_non_finite: bool
    element_count: int
    state_bytes: int
    lease_seconds: float
    workers: list[WorkerInfo] = field(default_factory=list)
    pending_contributions: int = 0
    quorum: int = 0
    parts: tuple[PartInfo, ...] = ()  # on a cluster: where its elements live
    tables: dict[str, TableInfo] = field(default_factory=dict)  # ids tables
    # the digest a flat push or pull names (docs/protocol.md, "The flat form");
    # empty: the group has no flat form
    layout: bytes = b""

    @property
    def nbytes(self) -> int:
        """Bytes of X_1..X_n (one pull without state, one push)."""
        return self.element_count * self.dtype.itemsize

    @property
    def parts_apart(self) -> bool:
        """The parts of a split group are at different T (a push in flight, or
        parts that disagree: ``onnxps status`` and ``pull`` tell which)."""
        return len({p.update_count for p in self.parts}) > 1


@dataclass(frozen=True)
class PushResult:
    update_count: int  # T after the push (sync: T when it was buffered)
    applied: bool  # False: buffered until the sync quorum pushes
    duplicate: bool  # a retry the server had already taken
    values: list[Array] | None = None  # X_1..X_n when asked for
    # on a cluster: the T each part answered, in part order (a split group's
    # parts differ while pushes of other workers interleave, or when they disagree)
    part_update_counts: tuple[int, ...] = ()


@dataclass(frozen=True)
class LeaseInfo:
    """A worker's lease on a group, as the server answered join or leave."""

    lease_seconds: float  # renew before this runs out
    update_count: int
    live_workers: int
    quorum: int


@dataclass(frozen=True)
class SaveInfo:
    """The snapshot the server wrote on ``save``."""

    path: str
    groups: int
    bytes: int


@dataclass(frozen=True)
class RewindInfo:
    """A rewind (or a fork) done: the group after it (a fork's new group), its
    T before (``from_step``; a fork: the forked group's T now), and how the server
    computed the state: from which base (``"snapshot"``, ``"create"`` or
    ``"rewind"``) at which T, replaying how many of the group's log records, in
    how many seconds (on a cluster: the slowest part's)."""

    group: GroupInfo
    from_step: int
    base: str
    base_step: int
    replayed: int
    seconds: float


@dataclass(frozen=True)
class HistoryStep:
    """A step a group can go back to: its T, when it was taken (Unix seconds; 0:
    not known), and ``kind``: ``"step"`` (a push's step), or a base reached with
    no replay (``"snapshot"``, ``"create"``, ``"moved"``: where a resharding moved
    the group to this shard, ``"rewind"``: where a rewind landed)."""

    step: int
    unix_time: float
    kind: str


@dataclass(frozen=True)
class HistoryInfo:
    """The steps a group can go back to, oldest first, its T now, and the disk
    the server's retention holds (kept snapshots, write-ahead log; on a cluster,
    summed over the shards)."""

    group: str
    steps: list[HistoryStep]
    update_count: int
    snapshot_bytes: int
    wal_bytes: int

    @property
    def oldest_step(self) -> int | None:
        return self.steps[0].step if self.steps else None


def rewind_info(msg: Any, group: GroupInfo, from_step: int) -> RewindInfo:
    r = msg.reached
    return RewindInfo(
        group, from_step, r.base, int(r.base_step), int(r.replayed), r.seconds
    )


def history_info(msg: Any) -> HistoryInfo:
    return HistoryInfo(
        msg.group,
        [HistoryStep(int(s.step), s.unix_time, s.kind) for s in msg.steps],
        int(msg.update_count),
        int(msg.snapshot_bytes),
        int(msg.wal_bytes),
    )


def lease_info(msg: Any) -> LeaseInfo:
    return LeaseInfo(msg.lease_seconds, msg.update_count, msg.live_workers, msg.quorum)


def optimizer_from_proto(spec: pb.OptimizerSpec) -> OptimizerSpec:
    kind = spec.WhichOneof("kind")
    if kind == "adagrad":
        a = spec.adagrad
        return Adagrad(a.epsilon, a.decay_factor, a.norm_coefficient)
    if kind == "momentum":
        m = spec.momentum
        mode: Literal["standard", "nesterov"] = (
            "nesterov" if m.mode == "nesterov" else "standard"
        )
        return Momentum(m.alpha, m.beta, mode, m.norm_coefficient)
    d = spec.adam
    return Adam(d.alpha, d.beta, d.epsilon, d.norm_coefficient, d.norm_coefficient_post)


def group_info(msg: pb.GroupInfo) -> GroupInfo:
    c = msg.consistency
    consistency: Async | Sync
    if c.mode == pb.CONSISTENCY_MODE_SYNC:
        consistency = Sync(
            c.sync_workers, "sum" if c.reduction == pb.REDUCTION_SUM else "mean"
        )
    else:
        consistency = Async(c.max_staleness if c.HasField("max_staleness") else None)
    return GroupInfo(
        name=msg.name,
        optimizer=optimizer_from_proto(msg.optimizer),
        learning_rate=msg.learning_rate,
        update_count=msg.update_count,
        dtype=PROTO_TO_DTYPE[msg.dtype].newbyteorder("="),
        tensors=[(t.name, tuple(t.dims)) for t in msg.tensors],
        consistency=consistency,
        allow_non_finite=msg.allow_non_finite,
        element_count=msg.element_count,
        state_bytes=msg.state_bytes,
        lease_seconds=msg.lease_seconds,
        workers=[
            WorkerInfo(w.worker_id, w.alive, w.lease_remaining_seconds)
            for w in msg.workers
        ],
        pending_contributions=msg.pending_contributions,
        quorum=msg.quorum,
        layout=msg.layout,
        tables={
            t.name: TableInfo(
                t.name,
                int(t.dim),
                initializer_from_proto(t.initializer),
                int(t.max_rows),
                int(t.row_count),
            )
            for t in msg.tables
        },
    )


def initializer_from_proto(msg: pb.RowInitializer) -> Initializer:
    if msg.kind == pb.ROW_INITIALIZER_KIND_UNIFORM:
        return Uniform(msg.low, msg.high, msg.seed)
    if msg.kind == pb.ROW_INITIALIZER_KIND_NORMAL:
        return Normal(msg.mean, msg.stddev, msg.seed, msg.truncated)
    return Zeros()


def initializer_to_proto(init: Initializer) -> pb.RowInitializer:
    if isinstance(init, Uniform):
        return pb.RowInitializer(
            kind=pb.ROW_INITIALIZER_KIND_UNIFORM,
            low=init.low,
            high=init.high,
            seed=init.seed,
        )
    if isinstance(init, Normal):
        return pb.RowInitializer(
            kind=pb.ROW_INITIALIZER_KIND_NORMAL,
            mean=init.mean,
            stddev=init.std,
            seed=init.seed,
            truncated=init.truncated,
        )
    return pb.RowInitializer(kind=pb.ROW_INITIALIZER_KIND_ZEROS)
