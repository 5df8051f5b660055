"""Receiving a streamed push: chunks land in reused buffers and are checked for NaN
and inf as they arrive.

A 64 MiB push used to assemble its gradient into freshly allocated memory (the
kernel zero-fills every page on first touch) and then read the whole gradient
twice more for NaN and inf once the last chunk was in, while the client waited.
Here each group keeps a few gradient buffers from push to push (``GradientPool``),
and every chunk is checked right after it is copied in, while it is still in
cache and while the stream waits for the next chunk anyway. The store still makes
the decision: a push whose chunks were all seen finite says so
(``push(..., known_finite=True)``); any other push is checked by the store as
before, so a NaN is refused with the same status, reason and message, and nothing
changes.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from onnxps.wire.codec import TensorAssembler

from ..errors import InvalidArgument
from ..kernels._finite import finite_checker
from ..store._flat import FlatArrays, flat_views

__all__ = ["POOL_BYTES", "GradientPool", "Lease", "Received", "receive"]

Array = np.ndarray[Any, Any]
Spec = tuple[np.dtype[Any], tuple[int, ...]]

# Idle gradient buffers the server keeps in all by default (--gradient-pool-bytes;
# least recently used dropped first), and per group and shape; smaller pushes
# allocate as before.
POOL_BYTES = 128 << 20
IDLE_PER_KEY = 1
MIN_POOLED_BYTES = 1 << 20
# The pool keeps nothing while the host has less memory available than this share
# of its total (the buffers are a speed-up, never worth the host's memory).
LOW_MEMORY_SHARE = 0.10


_MEMINFO_SECONDS = 1.0  # /proc/meminfo read at most this often (pushes give back)
_meminfo: list[float] = [-_MEMINFO_SECONDS, 0.0, 0.0]  # read at, total, available


def memory_low(share: float = LOW_MEMORY_SHARE) -> bool:
    """Whether MemAvailable is under ``share`` of MemTotal (False where
    /proc/meminfo does not say), as read at most a second ago."""
    now = time.monotonic()
    if now - _meminfo[0] >= _MEMINFO_SECONDS:
        _meminfo[:] = [now, *_read_meminfo()]
    _, total, available = _meminfo
    return bool(total and available < share * total)


def _read_meminfo() -> tuple[float, float]:
    """(MemTotal, MemAvailable) in KiB; (0, 0) where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo", "rb") as f:
            head = f.read(512)
    except OSError:
        return 0.0, 0.0
    fields = {}
    for line in head.split(b"\n"):
        key, _, value = line.partition(b":")
        if key in (b"MemTotal", b"MemAvailable") and value.split():
            fields[key] = float(value.split()[0])
    if b"MemAvailable" not in fields:
        return 0.0, 0.0
    return fields.get(b"MemTotal", 0.0), fields[b"MemAvailable"]


