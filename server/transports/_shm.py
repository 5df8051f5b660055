"""The server's side of the same-host transport (layout: ``onnxps.wire.shm``).

The server never creates a segment: it opens the client's by name, checks it (an
``onnxps-`` name with no path, a regular file of this server's uid, large enough,
the generation the call names), maps it and reads the gradients in place with
``np.frombuffer`` (no copy), or writes the reply's tensors into it. A client of the
same uid could signal this process anyway, so a segment is trusted as much as the
user: it is not copied before it is validated and stepped.

A name is no capability (anyone may list /dev/shm): every call that names a
segment carries the key in its header, which only a process that can read the
segment knows, and the first call (or hello) that names a key binds it to its
caller: the digest of its token, its gRPC peer and, where the OS tells
(``peer_uid``), its uid, which must be this server's (the segment's owner).
Every later use must come from the same token and the same uid (a new
connection of the same uid is the same client reconnecting); anything else is
PERMISSION_DENIED ``SEGMENT_NOT_YOURS``, before anything is read, written or
stepped. Messages name segments and uids, never a key or a generation.

Mappings are cached by segment name and inode (a client reuses its segments call
after call, and mapping 64 MiB costs milliseconds): every call still opens and
checks the file, and a file that changed (another inode or size) is mapped anew.
A sweeper thread unlinks the segments of clients that died (``sweep_orphans``)
and drops the mappings of segments that are gone, so their memory is freed
within a sweep.

A mapped segment's pages count in this server's RSS (as RssShmem) for as long
as they are mapped here, though they are the client's memory: a 128 MiB group's
segment would stay in the server's figures after its calls. So the pages of a
mapping no call has used for ``IDLE_SECONDS`` are dropped from this process
(``madvise(MADV_DONTNEED)``: the segment's bytes stay in the client's file, the
mapping stays cached, and the next call faults the pages in again, which costs
about what mapping them anew does). A client calling again within that time
finds its pages mapped, as before.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import math
import mmap
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.shm import (
    HEADER_BYTES,
    KEY_AT,
    KEY_BYTES,
    MAGIC,
    NONCE_BYTES,
    SHM_DIR,
    is_onnxps_name,
    layout,
    one_itemsize,
    owner_problem,
    pid_namespace,
    sweep_orphans,
)

from ..errors import FailedPrecondition, InvalidArgument, PermissionDenied
from ..store._flat import FlatArrays, flat_views
from ._peercred import peer_uid

__all__ = ["Caller", "SharedMemory"]

log = logging.getLogger("onnxps.shm")

Array = np.ndarray[Any, Any]
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_CACHED_MAPS = 32
IDLE_SECONDS = 1.0  # a mapping unused this long gives its pages back
_IDLE_LOOK = 0.25  # how often the sweeper looks for idle mappings
_BINDINGS = 4096  # keys remembered; the oldest is forgotten (its key still guards)


@dataclass(frozen=True)
class Caller:
    """Who names a segment: the digest of the call's token ("" without one) and
    its gRPC peer (``context.peer()``)."""

    principal: str
    peer: str


@dataclass(frozen=True)
class _Binding:
    """The caller a segment key was first named by, and its uid (None where the
    OS does not tell)."""

    principal: str
    peer: str
    uid: int | None


@dataclass
class _Mapping:
    inode: int
    size: int
    map: mmap.mmap
    used: float = 0.0  # time.monotonic() of the last call that took it
    resident: bool = True  # its pages may be mapped in this process


def _unmap(m: _Mapping) -> None:
    # A call still viewing it keeps it mapped until its arrays are gone.
    with contextlib.suppress(BufferError):
        m.map.close()


class SharedMemory:
    """Opens, checks and maps clients' segments; sweeps the orphaned ones."""

    def __init__(
        self,
        enabled: bool = True,
        *,
        directory: str = SHM_DIR,
        sweep_seconds: float = 2.0,
        idle_seconds: float = IDLE_SECONDS,
    ) -> None:
        self.enabled = enabled
        self.directory = directory
        self._sweep_seconds = sweep_seconds
        self._idle_seconds = idle_seconds
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        self._lock = threading.Lock()
        self._maps: OrderedDict[str, _Mapping] = OrderedDict()
        self._bindings: OrderedDict[bytes, _Binding] = OrderedDict()
        # segment name -> how many running pushes read gradients from it, or -1
        # and the push (client id, seq) that writes X over its gradients there
        self._held: dict[str, tuple[int, tuple[str, int] | None]] = {}
        self._holds = threading.Condition()

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        if not self.enabled or not os.path.isdir(self.directory):
            return
        sweep_orphans(self.directory)
        self._sweeper = threading.Thread(
            target=self._sweep, name="onnxps-shm-sweeper", daemon=True
        )
        self._sweeper.start()

    def _sweep(self) -> None:
        look = min(_IDLE_LOOK, self._sweep_seconds, self._idle_seconds)
        next_sweep = time.monotonic() + self._sweep_seconds
        while not self._stop.wait(look):
            try:
                self.drop_idle()
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + self._sweep_seconds
                    sweep_orphans(self.directory)
                    self._drop_gone()
            except Exception:  # noqa: BLE001 - a sweep must never end the thread
                log.exception("sweeping orphaned shared-memory segments failed")

    def drop_idle(self, now: float | None = None) -> int:
        """Drop from this process the pages of the mappings no call has used for
        ``idle_seconds`` (they stay in the client's segment; a later call faults
        them in again); how many were dropped. Safe beside a call using one: it
        only faults its pages in again."""
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [
                m
                for m in self._maps.values()
                if m.resident and now - m.used >= self._idle_seconds
            ]
            for m in idle:
                m.resident = False
        for m in idle:
            with contextlib.suppress(OSError, ValueError):  # closed meanwhile
                m.map.madvise(mmap.MADV_DONTNEED)
        return len(idle)

    def stop(self) -> None:
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join(timeout=5)
        with self._lock:
            maps, self._maps = list(self._maps.values()), OrderedDict()
        for m in maps:
            _unmap(m)

    def _drop_gone(self) -> None:
        """Unmap the cached segments whose file was unlinked or replaced."""
        with self._lock:
            cached = list(self._maps.items())
        for name, m in cached:
            try:
                alive = os.stat(os.path.join(self.directory, name)).st_ino == m.inode
            except OSError:
                alive = False
            if not alive:
                with self._lock:
                    if self._maps.get(name) is m:
                        del self._maps[name]
                _unmap(m)

    def _map(self, name: str, fd: int, st: os.stat_result) -> mmap.mmap:
        """The mapping of the open segment ``fd`` (cached while its file is the
        same)."""
        now = time.monotonic()
        with self._lock:
            m = self._maps.get(name)
            if m is not None and (m.inode, m.size) == (st.st_ino, st.st_size):
                self._maps.move_to_end(name)
                m.used, m.resident = now, True
                return m.map
        fresh = _Mapping(
            st.st_ino,
            st.st_size,
            mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | _POPULATE),
            now,
        )
        with self._lock:
            old = self._maps.pop(name, None)
            self._maps[name] = fresh
            evicted = [old] if old is not None else []
            while len(self._maps) > _CACHED_MAPS:
                evicted.append(self._maps.popitem(last=False)[1])
        for m in evicted:
            _unmap(m)
        return fresh.map

    def finished(self, region: pb.SharedMemoryRegion) -> None:
        """A call is done with ``region``'s segment: its pages are dropped from this
        process once no call has used it for ``idle_seconds`` from now (a call
        that outlasted that may have faulted them in again after a drop)."""
        with self._lock:
            m = self._maps.get(region.segment)
            if m is not None:
                m.used, m.resident = time.monotonic(), True

    # -- checks --------------------------------------------------------------------
    def _check_on(self) -> None:
        if not self.enabled:
            raise FailedPrecondition(
                "this server has shared memory turned off (--shared-memory off): "
                "send tensor bytes over gRPC",
                reason="SHARED_MEMORY_OFF",
            )

    def _mapped(self, name: str, key: bytes, caller: Caller, what: str) -> mmap.mmap:
        """The checked segment ``name``, mapped (read and write: the checks are the
        owner's uid and mode 0600, so this user may write it), once ``key`` is its
        key and ``caller`` the one it is bound to."""
        self._check_on()
        if not is_onnxps_name(name):
            raise InvalidArgument(
                f"{what}: segment {name!r} is not a shared-memory segment of onnxps "
                "(expected 'onnxps-' followed by letters, digits and '-', no path)",
                reason="BAD_SEGMENT",
                field=f"{what}.segment",
            )
        path = os.path.join(self.directory, name)
        flags = os.O_RDWR | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise FailedPrecondition(
                f"{what}: cannot open segment {name!r} in {self.directory}: "
                f"{exc.strerror} (client and server must share a host and /dev/shm)",
                reason="SEGMENT_UNAVAILABLE",
            ) from None
        try:
            st = os.fstat(fd)
            problem = owner_problem(st)
            if problem is not None:
                raise PermissionDenied(
                    f"{what}: segment {name!r} {problem}", reason="SEGMENT_NOT_OWNED"
                )
            if st.st_size < HEADER_BYTES:
                raise InvalidArgument(
                    f"{what}: segment {name!r} holds {st.st_size} bytes, less than "
                    f"its {HEADER_BYTES}-byte header",
                    reason="BAD_SEGMENT",
                )
            _check_allocated(name, st, what)
            mapped = self._map(name, fd, st)
        finally:
            os.close(fd)
        if mapped[: len(MAGIC)] != MAGIC:
            raise InvalidArgument(
                f"{what}: segment {name!r} does not begin with the onnxps header",
                reason="BAD_SEGMENT",
            )
        held = bytes(mapped[KEY_AT : KEY_AT + KEY_BYTES])
        if len(key) != KEY_BYTES or not hmac.compare_digest(held, key):
            raise PermissionDenied(
                f"{what}: the call does not carry the key of segment {name!r} "
                f"({KEY_BYTES} bytes, written in its header by the client that "
                "created it): a segment serves only that client",
                reason="SEGMENT_NOT_YOURS",
            )
        self._check_bound(key, caller, name, what)
        return mapped

    def _check_bound(self, key: bytes, caller: Caller, name: str, what: str) -> None:
        """Bind ``key`` to ``caller`` when it is new; refuse any other caller."""
        with self._lock:
            bound = self._bindings.get(key)
            if bound is not None:
                self._bindings.move_to_end(key)
        if bound is None:
            uid = peer_uid(caller.peer)
            if uid is not None and uid != os.geteuid():
                raise _not_yours(
                    what,
                    f"this call comes from uid {uid} and segment {name!r} belongs to "
                    f"uid {os.geteuid()}: a segment serves only a client of its "
                    "owner's uid",
                )
            with self._lock:
                bound = self._bindings.setdefault(
                    key, _Binding(caller.principal, caller.peer, uid)
                )
                while len(self._bindings) > _BINDINGS:
                    self._bindings.popitem(last=False)
        if not hmac.compare_digest(bound.principal, caller.principal):
            raise _not_yours(
                what,
                f"segment {name!r} is bound to the token of the client that first "
                "named it, and this call has another (or none): a segment serves "
                "only the token that registered it",
            )
        if caller.peer != bound.peer:  # another connection: the same uid?
            uid = peer_uid(caller.peer)
            if uid != bound.uid:
                raise _not_yours(
                    what,
                    f"this call comes from uid {_uid_text(uid)}, and segment "
                    f"{name!r} is bound to a client of uid {_uid_text(bound.uid)}",
                )
            with self._lock:  # the client reconnected: look its uid up once
                if key in self._bindings:
                    self._bindings[key] = _Binding(bound.principal, caller.peer, uid)

    # -- calls ---------------------------------------------------------------------
    def pushing(
        self, req: pb.PushRequest, timeout: float | None
    ) -> contextlib.AbstractContextManager[None]:
        """``held`` for a push reading its gradients from shared memory (X over
        them when its reply region names their segment), within ``timeout``."""
        if not req.HasField("gradients_region"):
            return contextlib.nullcontext()
        grads = req.gradients_region.segment
        over = req.HasField("reply_region") and req.reply_region.segment == grads
        push = (req.client_id, req.seq) if req.client_id else None
        return self.held(grads, over and req.return_values, push, timeout)

    @contextlib.contextmanager
    def held(
        self,
        name: str,
        over: bool,
        push: tuple[str, int] | None = None,
        timeout: float | None = None,
    ) -> Iterator[None]:
        """Hold segment ``name`` for a push that reads its gradients there, and
        with ``over`` writes X over them: such a push has the segment to itself,
        or another push could read X as its gradients (or have its gradients
        overwritten as it steps them). A push that cannot have it is refused
        before anything is read (FAILED_PRECONDITION ``SEGMENT_BUSY``), but the
        same push (``push``: client id and seq) resent while its first call runs
        waits for that call (within ``timeout``), then is answered once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._holds:
            while True:
                held, holder = self._held.get(name, (0, None))
                if held >= 0 and not (over and held > 0):
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if push is None or holder != push or (left is not None and left <= 0):
                    raise FailedPrecondition(
                        f"gradients_region: segment {name!r} is in use by another "
                        "push running now, and one of the two writes X over its "
                        "gradients there: give each push running at once a "
                        "segment of its own",
                        reason="SEGMENT_BUSY",
                        metadata={"segment": name},
                    )
                self._holds.wait(left)
            self._held[name] = (-1, push) if over else (held + 1, None)
        try:
            yield
        finally:
            with self._holds:
                held, _ = self._held.pop(name)  # -1 (X over them) or readers
                if held > 1:
                    self._held[name] = (held - 1, None)
                self._holds.notify_all()

    def hello(self, name: str, key: bytes, caller: Caller) -> bytes:
        """The nonce a client's hello segment holds, once its pid namespace is ours
        (and ``key``, the segment's, is bound to ``caller``)."""
        m = self._mapped(name, key, caller, "hello")
        end = len(MAGIC) + NONCE_BYTES
        nonce = bytes(m[len(MAGIC) : end])
        (their_ns,) = struct.unpack_from("<Q", m, end)
        ours = pid_namespace()
        if their_ns != ours:
            raise FailedPrecondition(
                f"the client runs in another pid namespace ({their_ns}, this server "
                f"{ours}): segments of clients that die could not be swept",
                reason="OTHER_PID_NAMESPACE",
            )
        return nonce

    def check(self, region: pb.SharedMemoryRegion, caller: Caller, what: str) -> int:
        """Refuse ``region`` now (before a call changes anything) unless its
        segment is usable and ``caller``'s; the bytes it maps."""
        return len(self._mapped(region.segment, region.key, caller, what))

    @contextlib.contextmanager
    def read(
        self,
        region: pb.SharedMemoryRegion,
        specs: Sequence[tuple[np.dtype[Any], tuple[int, ...]]],
        names: Sequence[str],
        caller: Caller,
        *,
        spent: bool = False,
    ) -> Iterator[list[Array]]:
        """Read-only arrays viewing the tensors of ``region`` (no copy), valid for
        the block. ``spent``: the segment is one generation past the region's
        (``is_spent``), and that is what is checked."""
        what = "gradients_region"
        if len(region.offsets) != len(specs):
            raise InvalidArgument(
                f"{what} has {len(region.offsets)} offsets for {len(specs)} tensors",
                field=f"{what}.offsets",
            )
        m = self._mapped(region.segment, region.key, caller, what)
        _check_generation(m, region, what, 1 if spent else 0)
        counts = [math.prod(dims) for _, dims in specs]
        packed = len(specs) > 1
        end = region.offsets[0] if specs else 0
        for (dtype, _), n, at, name in zip(
            specs, counts, region.offsets, names, strict=True
        ):
            _check_span(m, at, n * dtype.itemsize, dtype.itemsize, name, what)
            packed = packed and at == end and dtype == specs[0][0]
            end = at + n * dtype.itemsize
        arrays: list[Array]
        if packed:
            # One dtype, back to back (``layout``): one flat array, so the push
            # checks and steps the group as one array (``FlatArrays``).
            arrays = _packed(m, specs[0][0], region.offsets[0], sum(counts), specs)
        else:
            arrays = []
            for (dtype, dims), n, at in zip(specs, counts, region.offsets, strict=True):
                view = np.frombuffer(m, dtype, n, at).reshape(dims)
                view.flags.writeable = False
                arrays.append(view)
        try:
            yield arrays
        finally:
            arrays.clear()

    def reply_views(
        self,
        region: pb.SharedMemoryRegion,
        dtype: np.dtype[Any],
        sizes: Sequence[int],
        caller: Caller,
    ) -> tuple[list[Array], list[int]] | None:
        """Writable flat views, one per tensor of ``sizes`` elements of ``dtype``,
        where ``write`` would put them in the client's segment ``region`` names,
        and their offsets; None when they do not fit (the reply then carries them
        inline). ``written`` then marks them as the reply."""
        offsets, size = layout([n * dtype.itemsize for n in sizes], dtype.itemsize)
        m = self._mapped(region.segment, region.key, caller, "reply_region")
        if size > len(m):
            return None
        views = [
            np.frombuffer(m, dtype, n, at) for n, at in zip(sizes, offsets, strict=True)
        ]
        return views, offsets

    def is_spent(
        self,
        gradients: pb.SharedMemoryRegion,
        reply: pb.SharedMemoryRegion,
        caller: Caller,
    ) -> bool:
        """Whether ``gradients`` names a segment whose gradients a push already
        spent: X written over them in place (``reply`` names the same segment at
        the same generation), so the segment is one generation past the region.
        Such a push is a resend after a lost reply: only the answer it already
        had may be given (exactly-once), its gradients are gone."""
        if reply.segment != gradients.segment or reply.generation != (
            gradients.generation
        ):
            return False
        m = self._mapped(gradients.segment, gradients.key, caller, "gradients_region")
        (generation,) = struct.unpack_from("<Q", m, len(MAGIC))
        return bool(generation == gradients.generation + 1)

    def generation_of(self, region: pb.SharedMemoryRegion, caller: Caller) -> Array:
        """A writable one-element view of the generation in the header of
        ``region``'s segment (little-endian uint64): what a push writing X over
        its own gradients sets before it writes the first block."""
        m = self._mapped(region.segment, region.key, caller, "reply_region")
        return np.frombuffer(m, np.dtype("<u8"), 1, len(MAGIC))

    def written(
        self, region: pb.SharedMemoryRegion, offsets: Sequence[int], caller: Caller
    ) -> pb.SharedMemoryRegion:
        """Mark what ``reply_views``' views now hold as the reply: the segment's
        generation becomes ``region.generation + 1`` (what the client checks)."""
        m = self._mapped(region.segment, region.key, caller, "reply_region")
        generation = region.generation + 1
        struct.pack_into("<Q", m, len(MAGIC), generation)
        return pb.SharedMemoryRegion(
            segment=region.segment, generation=generation, offsets=list(offsets)
        )

    def write(
        self, region: pb.SharedMemoryRegion, arrays: Sequence[Array], caller: Caller
    ) -> pb.SharedMemoryRegion | None:
        """Write ``arrays`` into the client's segment ``region`` names, then its
        header's generation as ``region.generation + 1`` (what the client checks);
        the region of the reply, or None when they do not fit (the reply then
        carries them inline). A resent call writes them again."""
        what = "reply_region"
        itemsize = one_itemsize(a.dtype for a in arrays)
        offsets, size = layout([a.nbytes for a in arrays], itemsize)
        m = self._mapped(region.segment, region.key, caller, what)
        if size > len(m):
            return None
        if itemsize is not None and len(arrays) > 1:
            # packed back to back in one dtype: one copy of them all
            total = sum(a.size for a in arrays)
            flat = np.frombuffer(m, arrays[0].dtype, total, offsets[0])
            np.concatenate([a.reshape(-1) for a in arrays], out=flat)
            del flat
        else:
            for a, at in zip(arrays, offsets, strict=True):
                dest = np.frombuffer(m, a.dtype, a.size, at).reshape(a.shape)
                np.copyto(dest, a)
                del dest
        generation = region.generation + 1
        struct.pack_into("<Q", m, len(MAGIC), generation)
        return pb.SharedMemoryRegion(
            segment=region.segment, generation=generation, offsets=offsets
        )


def _check_generation(
    m: mmap.mmap, region: pb.SharedMemoryRegion, what: str, ahead: int = 0
) -> None:
    (generation,) = struct.unpack_from("<Q", m, len(MAGIC))
    if generation != region.generation + ahead:
        # The segment's generation stays out of the message: the caller has it.
        raise InvalidArgument(
            f"{what}: segment {region.segment!r} is not at the generation the call "
            "names (rewritten since, or a stale region): send the region of the "
            "segment as it is now",
            reason="STALE_SEGMENT",
            field=f"{what}.generation",
        )


def _check_allocated(name: str, st: os.stat_result, what: str) -> None:
    """Refuse a segment with holes (grown by ftruncate, not allocated): mapping it
    (``MAP_POPULATE``) would fill them in /dev/shm, memory the client never paid
    for that no budget counts, and writing X into a hole of a full /dev/shm would
    kill this process with SIGBUS. The client's segments are allocated whole
    (``posix_fallocate``), as docs/protocol.md asks of every client."""
    allocated = st.st_blocks * 512
    if allocated < st.st_size:
        raise InvalidArgument(
            f"{what}: segment {name!r} has {st.st_size} bytes, of which "
            f"{allocated} are allocated: allocate it whole (posix_fallocate) "
            "before a call names it",
            reason="BAD_SEGMENT",
            field=f"{what}.segment",
        )


def _not_yours(what: str, why: str) -> PermissionDenied:
    return PermissionDenied(f"{what}: {why}", reason="SEGMENT_NOT_YOURS")


def _uid_text(uid: int | None) -> str:
    return "unknown" if uid is None else str(uid)


def _check_span(
    m: mmap.mmap, at: int, nbytes: int, itemsize: int, name: str, what: str
) -> None:
    if at < HEADER_BYTES or at % itemsize or at + nbytes > len(m):
        raise InvalidArgument(
            f"{what}: {name} needs bytes [{at}, {at + nbytes}) of segment, which "
            f"holds {len(m)} (header {HEADER_BYTES}, offsets aligned to {itemsize}):"
            " the segment is truncated or the offset is wrong",
            reason="BAD_SEGMENT",
            field=f"{what}.offsets",
        )


def _packed(
    m: Any,
    dtype: np.dtype[Any],
    at: int,
    total: int,
    specs: Sequence[tuple[np.dtype[Any], tuple[int, ...]]],
) -> FlatArrays:
    """The tensors of ``specs``, back to back from ``at``, as views of one
    read-only flat array of ``total`` elements."""
    flat = np.frombuffer(m, dtype, total, at)
    flat.flags.writeable = False
    return FlatArrays(flat_views(flat, [dims for _, dims in specs]), flat)
