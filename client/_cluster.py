"""A cluster of shards: placement, split layouts and fan-out, with no grpc.

Everything here is a pure function of the group's name, its tensors and the shard
count (docs/cluster.md, "Placement", gives it precisely, for clients in other
languages), plus ``fan_out``, which runs callables in parallel on a thread pool (how
``Client`` performs a ``Parallel`` effect of the routing's operations, ``_sharded``;
``AsyncClient`` runs them as tasks).

- ``shard_ranking(group, n)``: rendezvous hashing. Shard ``i`` scores
  ``uint64_be(SHA-256(utf8(group) || uint32_be(i))[0:8])``; shards in decreasing score
  (ties: lower index first). An unsplit group lives on the first.
- A group whose X bytes exceed ``split_bytes`` is split into ``K = min(n,
  ceil(bytes / split_bytes))`` parts: the concatenation of X_1..X_n flattened in C
  order is cut at ``floor(total * k / K)``; part ``k`` is an ordinary group named
  ``"{group}#p{k}of{K}"`` on the shard ranked ``k``, holding the pieces of the
  tensors its range meets. A cut inside a tensor of 2+ dims moves down to a row
  boundary (equal cuts merge, so K can shrink): such a tensor is split by rows, its
  piece a ``(rows, d1, ...)`` tensor named ``"{tensor}@r{a}-{b}@{d0,d1,...}"`` (rows
  ``[a, b)``). A 1-D tensor is split by element ranges, its piece named
  ``"{tensor}@{start}-{stop}@{d0}"``; older layouts split any tensor that way.
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from onnxps.wire.codec import SHARD_METADATA_KEY
from onnxps.wire.coordinator import is_coordinator

__all__ = [
    "SHARD_METADATA_KEY",
    "Layout",
    "LayoutError",
    "Part",
    "Slot",
    "base_name",
    "fan_out",
    "join_arrays",
    "layout_from_listing",
    "part_arrays",
    "parse_target",
    "part_name",
    "placement",
    "plan_layout",
    "shard_addresses",
    "shard_ranking",
    "shard_score",
]

Array = np.ndarray[Any, Any]
T = TypeVar("T")


_PART = re.compile(r"^(?P<group>.+)#p(?P<k>\d+)of(?P<count>\d+)$")


class LayoutError(ValueError):
    """The parts a cluster holds for a group do not make one group."""


def shard_score(group: str, shard: int) -> int:
    """Rendezvous score of ``shard`` for ``group`` (an unsigned 64-bit integer)."""
    digest = hashlib.sha256(group.encode("utf-8") + shard.to_bytes(4, "big")).digest()
    return int.from_bytes(digest[:8], "big")


def shard_ranking(group: str, shards: int) -> list[int]:
    """Shard indexes by decreasing score for ``group`` (ties: lower index first)."""
    if shards < 1:
        raise ValueError(f"a cluster has at least one shard, got {shards}")
    return sorted(range(shards), key=lambda i: (-shard_score(group, i), i))


def placement(group: str, shards: int) -> int:
    """The shard of an unsplit group (and of part 0 of a split one)."""
    return shard_ranking(group, shards)[0]


def part_name(group: str, k: int, count: int) -> str:
    return f"{group}#p{k}of{count}"


def base_name(name: str) -> tuple[str, int, int]:
    """``(group, k, count)`` of a part's name; ``(name, 0, 1)`` for a whole group."""
    m = _PART.match(name)
    if m is None:
        return name, 0, 1
    return m["group"], int(m["k"]), int(m["count"])


def parse_target(text: str) -> str | list[str]:
    """A command line's address: ``host:port`` (one server), a comma-separated
    list of shard addresses in shard order (a cluster, even of one), or
    ``etcd[s]://H:P[,H:P]/PREFIX`` (a replicated cluster: its commas list etcd
    endpoints, kept as they are)."""
    if "," not in text or is_coordinator(text):
        return text
    return [a.strip() for a in text.split(",") if a.strip()]


def shard_addresses(template: str, shards: int) -> list[str]:
    """``"ps-{i}.ps-headless:50051"`` -> the addresses of shards 0..n-1 (StatefulSet
    pod DNS names: a pod's ordinal is its shard index)."""
    if "{i}" not in template:
        raise ValueError(f"the address template needs '{{i}}', got {template!r}")
    return [template.replace("{i}", str(i)) for i in range(shards)]


@dataclass(frozen=True)
class Slot:
    """The flat C-order elements ``[start, stop)`` of the group's tensor ``tensor``;
    ``rows``: they are whole rows, held as a ``(rows, d1, ...)`` tensor (else 1-D)."""

    tensor: int
    start: int
    stop: int
    rows: bool = False


@dataclass(frozen=True)
class Part:
    name: str  # the group's name on its shard
    shard: int
    slots: tuple[Slot, ...]

    @property
    def element_count(self) -> int:
        return sum(s.stop - s.start for s in self.slots)


