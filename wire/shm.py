"""The layout of a shared-memory segment, and the rules for naming and sweeping them.

The same-host transport moves tensor bytes through segments in /dev/shm; both ends
read this module, the one place the layout is written down:

- a segment is ``/dev/shm/onnxps-<pid>-<random hex>``, mode 0600, created with
  O_EXCL by the client whose pid it names;
- it begins with a 64-byte header: ``MAGIC``, then the little-endian uint64
  generation, bumped by whoever last wrote tensors into it, and at ``KEY_AT`` the
  segment's random key (``KEY_BYTES``), which every call naming the segment
  carries: only a process that can read the segment knows it, and the server
  serves a segment only to the token (and uid) of the first call that named it
  with its key;
- tensors follow at the offsets the region of a call names, raw little-endian C
  order; ``layout`` (what both ends write) puts the first at byte 64 and, when
  every tensor has one dtype, the others back to back (each at a multiple of its
  item size), so that a group's tensors are one flat span a reader can take as one
  array; tensors of mixed dtypes start at 64-byte aligned offsets.

A segment whose owner died is an orphan: ``sweep_orphans`` unlinks segments of dead
pids, so a ``kill -9`` of either side leaves nothing behind once the survivor notices.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "HEADER_BYTES",
    "KEY_AT",
    "KEY_BYTES",
    "MAGIC",
    "NONCE_BYTES",
    "PREFIX",
    "SHM_DIR",
    "is_onnxps_name",
    "layout",
    "new_key",
    "no_shared_dir",
    "one_itemsize",
    "owner_problem",
    "pid_namespace",
    "sweep_orphans",
]

log = logging.getLogger("onnxps.shm")

SHM_DIR = "/dev/shm"
PREFIX = "onnxps-"
MAGIC = b"ONNXPSM1"
HEADER_BYTES = 64
NONCE_BYTES = 32
KEY_AT = 48  # after a hello's magic, nonce and pid namespace
KEY_BYTES = 16
_ALIGN = 64
_NAME = re.compile(r"onnxps-[A-Za-z0-9-]{1,200}\Z")
_OWNER = re.compile(r"onnxps-(\d+)-")


def is_onnxps_name(name: str) -> bool:
    """A segment name this transport uses: ``onnxps-`` then [A-Za-z0-9-] (no path)."""
    return bool(_NAME.match(name))


def new_key() -> bytes:
    """A random segment key (see ``KEY_AT``)."""
    return secrets.token_bytes(KEY_BYTES)


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def layout(nbytes: Sequence[int], itemsize: int | None = None) -> tuple[list[int], int]:
    """The offsets of tensors of these sizes in a segment, and the segment's size.

    With ``itemsize`` (every tensor has a dtype of that size, so each size is a
    multiple of it) the tensors are packed back to back after the header: one
    contiguous span, every tensor still aligned to its item size. Without it each
    starts at a 64-byte aligned offset."""
    offsets = []
    at = HEADER_BYTES
    align = _ALIGN if itemsize is None else itemsize
    for n in nbytes:
        offsets.append(at)
        at += -(-n // align) * align
    return offsets, max(at, HEADER_BYTES)


def one_itemsize(dtypes: Iterable[np.dtype[Any]]) -> int | None:
    """The item size shared by arrays of ``dtypes`` when they are all one dtype
    (``layout`` packs them), else None."""
    first = None
    for d in dtypes:
        if first is None:
            first = d
        elif d != first:
            return None
    return None if first is None else int(first.itemsize)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def sweep_orphans(directory: str = SHM_DIR) -> list[str]:
    """Unlink this user's onnxps segments whose creator is no longer alive; the
    names removed."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = os.geteuid()
    for name in names:
        owner = _OWNER.match(name)
        if owner is None or _pid_alive(int(owner.group(1))):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            if os.lstat(path).st_uid != uid:
                continue
            os.unlink(path)
            removed.append(name)
    if removed:
        log.info("removed %d orphaned shared-memory segments", len(removed))
    return removed


def no_shared_dir(exc: OSError) -> bool:
    """An error that says this host has no usable /dev/shm."""
    return exc.errno in (errno.ENOENT, errno.EACCES, errno.EROFS, errno.ENOSPC)


def owner_problem(st: os.stat_result) -> str | None:
    """Why a segment's file may not be used by this process, or None."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return (
            f"belongs to uid {st.st_uid}, not to this server's uid {os.geteuid()}; "
            "shared memory is for a client of the same user"
        )
    return None