class GradientPool:
    """Gradient buffers reused from push to push, per group and shape.

    A push leases one buffer per gradient (``lease``) and gives them back when it is
    done with them; at most ``IDLE_PER_KEY`` sets per group and shape, and
    ``max_bytes`` in all, wait idle for the next push (the least recently used set
    goes first). ``drop(group)`` frees a deleted group's buffers, and sets leased
    before it are freed when they come back instead of being kept. While the host
    is low on memory (``low_memory()``) nothing is kept and what was idle is freed.
    """

    def __init__(
        self,
        max_bytes: int = POOL_BYTES,
        low_memory: Callable[[], bool] = memory_low,
    ) -> None:
        self.max_bytes = max_bytes
        self.low_memory = low_memory
        self._lock = threading.Lock()
        self._idle: OrderedDict[tuple[str, tuple[Spec, ...]], list[list[Array]]]
        self._idle = OrderedDict()
        self._idle_bytes = 0
        self._epochs: dict[str, int] = {}

    @property
    def idle_bytes(self) -> int:
        """Bytes of buffers waiting for a push now."""
        with self._lock:
            return self._idle_bytes

    def lease(self, group: str, specs: Sequence[Spec]) -> Lease:
        """Buffers for one push's gradients; ``release()`` gives them back (the push
        must be done with them by then)."""
        key = (group, tuple((np.dtype(d), tuple(s)) for d, s in specs))
        nbytes = sum(
            np.dtype(d).itemsize * int(np.prod(s, dtype=np.int64)) for d, s in specs
        )
        if nbytes < MIN_POOLED_BYTES or nbytes > self.max_bytes:
            return Lease(_flat_buffers(specs), None)
        with self._lock:
            epoch = self._epochs.get(group, 0)
            sets = self._idle.get(key)
            arrays = sets.pop() if sets else None
            if arrays is not None:
                self._idle_bytes -= nbytes
                if not sets:
                    del self._idle[key]
        if arrays is None:
            arrays = _flat_buffers(specs)
        return Lease(arrays, lambda: self._give_back(key, epoch, nbytes, arrays))

    def _give_back(
        self,
        key: tuple[str, tuple[Spec, ...]],
        epoch: int,
        nbytes: int,
        arrays: list[Array],
    ) -> None:
        with self._lock:
            if self._epochs.get(key[0], 0) != epoch:
                return  # the group was deleted while this push had them
            if self.low_memory():  # keep nothing, and free what was idle
                self._idle.clear()
                self._idle_bytes = 0
                return
            sets = self._idle.setdefault(key, [])
            self._idle.move_to_end(key)
            if len(sets) >= IDLE_PER_KEY:
                return
            sets.append(arrays)
            self._idle_bytes += nbytes
            while self._idle_bytes > self.max_bytes:
                old_key, old_sets = next(iter(self._idle.items()))
                size = sum(a.nbytes for a in old_sets.pop())
                self._idle_bytes -= size
                if not old_sets:
                    del self._idle[old_key]

    def clear(self) -> None:
        """Free every idle buffer."""
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0

    def drop(self, group: str) -> None:
        """Free a group's buffers (it was deleted or replaced)."""
        with self._lock:
            self._epochs[group] = self._epochs.get(group, 0) + 1
            for key in [k for k in self._idle if k[0] == group]:
                for arrays in self._idle.pop(key):
                    self._idle_bytes -= sum(a.nbytes for a in arrays)


def _flat_buffers(specs: Sequence[Spec]) -> list[Array]:
    """Arrays for ``specs``: views of one flat buffer (``FlatArrays``) when they
    share a dtype, as a push's gradients do (``_flat``)."""
    dtypes = {np.dtype(d) for d, _ in specs}
    if len(dtypes) != 1:
        return [np.empty(s, d) for d, s in specs]
    shapes = [tuple(s) for _, s in specs]
    flat = np.empty(sum(math.prod(s) for s in shapes), dtypes.pop())
    return FlatArrays(flat_views(flat, shapes), flat)


class Lease:
    """One push's gradient buffers (``arrays``), given back by ``release()``, once,
    or at the end of a ``with`` block."""

    def __init__(self, arrays: list[Array], give_back: Callable[[], None] | None):
        self.arrays = arrays
        self._give_back = give_back
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Received:
    """A streamed push's gradients, and whether every element was seen finite."""

    __slots__ = ("arrays", "finite")

    def __init__(self, arrays: list[Array], finite: bool) -> None:
        self.arrays = arrays
        self.finite = finite


def receive(
    chunks: Iterator[Any],
    asm: TensorAssembler,
) -> Received:
    """Fill ``asm`` from a stream's chunk messages, checking each run of whole
    elements for NaN and inf as it lands; ``asm.finish()``'s errors propagate."""
    checked = [0] * len(asm.arrays)
    flats = [a.reshape(-1) for a in asm.arrays]
    all_finite = finite_checker()
    finite = True
    for msg in chunks:
        if msg.WhichOneof("part") != "chunk":
            raise InvalidArgument("after the header a stream carries only chunks")
        chunk = msg.chunk
        asm.add(chunk)
        if finite:
            i = chunk.index
            ready = asm.ready(i)
            if ready > checked[i]:
                finite = all_finite(flats[i][checked[i] : ready])
                checked[i] = ready
    return Received(asm.finish(), finite)