@dataclass(frozen=True)
class Layout:
    """Where a group's elements live: one part (unsplit) or ``count`` parts."""

    group: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    parts: tuple[Part, ...]

    @property
    def split(self) -> bool:
        return self.parts[0].name != self.group

    def slot_names(self, part: Part) -> list[str]:
        """The tensor names of a part on its shard (the group's own when unsplit)."""
        if not self.split:
            return list(self.names)
        return [self.slot_name(s) for s in part.slots]

    def slot_name(self, s: Slot) -> str:
        shape = self.shapes[s.tensor]
        dims = ",".join(str(d) for d in shape)
        if s.rows:
            row = _row_size(shape)
            return f"{self.names[s.tensor]}@r{s.start // row}-{s.stop // row}@{dims}"
        return f"{self.names[s.tensor]}@{s.start}-{s.stop}@{dims}"

    def slot_shape(self, s: Slot) -> tuple[int, ...]:
        """The shape of a split group's piece on its shard."""
        if not s.rows:
            return (s.stop - s.start,)
        shape = self.shapes[s.tensor]
        return ((s.stop - s.start) // _row_size(shape), *shape[1:])


def _size(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _row_size(shape: Sequence[int]) -> int:
    """Elements per row of a tensor of 2+ dims (at least 1, for the arithmetic)."""
    return max(1, _size(shape[1:]))


def _by_rows(shape: Sequence[int]) -> bool:
    return len(shape) >= 2


def _row_cuts(bounds: Sequence[int], shapes: Sequence[tuple[int, ...]]) -> list[int]:
    """``bounds`` with each cut inside a tensor of 2+ dims moved down to the row
    boundary at or before it, equal cuts merged."""
    out: list[int] = []
    for b in bounds:
        offset = 0
        for shape in shapes:
            size = _size(shape)
            if offset < b < offset + size and _by_rows(shape):
                row = _row_size(shape)
                b = offset + (b - offset) // row * row
                break
            offset += size
        if not out or b != out[-1]:
            out.append(b)
    return out


def _whole(
    group: str, names: Sequence[str], shapes: Sequence[tuple[int, ...]], shard: int
) -> Layout:
    slots = tuple(Slot(i, 0, _size(s)) for i, s in enumerate(shapes))
    return Layout(group, tuple(names), tuple(shapes), (Part(group, shard, slots),))


def plan_layout(
    group: str,
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    itemsize: int,
    shards: int,
    split_bytes: int,
) -> Layout:
    """The layout a new group gets in a cluster of ``shards``."""
    shapes_t = tuple(tuple(int(d) for d in s) for s in shapes)
    ranking = shard_ranking(group, shards)
    sizes = [_size(s) for s in shapes_t]
    total = sum(sizes)
    count = 1
    if shards > 1 and split_bytes > 0 and total * itemsize > split_bytes:
        count = min(shards, math.ceil(total * itemsize / split_bytes), total)
    if count == 1:
        return _whole(group, names, shapes_t, ranking[0])
    bounds = _row_cuts([total * k // count for k in range(count + 1)], shapes_t)
    count = len(bounds) - 1
    if count == 1:
        return _whole(group, names, shapes_t, ranking[0])
    slots: list[list[Slot]] = [[] for _ in range(count)]
    offset = 0
    for i, size in enumerate(sizes):
        rows = _by_rows(shapes_t[i])
        if size == 0:  # an empty tensor goes with the part its offset falls in
            k = next((k for k in range(count) if offset < bounds[k + 1]), count - 1)
            slots[k].append(Slot(i, 0, 0, rows))
        for k in range(count):
            lo, hi = max(bounds[k], offset), min(bounds[k + 1], offset + size)
            if lo < hi:
                slots[k].append(Slot(i, lo - offset, hi - offset, rows))
        offset += size
    parts = tuple(
        Part(part_name(group, k, count), ranking[k], tuple(slots[k]))
        for k in range(count)
    )
    return Layout(group, tuple(names), shapes_t, parts)


def _parse_slot(text: str) -> tuple[str, int, int, tuple[int, ...], bool]:
    """``(tensor, start, stop, shape, rows)`` of a piece's name (elements)."""
    try:
        name, span, dims = text.rsplit("@", 2)
        rows = span.startswith("r")
        start, stop = (int(x) for x in span.removeprefix("r").split("-"))
        shape = tuple(int(d) for d in dims.split(",")) if dims else ()
    except ValueError as exc:
        raise LayoutError(f"{text!r} is not a part's tensor name") from exc
    if rows:
        if not _by_rows(shape):
            raise LayoutError(f"{text!r}: rows of a tensor with fewer than 2 dims")
        start, stop = start * _row_size(shape), stop * _row_size(shape)
    return name, start, stop, shape, rows


# What a shard lists of one group: ``(shard, name, [(tensor, dims)])``.
Tensors = Sequence[tuple[str, Sequence[int]]]
Listed = tuple[int, str, Tensors]


def layout_from_listing(group: str, listing: Iterable[Listed]) -> Layout | None:
    """A group's layout from what the shards list: ``(shard, name, [(tensor, dims)])``
    for every group whose name is ``group`` or one of its parts. None: not there."""
    whole, parts, counts = _holders(group, listing)
    if not whole and not parts:
        return None
    if whole and parts or len(whole) > 1 or len(counts) > 1:
        raise LayoutError(
            f"group {group!r} is held more than once in the cluster "
            f"({len(whole)} whole, parts of counts {sorted(counts)})"
        )
    if whole:
        shard, tensors = whole[0]
        return _whole(
            group,
            [n for n, _ in tensors],
            [tuple(int(d) for d in s) for _, s in tensors],
            shard,
        )
    (count,) = counts
    return _split_layout(group, count, parts)


def _holders(
    group: str, listing: Iterable[Listed]
) -> tuple[list[tuple[int, Tensors]], dict[int, Listed], set[int]]:
    """The listed groups that hold ``group``: ``(shard, tensors)`` of each whole
    copy, each part by its index (a later listing of an index wins), and the part
    counts their names give."""
    whole = []
    parts: dict[int, Listed] = {}
    counts = set()
    for shard, name, tensors in listing:
        g, k, count = base_name(name)
        if g != group:
            continue
        if name == group:
            whole.append((shard, tensors))
        else:
            parts[k] = (shard, name, tensors)
            counts.add(count)
    return whole, parts, counts


def _split_layout(group: str, count: int, parts: dict[int, Listed]) -> Layout:
    """The layout of ``group`` split in ``count`` parts, from each part's listing;
    a tensor's pieces are consecutive slots whose element ranges continue."""
    if sorted(parts) != list(range(count)):
        missing = sorted(set(range(count)) - set(parts))
        raise LayoutError(
            f"group {group!r} is split in {count} parts but parts {missing} are missing"
        )
    names: list[str] = []
    shapes: list[tuple[int, ...]] = []
    built = []
    last_stop = -1
    for k in range(count):
        shard, name, tensors = parts[k]
        slots = []
        for text, _ in tensors:
            tname, start, stop, shape, rows = _parse_slot(text)
            if not names or start != last_stop or tname != names[-1] or start == 0:
                names.append(tname)
                shapes.append(shape)
            slots.append(Slot(len(names) - 1, start, stop, rows))
            last_stop = stop
        built.append(Part(name, shard, tuple(slots)))
    return Layout(group, tuple(names), tuple(shapes), tuple(built))


def _flat(a: Array) -> Array:
    return np.ascontiguousarray(a).reshape(-1)


def part_arrays(layout: Layout, part: Part, arrays: Sequence[Array]) -> list[Array]:
    """The slices of ``arrays`` (one per tensor, or X..., V..., H... when
    ``len(arrays)`` is a multiple of the tensor count) that ``part`` holds."""
    if not layout.split:
        return list(arrays)
    n = len(layout.names)
    out = []
    for r in range(len(arrays) // n):
        for s in part.slots:
            piece = _flat(arrays[r * n + s.tensor])[s.start : s.stop]
            out.append(piece.reshape(layout.slot_shape(s)))
    return out


def join_arrays(layout: Layout, per_part: Sequence[Sequence[Array]]) -> list[Array]:
    """The group's arrays from each part's (the inverse of ``part_arrays``)."""
    if not layout.split:
        return list(per_part[0])
    n = len(layout.names)
    repeats = len(per_part[0]) // max(1, len(layout.parts[0].slots))
    dtype = per_part[0][0].dtype
    out = [np.empty(layout.shapes[i % n], dtype) for i in range(n * repeats)]
    for part, arrays in zip(layout.parts, per_part, strict=True):
        m = len(part.slots)
        for r in range(repeats):
            for j, s in enumerate(part.slots):
                piece = arrays[r * m + j].reshape(-1)
                out[r * n + s.tensor].reshape(-1)[s.start : s.stop] = piece
    return out


_POOL_LOCK = threading.Lock()
_POOL: futures.ThreadPoolExecutor | None = None


def _pool() -> futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = futures.ThreadPoolExecutor(64, thread_name_prefix="onnxps-fanout")
        return _POOL


def fan_out(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Run every call (one per shard or part) in parallel; their results in order.

    Every call runs to its end; then the first failure (in order) is raised.
    """
    if len(calls) == 1:
        return [calls[0]()]
    pending = [_pool().submit(c) for c in calls]
    futures.wait(pending)
    for f in pending:
        exc = f.exception()
        if exc is not None:
            raise exc
    return [f.result() for f in pending]
