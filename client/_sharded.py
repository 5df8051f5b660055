"""A cluster's calls, written once for both clients: each routed to the parts of
its group.

Placement and layouts are ``_cluster``'s pure functions; this module turns one call
into operations of one shard each (``on_shard``), runs them at once (``parallel``)
and merges the replies. Every function here is an operation (``_requests.Op``):
``Client`` runs it with blocking calls on a thread pool, ``AsyncClient`` with
asyncio tasks, and ``_routes.Cluster`` is what sends a cluster's calls here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.encoding import Encoding

from ._cluster import (
    Layout,
    Part,
    base_name,
    join_arrays,
    part_arrays,
    plan_layout,
)
from ._errors import (
    AlreadyExistsError,
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    PartsDivergedError,
    RpcError,
    UnavailableError,
)
from ._landing import until_landed
from ._layouts import (
    _call,
    _layout_of,
    _listing,
    _remember,
    _shards,
    layout,
    rerouted,
)
from ._ops import (
    Call,
    Deadline,
    Op,
    on_shard,
    one_call,
    parallel,
    what,
)
from ._pending import (
    PartPush,
    PendingPush,
    maybe_applied,
    resend_later,
    resend_now,
)
from ._records import (
    GroupInfo,
    HistoryInfo,
    HistoryStep,
    PartInfo,
    PushResult,
    RewindInfo,
    group_info,
    history_info,
    rewind_info,
)
from ._shardops import ShardOps

__all__ = [
    "all_finite",
    "check_finite",
    "pull_rows_part",
    "PartPush",
    "create_group",
    "delete_group",
    "describe_group",
    "history",
    "layout",
    "list_groups",
    "rewind",
    "part_targets",
    "pull",
    "push",
    "set_learning_rate",
    "until_landed",
]

log = logging.getLogger("onnxps.client")
R = TypeVar("R")
Array = np.ndarray[Any, Any]


def part_targets(
    ops: ShardOps, group: str, deadline: Deadline
) -> Op[list[tuple[int, str]]]:
    """``(shard, name)`` of every part of ``group``."""
    found = yield from layout(ops, group, deadline)
    return [(p.shard, p.name) for p in found.parts]


def merged(ops: ShardOps, found: Layout, infos: Sequence[pb.GroupInfo]) -> GroupInfo:
    """One GroupInfo for the whole group from its parts' (in part order)."""
    first = group_info(infos[0])
    parts = tuple(
        PartInfo(
            p.name,
            p.shard,
            ops.addresses[p.shard],
            int(g.update_count),
            int(g.element_count),
        )
        for p, g in zip(found.parts, infos, strict=True)
    )
    return dataclasses.replace(
        first,
        name=found.group,
        tensors=list(zip(found.names, found.shapes, strict=True)),
        update_count=min(p.update_count for p in parts),
        element_count=sum(p.element_count for p in parts),
        state_bytes=sum(int(g.state_bytes) for g in infos),
        parts=parts,
        tables={  # an ids table split by id (``_ids_cluster``): its rows summed
            name: dataclasses.replace(
                t, row_count=sum(group_info(g).tables[name].row_count for g in infos)
            )
            for name, t in first.tables.items()
        },
    )


# -- groups ---------------------------------------------------------------------------
def check_new(ops: ShardOps, group: str, deadline: Deadline) -> Op[None]:
    """ALREADY_EXISTS when the cluster holds ``group`` (or parts of it). A
    courtesy: part 0's creation is what decides between two clients."""
    listing = yield from _listing(ops, group, deadline)
    if _layout_of(group, listing, ops) is not None:
        raise AlreadyExistsError(
            f"group {group!r} exists already in the cluster",
            reason="GROUP_EXISTS",
            metadata={"group": group},
        )


