"""How the serving process asks glibc's malloc to give memory back.

gRPC receives a large message in ~1 MiB slices and a streamed push in 1 MiB chunks.
glibc serves such blocks from its heaps once its mmap threshold has grown past them
(it grows each time a large mmap'd block is freed) and keeps them there after they
are freed, one heap per thread that allocated: a server's RSS grew by a copy of X
after its first push returning X and kept it for good (benchmarks/small_calls.py
``memory``). A fixed threshold of 256 KiB sends every such block to mmap, so it goes
back to the system when freed, and a few heaps bound what small blocks keep.

Only ``onnxps serve`` (the process that owns its allocator) calls ``tune``; a
library embedding ``create_server`` keeps its own settings. The environment wins:
``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_ARENA_MAX`` set by the operator leave it be.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

__all__ = ["ARENA_MAX", "MMAP_THRESHOLD", "tune"]

log = logging.getLogger("onnxps.server")

MMAP_THRESHOLD = 256 << 10
ARENA_MAX = 4
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_M_ARENA_MAX = -8


def tune() -> dict[str, int]:
    """Set the mmap threshold and the number of heaps where glibc is the allocator
    and the environment does not set them; what was set."""
    name = ctypes.util.find_library("c")
    if name is None:
        return {}
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return {}
    done = {}
    for env, param, value in (
        ("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        ("MALLOC_ARENA_MAX", _M_ARENA_MAX, ARENA_MAX),
    ):
        if env not in os.environ and mallopt(param, value) == 1:
            done[env] = value
    log.debug("malloc: %s", done)
    return done
