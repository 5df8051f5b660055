"""How the serving process gives memory that glibc's malloc keeps back.

gRPC receives a large message in ~1 MiB slices and a streamed push in 1 MiB chunks.
glibc serves such blocks from its heaps once its mmap threshold has grown past them
(it grows each time a large mmap'd block is freed) and keeps them there when they
are freed, one heap per thread that allocated: a server's RSS grew by a copy of X
after its first push returning X and kept it for good (benchmarks/small_calls.py
``memory``). Fixing the threshold low sends every chunk to mmap and back, which cost
1.5-2x the server CPU of a 64 MiB streamed call (benchmarks/refactor_ab.py); so the
threshold stays glibc's, and a background thread hands freed heap memory back
(``malloc_trim``) when the process has grown since it last did, at most every few
seconds. A few heaps bound what the threads keep in the meantime.

The thresholds are then fixed where that trimmer does the work: blocks under 32
MiB (glibc's own ceiling for its moving threshold) come from the heaps, and glibc
trims a heap's top itself only past 256 MiB free. Left moving, they put a call's
800 KB buffers to mmap and back on every call in some servers and not others,
depending on what each had allocated before (about 750 minor page faults and twice
the server CPU per 200 x 1,000 push + pull over TCP; benchmarks/many_tensors_ab.py
``--no-flags-over-tcp``). ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_``
set by the operator leaves both as glibc has them.

Only ``onnxps serve`` (the process that owns its allocator) calls ``tune``; a
library embedding ``create_server`` keeps its own settings. ``MALLOC_ARENA_MAX`` set
by the operator wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from typing import Any

__all__ = [
    "ARENA_MAX",
    "TRIM_GROWTH",
    "TRIM_SECONDS",
    "Trimmer",
    "private_bytes",
    "rss_bytes",
    "tune",
]

log = logging.getLogger("onnxps.server")

ARENA_MAX = 4
TRIM_SECONDS = 2.0  # how often the trimmer looks
TRIM_GROWTH = 32 << 20  # RSS grown this much since the last trim: trim
_M_ARENA_MAX = -8  # glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its moving threshold
TRIM_THRESHOLD = 256 << 20


def _libc() -> Any | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc has both
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    return libc


def rss_bytes() -> int:
    """This process's resident set size (0 where /proc does not say)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def private_bytes() -> int:
    """This process's resident memory that is its own (RSS less its shared pages:
    libraries, and clients' shared-memory segments it maps, which malloc never
    held); 0 where /proc does not say."""
    try:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Trimmer:
    """A daemon thread that calls ``malloc_trim(0)`` when this process's own
    memory (``private_bytes``) grew by ``growth`` bytes since the last trim,
    looking every ``seconds``. Shared pages are left out: a client's segment
    mapped for a call is no heap memory, and counting it made every large
    shared-memory call look like growth (a trim for nothing)."""

    def __init__(
        self, libc: Any, seconds: float = TRIM_SECONDS, growth: int = TRIM_GROWTH
    ) -> None:
        self._libc = libc
        self.seconds = seconds
        self.growth = growth
        self.trims = 0
        self._stop = threading.Event()
        self._floor = private_bytes()
        self._thread = threading.Thread(
            target=self._run, name="onnxps-malloc-trim", daemon=True
        )

    def start(self) -> Trimmer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def check(self) -> bool:
        """Trim now if this process's own memory grew enough since the last
        trim; whether it did."""
        if private_bytes() < self._floor + self.growth:
            return False
        self._libc.malloc_trim(0)
        self._floor = private_bytes()
        self.trims += 1
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.seconds):
            self.check()


def tune() -> Trimmer | None:
    """Bound glibc's heaps and start the trimmer (None where glibc is not the
    allocator)."""
    libc = _libc()
    if libc is None:
        return None
    if "MALLOC_ARENA_MAX" not in os.environ:
        libc.mallopt(_M_ARENA_MAX, ARENA_MAX)
    if not {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(os.environ):
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    log.debug("malloc: %d heaps at most, trimmed as RSS grows", ARENA_MAX)
    return Trimmer(libc).start()