def create_parts(
    ops: ShardOps,
    planned: Layout,
    create: Callable[[int], Op[pb.GroupInfo]],
    deadline: Deadline,
) -> Op[GroupInfo]:
    """Create the planned parts (``create(k)``: part k's creation on its shard):
    all, or none (a part that could not be created makes the others be deleted
    again)."""
    # Part 0 first: it is the lock between clients creating the same group at
    # once (the loser gets ALREADY_EXISTS there and leaves the winner's parts alone).
    first = yield from create(0)
    rest = [attempt(create(k)) for k in range(1, len(planned.parts))]
    results: list[pb.GroupInfo | Exception] = [first, *(yield from parallel(rest))]
    failed = [r for r in results if isinstance(r, Exception)]
    if failed:
        for part, r in zip(planned.parts, results, strict=True):
            if not isinstance(r, Exception):
                yield from _delete_quietly(ops, part.shard, part.name, deadline)
        raise failed[0]
    infos = [r for r in results if isinstance(r, pb.GroupInfo)]
    _remember(ops, planned, infos)
    return merged(ops, planned, infos)


def create_group(
    ops: ShardOps,
    req: pb.CreateGroupRequest,
    names: Sequence[str],
    arrays: Sequence[Array],
    state_arrays: Sequence[Array],
    deadline: Deadline,
) -> Op[GroupInfo]:
    """Create the group's parts on their shards (all, or none)."""
    group = req.group
    yield from check_new(ops, group, deadline)
    dtype = arrays[0].dtype if arrays else None
    itemsize = dtype.itemsize if dtype is not None else 4
    shapes = [a.shape for a in arrays]
    planned = plan_layout(
        group, names, shapes, itemsize, ops.placement_shards, ops.split_bytes
    )

    def create(k: int) -> Op[pb.GroupInfo]:
        part = planned.parts[k]
        template = pb.CreateGroupRequest()
        template.CopyFrom(req)
        template.group = part.name
        op = ops.create(
            template,
            planned.slot_names(part),
            part_arrays(planned, part, arrays),
            part_arrays(planned, part, state_arrays),
            deadline,
        )
        return on_shard(part.shard, op)

    return (yield from create_parts(ops, planned, create, deadline))


def attempt(op: Op[R]) -> Op[R | Exception]:
    """``op``'s result, or the exception it raised (reported by the caller, after
    every part answered)."""
    try:
        return (yield from op)
    except Exception as exc:
        return exc


def _delete_quietly(
    ops: ShardOps, shard: int, name: str, deadline: Deadline
) -> Op[None]:
    req = pb.DeleteGroupRequest(group=name)
    call = Call("DeleteGroup", lambda: req, deadline, what("DeleteGroup"))
    try:
        yield from on_shard(shard, one_call(call))
    except Exception as exc:  # the error that made us undo is the one to report
        log.warning("could not delete part %s on shard %d again: %s", name, shard, exc)


def _each_part(
    ops: ShardOps,
    found: Layout,
    method: str,
    request: Callable[[str], Any],
    deadline: Deadline,
) -> Op[list[Any]]:
    """``method`` with ``request(part name)`` on every part at once: the replies."""
    return (
        yield from parallel(
            [
                _call(ops, method, request(p.name), deadline, p.shard)
                for p in found.parts
            ]
        )
    )


def describe_group(ops: ShardOps, group: str, deadline: Deadline) -> Op[GroupInfo]:
    def describe(found: Layout) -> Op[GroupInfo]:
        replies = yield from _each_part(
            ops,
            found,
            "DescribeGroup",
            lambda name: pb.DescribeGroupRequest(group=name),
            deadline,
        )
        return merged(ops, found, [m.group for m in replies])

    return (yield from rerouted(ops, group, deadline, describe))


def list_groups(ops: ShardOps, prefix: str, deadline: Deadline) -> Op[list[GroupInfo]]:
    """The groups of every shard, a split group once (its parts merged), by name."""
    listing = yield from _listing(ops, prefix, deadline)
    bases = sorted({base_name(g.name)[0] for _, g in listing})
    out = []
    for group in bases:
        if not group.startswith(prefix):
            continue
        mine = [(i, g) for i, g in listing if base_name(g.name)[0] == group]
        found = _layout_of(group, mine, ops)
        assert found is not None
        by_name = {g.name: g for _, g in mine}
        infos = [by_name[p.name] for p in found.parts]
        _remember(ops, found, infos)
        out.append(merged(ops, found, infos))
    return out


