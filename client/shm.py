"""The same-host transport: tensors in POSIX shared memory, gRPC for control only.

A client and a server on one host (one user, one /dev/shm, one pid namespace) move
tensor bytes through segments in /dev/shm that the *client* creates, owns and
unlinks; a call carries only a ``SharedMemoryRegion`` (segment name, generation,
offsets). The layout (this module is the one place it is written down; the server
imports it):

- a segment is ``/dev/shm/onnxps-<pid>-<random hex>``, mode 0600, created with
  O_EXCL by the client whose pid it names;
- it begins with a 64-byte header: ``MAGIC``, then the little-endian uint64
  generation, bumped by whoever last wrote tensors into it, and at ``KEY_AT`` the
  segment's random key (``KEY_BYTES``);
- tensors follow at the offsets the call's region names (``layout``: one dtype's
  tensors back to back after the header), raw little-endian C order.

A hello (``SharedMemoryHello``) proves the host is shared before any tensor goes
this way: the client writes a random nonce and its pid namespace into a fresh
segment, and the server must answer with the nonce it read. A segment whose owner
died is an orphan: ``sweep_orphans`` (run by the server every few seconds and by a
client when it says hello) unlinks segments of dead pids, so a ``kill -9`` of
either side leaves nothing behind once the survivor notices.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import secrets
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import TensorFormatError, tensor_spec
from onnxps.wire.shm import (
    HEADER_BYTES,
    KEY_AT,
    KEY_BYTES,
    MAGIC,
    NONCE_BYTES,
    PREFIX,
    SHM_DIR,
    layout,
    new_key,
    one_itemsize,
    pid_namespace,
)

__all__ = [
    "Segment",
    "SegmentPool",
    "SharedMemoryMode",
    "TensorBuffers",
    "hello_segment",
]

log = logging.getLogger("onnxps.shm")

Array = np.ndarray[Any, Any]
SharedMemoryMode = Literal["auto", "on", "off"]

_IDLE_SEGMENTS = 6  # kept by a client for its next calls
_MIN_SEGMENT = 64 << 10


def _packed(specs: Sequence[tuple[np.dtype[Any], Any, int, int]]) -> bool:
    """Whether tensors at these (dtype, dims, count, offset) lie back to back in
    one dtype (as ``layout`` packs them), more than one."""
    if len(specs) < 2:
        return False
    dtype, _, count, at = specs[0]
    for d, _, n, offset in specs[1:]:
        at += count * dtype.itemsize
        if d != dtype or offset != at:
            return False
        count = n
    return True


class Segment:
    """One segment this process created (and unlinks): mapped read-write, holding
    ``key`` (a fresh one by default) in its header."""

    def __init__(
        self, size: int, directory: str = SHM_DIR, key: bytes | None = None
    ) -> None:
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self.path = os.path.join(directory, self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Allocated now: a full /dev/shm (a container's is often 64 MiB) is an
            # OSError here, not a SIGBUS when either side writes.
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise
        os.close(fd)
        self.size = size
        self.generation = 0
        self.key = new_key() if key is None else key
        self.map[: len(MAGIC)] = MAGIC
        self.map[KEY_AT : KEY_AT + KEY_BYTES] = self.key

    def write(self, arrays: Sequence[Array]) -> pb.SharedMemoryRegion:
        """Copy ``arrays`` in (one copy each); the region naming them."""
        itemsize = one_itemsize(a.dtype for a in arrays)
        offsets, _ = layout([a.nbytes for a in arrays], itemsize)
        if itemsize is not None and len(arrays) > 1:
            # packed back to back: one copy of them all (one call, not one each)
            dtype = arrays[0].dtype.newbyteorder("<")
            total = sum(a.size for a in arrays)
            dest = np.frombuffer(self.map, dtype, total, offsets[0])
            flat = [a.reshape(-1) for a in arrays]
            np.concatenate(flat, out=dest, casting="no")
        else:
            for a, at in zip(arrays, offsets, strict=True):
                dest = np.frombuffer(self.map, a.dtype.newbyteorder("<"), a.size, at)
                np.copyto(dest.reshape(a.shape), a, casting="no")
        self.generation += 1
        struct.pack_into("<Q", self.map, len(MAGIC), self.generation)
        return pb.SharedMemoryRegion(
            segment=self.name, generation=self.generation, offsets=offsets, key=self.key
        )

    def publish(self, offsets: Sequence[int]) -> pb.SharedMemoryRegion:
        """The region of tensors already written in place at ``offsets`` (a new
        generation, no copy)."""
        self.generation += 1
        struct.pack_into("<Q", self.map, len(MAGIC), self.generation)
        return pb.SharedMemoryRegion(
            segment=self.name, generation=self.generation, offsets=offsets, key=self.key
        )

    def region(self) -> pb.SharedMemoryRegion:
        """This segment as a region for the server to write a reply into."""
        (generation,) = struct.unpack_from("<Q", self.map, len(MAGIC))
        return pb.SharedMemoryRegion(
            segment=self.name, generation=generation, key=self.key
        )

    def read(
        self,
        region: pb.SharedMemoryRegion,
        headers: Sequence[pb.Tensor],
        *,
        out: Sequence[Array] | None = None,
    ) -> list[Array]:
        """Copies of the tensors the server wrote into this segment: into
        ``out[k]`` where it has tensor k's dtype and shape, else fresh arrays."""
        (generation,) = struct.unpack_from("<Q", self.map, len(MAGIC))
        if region.segment != self.name or region.generation != generation:
            raise TensorFormatError(
                f"the server answered with region {region.segment}@"
                f"{region.generation}; this call's segment is {self.name}@{generation}"
            )
        if len(region.offsets) != len(headers):
            raise TensorFormatError(
                f"the reply names {len(headers)} tensors and {len(region.offsets)} "
                "offsets"
            )
        specs = []
        for t, at in zip(headers, region.offsets, strict=True):
            dtype, dims = tensor_spec(t, t.name or "tensor")
            count = math.prod(dims)
            if at < HEADER_BYTES or at + count * dtype.itemsize > self.size:
                raise TensorFormatError(
                    f"tensor {t.name!r} at offset {at} runs past segment {self.name}"
                    f" ({self.size} bytes)"
                )
            specs.append((dtype, dims, count, at))
        if out is None and _packed(specs):
            # back to back in one dtype: one copy of them all, cut into views
            dtype, _, _, first = specs[0]
            total = sum(count for _, _, count, _ in specs)
            flat = np.frombuffer(self.map, dtype, total, first).copy()
            views, start = [], 0
            for _, dims, count, _ in specs:
                views.append(flat[start : start + count].reshape(dims))
                start += count
            return views
        copies: list[Array] = []
        for dtype, dims, count, at in specs:
            view = np.frombuffer(self.map, dtype, count, at).reshape(dims)
            k = len(copies)
            dest = out[k] if out is not None and k < len(out) else None
            if dest is not None and dest.dtype == dtype and dest.shape == view.shape:
                np.copyto(dest, view)
                copies.append(dest)
            else:
                copies.append(view.copy())
        return copies

    def close(self) -> None:
        """Unmap and unlink (idempotent)."""
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(BufferError, ValueError):
            self.map.close()