def delete_group(ops: ShardOps, group: str, deadline: Deadline) -> Op[bool]:
    try:
        found = yield from layout(ops, group, deadline, refresh=True)
    except NotFoundError:
        return False
    ops.layouts.pop(group, None)
    replies = yield from _each_part(
        ops,
        found,
        "DeleteGroup",
        lambda name: pb.DeleteGroupRequest(group=name),
        deadline,
    )
    for p in found.parts:
        ops.sizes.pop(p.name, None)
    return any(m.deleted for m in replies)


def set_learning_rate(
    ops: ShardOps, group: str, learning_rate: float, deadline: Deadline
) -> Op[GroupInfo]:
    def set_all(found: Layout) -> Op[GroupInfo]:
        replies = yield from _each_part(
            ops,
            found,
            "SetLearningRate",
            lambda name: pb.SetLearningRateRequest(
                group=name, learning_rate=learning_rate
            ),
            deadline,
        )
        return merged(ops, found, [m.group for m in replies])

    return (yield from rerouted(ops, group, deadline, set_all))


def rewind(
    ops: ShardOps, group: str, to_step: int, deadline: Deadline
) -> Op[RewindInfo]:
    """Every part of ``group`` back to step ``to_step``, at once (each part's
    shard computes its part's state; a part that cannot is named in its error)."""

    def rewind_all(found: Layout) -> Op[RewindInfo]:
        replies = yield from _each_part(
            ops,
            found,
            "Rewind",
            lambda name: pb.RewindRequest(group=name, to_step=to_step),
            deadline,
        )
        info = merged(ops, found, [m.group for m in replies])
        slowest = max(replies, key=lambda m: m.reached.seconds)
        return rewind_info(slowest, info, max(int(m.from_step) for m in replies))

    return (yield from rerouted(ops, group, deadline, rewind_all))


# The steps a History call asks for per reply (0: the server's page, at most
# 65,536 steps); a long history comes in pages.
HISTORY_PAGE = 0


def history(ops: ShardOps, group: str, deadline: Deadline) -> Op[HistoryInfo]:
    """The steps every part of ``group`` can go back to (the first part's times),
    and the disk every shard holding a part keeps."""

    def history_all(found: Layout) -> Op[HistoryInfo]:
        steps: list[HistoryStep] = []
        start = 0
        while True:  # a long history comes in pages: the steps every part lists
            replies = yield from _each_part(
                ops,
                found,
                "History",
                lambda name: pb.HistoryRequest(
                    group=name,
                    start_step=start,  # noqa: B023
                    limit=HISTORY_PAGE,
                ),
                deadline,
            )
            infos = [history_info(m) for m in replies]
            # a part with more to list covers only up to its page's last step
            ends = [i.steps[-1].step for i, m in zip(infos, replies, strict=True)
                    if m.more and i.steps]  # fmt: skip
            end = min(ends) if ends else None
            common = set.intersection(*({s.step for s in i.steps} for i in infos))
            steps += [
                s
                for s in infos[0].steps
                if s.step in common and (end is None or s.step <= end)
            ]
            if end is None:
                return HistoryInfo(
                    group,
                    steps,
                    min(i.update_count for i in infos),
                    sum(i.snapshot_bytes for i in infos),
                    sum(i.wal_bytes for i in infos),
                )
            start = end + 1

    return (yield from rerouted(ops, group, deadline, history_all))


def save(ops: ShardOps, deadline: Deadline) -> Op[list[Any]]:
    """Every shard's Save reply, in shard order."""
    return (
        yield from parallel(
            [
                _call(ops, "Save", pb.SaveRequest(), deadline, i)
                for i in range(_shards(ops))
            ]
        )
    )


def leases(
    ops: ShardOps,
    method: str,
    targets: Sequence[tuple[int, str]],
    worker_id: str,
    deadline: Deadline,
) -> Op[Any]:
    """Join or leave every part; the reply of the first part."""
    request = pb.JoinGroupRequest if method == "JoinGroup" else pb.LeaveGroupRequest
    replies = yield from parallel(
        [
            _call(ops, method, request(group=name, worker_id=worker_id), deadline, s)
            for s, name in targets
        ]
    )
    return replies[0]


# -- push and pull --------------------------------------------------------------------
def group_dtype(ops: ShardOps, found: Layout) -> np.dtype[Any] | None:
    """The group's dtype, as the listing gave it (None: not known)."""
    return ops.dtypes.get(found.parts[0].name)


_FINITE_BLOCK = 1 << 20  # elements checked at once (a 1 MiB temporary, not a's size)


def all_finite(a: Array) -> bool:
    """No NaN or inf in ``a`` (block by block: 64 MiB take about 3 ms)."""
    flat = a.reshape(-1)
    return all(
        bool(np.isfinite(flat[i : i + _FINITE_BLOCK]).all())
        for i in range(0, flat.size, _FINITE_BLOCK)
    )


def _check_gradients(
    ops: ShardOps, found: Layout, arrays: Sequence[Array], deadline: Deadline
) -> Op[None]:
    """Refused here, before any part is sent, so parts never disagree about it:
    a refusal that can never pass must not reach a part after another applied."""
    if len(arrays) != len(found.names):
        raise InvalidArgumentError(
            f"group {found.group!r} has {len(found.names)} tensors; the push gave "
            f"{len(arrays)} gradients",
            reason="WRONG_TENSOR_COUNT",
            metadata={"group": found.group},
        )
    dtype = group_dtype(ops, found)
    finite = True
    for name, shape, a in zip(found.names, found.shapes, arrays, strict=True):
        if tuple(a.shape) != shape:
            raise InvalidArgumentError(
                f"gradient of {name!r} in group {found.group!r} has shape "
                f"{tuple(a.shape)}, expected {shape}",
                reason="WRONG_SHAPE",
                metadata={"group": found.group, "tensor": name},
            )
        if a.dtype.kind != "f":
            continue  # an encoded gradient (bfloat16, float16 bits): widened there
        if dtype is not None and a.dtype != dtype:
            raise InvalidArgumentError(
                f"gradient of {name!r} in group {found.group!r} must be {dtype}, "
                f"the group's dtype; got {a.dtype}",
                reason="DTYPE_MISMATCH",
                metadata={"group": found.group, "tensor": name},
            )
        finite = finite and all_finite(a)
    yield from check_finite(ops, found, finite, deadline, "a gradient")


def _push_one(ops: ShardOps, part: PartPush, deadline: Deadline) -> Op[Any]:
    """One part's push to its shard: the reply."""
    shard, template, arrays = part
    shard = ops.shard_of(template.group, shard)
    if isinstance(template, pb.PushRowsHeader):
        op = ops.send_rows(template.group, template, list(arrays), deadline)
    else:
        op = ops.push(template, arrays, deadline, None, shard)
    return (yield from on_shard(shard, op))


def _send_part(ops: ShardOps, part: PartPush, deadline: Deadline) -> Op[Any]:
    """One part's push, sent again (same seq) while its shard is unavailable or
    busy (``RESOURCE_EXHAUSTED``: retry later), until the deadline. A deadline
    that passes after the shard refused says so (the refusal's reason)."""
    refused: list[RpcError] = []  # the last refusal that was not UNAVAILABLE

    def resend(exc: RpcError) -> bool:
        if resend_now(exc) and not isinstance(exc, UnavailableError):
            refused[:] = [exc]
        return resend_now(exc)

    try:
        sent = until_landed(
            lambda: _push_one(ops, part, deadline), deadline, resend, ops
        )
        return (yield from sent)
    except DeadlineExceededError as exc:
        if not refused:
            raise
        (last,) = refused
        raise DeadlineExceededError(
            f"{exc.details}; before that, shard {part[0]} refused it: {last}",
            reason=last.reason,
            metadata=last.metadata,
        ) from None