class TensorBuffers(Sequence[Array]):
    """Arrays shaped like a group's tensors X_1..X_n (its dtype, C order), for a
    worker to write gradients into and to pull X into, without copies when they
    live in shared memory (``Client.tensor_buffers``; docs/transports.md, "Writing
    gradients straight into shared memory").

    ``shared`` says where they live: in a segment of this client's, which the
    server reads a push's gradients from and writes a pull's X into in place; or
    (no shared memory with this server) in ordinary memory, which calls copy as
    usual. Either way the code that uses them is the same.

    Lifetime and rules, all enforced: the arrays are the buffers' for as long as
    the buffers are open; ``close()`` (or the end of a ``with`` block, or the
    client's ``close()``) unlinks the segment, after which the arrays stay valid
    memory holding their last values but are no longer shared (a push of them
    copies, as for any array). One call at a time uses the buffers: a second call
    while one is running raises ``ValueError``. The caller must not write into
    them while a push of them is in flight (e.g. until ``push_background``'s future
    is done), as for any gradient being streamed.
    """

    def __init__(
        self,
        group: str,
        dtype: np.dtype[Any],
        shapes: Sequence[tuple[int, ...]],
        segment: Segment | None,
    ) -> None:
        self.group = group
        self.dtype = np.dtype(dtype)
        self.shapes = [tuple(s) for s in shapes]
        sizes = [self.dtype.itemsize * math.prod(s) for s in shapes]
        self.offsets, _ = layout(sizes, self.dtype.itemsize)
        self._segment = segment
        self._lock = threading.Lock()
        self._busy = False
        if segment is None:
            self._arrays = [np.zeros(s, self.dtype) for s in self.shapes]
        else:
            self._arrays = [
                np.frombuffer(segment.map, self.dtype, math.prod(s), at).reshape(s)
                for s, at in zip(self.shapes, self.offsets, strict=True)
            ]

    @property
    def shared(self) -> bool:
        """True while the arrays live in a shared-memory segment."""
        return self._segment is not None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    @overload
    def __getitem__(self, index: int) -> Array: ...
    @overload
    def __getitem__(self, index: slice) -> list[Array]: ...
    def __getitem__(self, index: int | slice) -> Array | list[Array]:
        return self._arrays[index]

    def __iter__(self) -> Iterator[Array]:
        return iter(self._arrays)

    def __repr__(self) -> str:
        where = f"segment {self._segment.name}" if self._segment else "not shared"
        return f"TensorBuffers({self.group!r}, {self.dtype}, {self.shapes}, {where})"

    def is_these(self, arrays: Sequence[Array]) -> bool:
        """``arrays`` are exactly these buffers, in order (the same memory)."""
        if len(arrays) != len(self._arrays):
            return False
        return all(
            isinstance(a, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.flags.c_contiguous
            and _address(a) == _address(b)
            for a, b in zip(arrays, self._arrays, strict=True)
        )

    @contextlib.contextmanager
    def claimed(self) -> Iterator[Segment]:
        """The segment, for one call alone (ValueError while another uses it)."""
        with self._lock:
            if self._segment is None:
                raise ValueError(f"{self!r} is closed or not shared")
            if self._busy:
                raise ValueError(
                    f"the tensor buffers of group {self.group!r} are in use by "
                    "another call: one call at a time uses a TensorBuffers"
                )
            self._busy = True
            segment = self._segment
        try:
            yield segment
        finally:
            with self._lock:
                self._busy = False

    def publish(self, segment: Segment) -> pb.SharedMemoryRegion:
        """The region naming these buffers as they are now (a claimed segment)."""
        return segment.publish(self.offsets)

    def holds(
        self, region: pb.SharedMemoryRegion, headers: Sequence[pb.Tensor]
    ) -> bool:
        """A reply wrote tensors of exactly these buffers' dtype and shapes at
        their offsets, into their segment at its current generation."""
        seg = self._segment
        if seg is None or region.segment != seg.name:
            return False
        (generation,) = struct.unpack_from("<Q", seg.map, len(MAGIC))
        if region.generation != generation or list(region.offsets) != self.offsets:
            return False
        if len(headers) != len(self.shapes):
            return False
        for t, shape in zip(headers, self.shapes, strict=True):
            try:
                dtype, dims = tensor_spec(t, t.name or "tensor")
            except TensorFormatError:
                return False
            if dtype != self.dtype or tuple(dims) != shape:
                return False
        return True

    def close(self) -> None:
        """Unlink the segment (idempotent); the arrays stay, no longer shared."""
        with self._lock:
            segment, self._segment = self._segment, None
        if segment is not None:
            segment.close()

    def __enter__(self) -> TensorBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _address(a: Array) -> int:
    return int(a.__array_interface__["data"][0])


def hello_segment(
    directory: str = SHM_DIR, key: bytes | None = None
) -> tuple[Segment, bytes]:
    """A fresh segment holding the header magic, a random nonce, this process's
    pid namespace and ``key`` (what ``SharedMemoryHello`` sends the server), and
    the nonce."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    seg = Segment(HEADER_BYTES, directory, key)
    seg.map[len(MAGIC) : len(MAGIC) + NONCE_BYTES] = nonce
    end = len(MAGIC) + NONCE_BYTES
    struct.pack_into("<Q", seg.map, end, pid_namespace())
    return seg, nonce


def size_class(need: int) -> int:
    """The size of a segment for ``need`` bytes: at least ``_MIN_SEGMENT``, rounded
    up to 1/32 of its power of two, so at most 1/16 of a segment is never used (the
    server maps segments whole: a power of two cost up to twice the tensors)."""
    if need <= _MIN_SEGMENT:
        return _MIN_SEGMENT
    step = 1 << max(0, (need - 1).bit_length() - 5)
    return -(-need // step) * step


@dataclass
class SegmentPool:
    """The segments of one client, reused from call to call (a call takes one for
    itself and gives it back); ``close`` unlinks them all. They all hold ``key``,
    the one the client's hello bound to it."""

    directory: str = SHM_DIR
    key: bytes = field(default_factory=new_key)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[Segment] = []
        self._busy: set[Segment] = set()
        self._closed = False

    def acquire(self, nbytes: Sequence[int]) -> Segment:
        """A segment that holds tensors of these sizes, for this call alone.

        Sizes are rounded up to a size class (``size_class``) and a call takes an
        idle segment of its class or one at most 1/8 larger, so a small call never
        maps a large segment."""
        _, need = layout(nbytes)
        size = size_class(need)
        with self._lock:
            # an idle segment of this class or up to 1/8 larger: the smallest
            fits = [s for s in self._idle if size <= s.size <= size + size // 8]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                self._idle.remove(seg)
                self._busy.add(seg)
                return seg
        seg = Segment(size, self.directory, self.key)
        with self._lock:
            self._busy.add(seg)
        return seg

    def release(self, seg: Segment) -> None:
        """Give a call's segment back; the oldest idle one beyond the few kept is
        unlinked (every one, once the pool is closed)."""
        evicted: Segment | None = seg
        with self._lock:
            self._busy.discard(seg)
            if not self._closed:
                self._idle.append(seg)
                evicted = None
                if len(self._idle) > _IDLE_SEGMENTS:
                    evicted = self._idle.pop(0)
        if evicted is not None:
            evicted.close()

    def close(self) -> None:
        """Unlink every segment: idle ones now, busy ones when their call ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for seg in idle:
            seg.close()

    def __del__(self) -> None:  # pragma: no cover - a client never closed
        with contextlib.suppress(Exception):
            self.close()