def _keep(ops: ShardOps, entry: PendingPush | None, new: PendingPush) -> None:
    if entry is None:
        ops.pending.add(new)
    else:
        ops.pending.replace(entry, new)


def _diverged(group: str, seq: int, refused: Sequence[tuple[PartPush, Any]]) -> Any:
    (shard, req, _), exc = refused[0]
    return PartsDivergedError(
        f"part {req.group} on shard {shard} refused push seq {seq} for good "
        f"({exc}) while other parts of {group!r} applied it: the parts are a push "
        "apart; see docs/cluster.md, 'When the parts of a split group disagree'",
        group=group,
        reason="PART_REFUSED",
        metadata={"part": req.group, "shard": str(shard), "seq": str(seq)},
    )


def land(
    ops: ShardOps,
    group: str,
    parts: Sequence[PartPush],
    after: Sequence[PartPush],
    deadline: Deadline,
    entry: PendingPush | None = None,
    elsewhere: bool | None = None,
) -> Op[list[Any]]:
    """Send ``parts`` in parallel, then (when they all landed) ``after``; replies in
    that order. What any part applied (or may have: no answer came), every part
    applies: a part that did not land, or refused for a reason that can pass later
    (``_pending.resend_later``), is kept with what comes after it in a pending
    entry of its own (``entry``: the one being resent), and the next push or pull
    of ``group`` sends it first with the same seq (exactly once), so parts never
    stay a push apart. ``elsewhere``: another part applied it already."""
    if elsewhere is None:
        elsewhere = entry is not None and entry.applied_elsewhere
    sent = _send_parts(ops, group, parts, after, deadline, entry, elsewhere)
    results = yield from sent
    failed = [
        (p, r) for p, r in zip(parts, results, strict=True) if isinstance(r, Exception)
    ]
    if failed:
        raise _refused(ops, group, parts, after, failed, entry, elsewhere)
    return (yield from _land_after(ops, group, results, after, deadline, entry))


def _send_parts(
    ops: ShardOps,
    group: str,
    parts: Sequence[PartPush],
    after: Sequence[PartPush],
    deadline: Deadline,
    entry: PendingPush | None,
    elsewhere: bool,
) -> Op[list[Any]]:
    """Each part's reply or error, sent in parallel."""
    try:
        return (
            yield from parallel([attempt(_send_part(ops, p, deadline)) for p in parts])
        )
    except GeneratorExit:
        # Cancelled (an AsyncClient task) while the parts travel: each may or may
        # not have taken the push, so the next push sends them all first.
        _keep(
            ops,
            entry,
            PendingPush(group, tuple(parts), tuple(after), elsewhere, "cancelled"),
        )
        raise


def _land_after(
    ops: ShardOps,
    group: str,
    results: list[Any],
    after: Sequence[PartPush],
    deadline: Deadline,
    entry: PendingPush | None,
) -> Op[list[Any]]:
    """Every part landed: now ``after`` (what waited for part 0), if anything."""
    if not after:
        if entry is not None:
            ops.pending.replace(entry, None)
        return results
    rest = None
    if entry is not None:
        rest = PendingPush(group, tuple(after), (), True, entry.why)
        ops.pending.replace(entry, rest)
    more = yield from land(ops, group, after, (), deadline, rest, True)
    return [*results, *more]


def _may_have_taken(
    parts: Sequence[PartPush],
    failed: list[tuple[PartPush, Exception]],
    entry: PendingPush | None,
    elsewhere: bool,
) -> bool:
    """Whether any part may have applied the push."""
    return (
        elsewhere
        or len(failed) < len(parts)
        or any(maybe_applied(r) for _, r in failed)
        # a resent part refused before its window was read may have applied
        or (entry is not None and any(resend_later(r) for _, r in failed))
    )


def _refused(
    ops: ShardOps,
    group: str,
    parts: Sequence[PartPush],
    after: Sequence[PartPush],
    failed: list[tuple[PartPush, Exception]],
    entry: PendingPush | None,
    elsewhere: bool,
) -> Exception:
    """The error of a fan-out where some parts failed, once what must be resent
    is kept (or what needs no resend is forgotten)."""
    took = _may_have_taken(parts, failed, entry, elsewhere)
    later = [(p, r) for p, r in failed if resend_later(r)]
    never = [(p, r) for p, r in failed if not resend_later(r)]
    seq = int((parts[0] if parts else after[0])[1].seq)
    if not took or not later:
        if entry is not None:
            ops.pending.replace(entry, None)
        return _diverged(group, seq, never) if took and never else failed[0][1]
    applied = elsewhere or len(failed) < len(parts)
    why = f"shard {later[0][0][0]}: {later[0][1]}"
    kept = PendingPush(group, tuple(p for p, _ in later), tuple(after), applied, why)
    _keep(ops, entry, kept)
    log.warning(
        "push to %s seq %d: parts %s did not take it (%s); they are sent again, "
        "with the same seq, before the next push or pull of the group",
        group,
        seq,
        ", ".join(str(p[1].group) for p, _ in later),
        why,
    )
    return _diverged(group, seq, never) if never else later[0][1]


def finish_earlier(ops: ShardOps, group: str, deadline: Deadline) -> Op[None]:
    """Send what earlier pushes to ``group`` left unsent (their seqs), oldest
    first; raises (and keeps them) when they still cannot land."""
    # bounded: each turn finishes the first entry or raises (a concurrent caller
    # may finish it first: then the next one is first)
    while (entry := ops.pending.first(group)) is not None:
        log.info(
            "push to %s: sending seq %d, left by an earlier push", group, entry.seq
        )
        try:
            yield from land(ops, group, entry.parts, entry.after, deadline, entry)
        except PartsDivergedError:
            raise
        except RpcError:
            head = ops.pending.first(group)
            if head is not None and head.seq == entry.seq:
                raise  # still pending: the group's calls wait for it
            # no part applied it (part 0 refused it as stale): nothing is left


def push(
    ops: ShardOps,
    req: pb.PushRequest,
    arrays: Sequence[Array],
    deadline: Deadline,
) -> Op[PushResult]:
    yield from finish_earlier(ops, req.group, deadline)

    def push_all(found: Layout) -> Op[tuple[Layout, list[Any]]]:
        if found.split:
            yield from _check_gradients(ops, found, arrays, deadline)

        def part(k: int, base_version: bool) -> PartPush:
            p = found.parts[k]
            part_req = pb.PushRequest()
            part_req.CopyFrom(req)
            part_req.group = p.name
            if not base_version:
                part_req.ClearField("base_version")
            return p.shard, part_req, part_arrays(found, p, arrays)

        count = len(found.parts)
        if count > 1 and req.HasField("base_version"):
            # Part 0 alone decides whether the push is too stale; the others then
            # take it unconditionally, so no part refuses what another applied.
            rest = [part(k, False) for k in range(1, count)]
            landed = yield from land(ops, req.group, [part(0, True)], rest, deadline)
        else:
            parts = [part(k, True) for k in range(count)]
            landed = yield from land(ops, req.group, parts, (), deadline)
        return found, landed

    found, replies = yield from rerouted(ops, req.group, deadline, push_all)
    counts = {int(m.update_count) for m in replies}
    if len(counts) > 1:
        log.debug("push to %s: parts answered T=%s", req.group, sorted(counts))
    values = None
    if req.return_values:
        values = join_arrays(found, [m.values for m in replies])
    return PushResult(
        max(counts),
        all(m.applied for m in replies),
        all(m.duplicate for m in replies),
        values,
        tuple(int(m.update_count) for m in replies),
    )


def pull(
    ops: ShardOps,
    group: str,
    state: bool,
    min_version: int | None,
    deadline: Deadline,
    encoding: Encoding = "native",
    allow_apart: bool = False,
) -> Op[tuple[int, list[Array]]]:
    """The group's arrays joined from its parts, and T, the lowest part's. Parts at
    different T are pulled again once the ones behind reach the highest (a push in
    flight lands), within the call's deadline; parts still behind when it passes
    raise ``PartsDivergedError`` (unless ``allow_apart``). This client's own
    pending pushes to the group are sent first."""
    yield from finish_earlier(ops, group, deadline)

    def pull_part(p: Part, at_least: int | None) -> Op[tuple[int, list[Array]]]:
        def send() -> Op[tuple[int, list[Array]]]:
            shard = ops.shard_of(p.name, p.shard)
            op = ops.pull(p.name, state, at_least, deadline, encoding, shard=shard)
            return on_shard(shard, op)

        return until_landed(send, deadline, ops=ops)

    def pull_all(found: Layout) -> Op[tuple[Layout, list[tuple[int, list[Array]]]]]:
        replies = yield from parallel([pull_part(p, min_version) for p in found.parts])
        counts = [r[0] for r in replies]
        if len(set(counts)) == 1 or allow_apart:
            return found, replies
        top = max(counts)
        behind = [k for k, t in enumerate(counts) if t < top]
        again = yield from parallel(
            [attempt(pull_part(found.parts[k], top)) for k in behind]
        )
        for k, r in zip(behind, again, strict=True):
            if isinstance(r, DeadlineExceededError):
                raise _apart(found, counts, deadline.seconds, r)
            if isinstance(r, Exception):
                raise r
            replies[k] = r
        return found, replies

    found, replies = yield from rerouted(ops, group, deadline, pull_all)
    t = min(r[0] for r in replies)
    return t, join_arrays(found, [r[1] for r in replies])


def _apart(
    found: Layout, counts: Sequence[int], waited: float, why: Exception
) -> PartsDivergedError:
    parts = ", ".join(
        f"{p.name} on shard {p.shard} at T={t}"
        for p, t in zip(found.parts, counts, strict=True)
    )
    return PartsDivergedError(
        f"the parts of split group {found.group!r} disagree: {parts}; the parts "
        f"behind did not reach T={max(counts)} within the pull's {waited:g} s "
        f"({why}). A part "
        "lost pushes the others applied (restored from an older data dir, or a "
        "client died mid-push); see docs/cluster.md, 'When the parts of a split "
        "group disagree', to repair it",
        group=found.group,
        update_counts=counts,
    )


def check_finite(
    ops: ShardOps,
    found: Layout,
    finite: bool,
    deadline: Deadline,
    what: str = "a row gradient",
) -> Op[None]:
    """Refuse a push holding NaN or inf unless the group allows them (asked only
    then), here: a part would refuse only what it owns, after others applied."""
    if finite:
        return
    if not (yield from describe_group(ops, found.group, deadline)).allow_non_finite:
        raise InvalidArgumentError(
            f"{what} holds NaN or inf, which would poison group "
            f"{found.group!r} for good; fix the worker, or create the group with "
            "allow_non_finite=True",
            reason="NON_FINITE_GRADIENT",
            metadata={"group": found.group},
        )


def pull_rows_part(
    ops: ShardOps,
    found: Layout,
    k: int,
    selection: Mapping[str, Array],
    state: bool,
    min_version: int | None,
    deadline: Deadline,
) -> Op[dict[str, Array]]:
    """Rows of part ``k`` (``selection``: its names and local indices), asked
    again while its shard is unavailable."""
    part = found.parts[k]

    def send() -> Op[dict[str, Array]]:
        op = ops.pull_rows(
            found.group, part.name, selection, state, min_version, deadline
        )
        return on_shard(ops.shard_of(part.name, part.shard), op)

    return until_landed(send, deadline, ops=ops)
