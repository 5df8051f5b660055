"""Handing numba's compiler back to the kernel once onnxps's loops are compiled.

Importing numba maps LLVM (llvmlite's ``libllvmlite.so``, 170 MiB on disk), and its
start-up and a compile or cache load touch 90-100 MiB of it: clean, file-backed
pages that stay in the process's resident set for good although nothing runs
them again until the next compile (a compiled kernel is machine code of its own,
called without LLVM). On a server holding 768 MiB of state that is 0.12x of it,
the difference between meeting and missing its memory aim
(``benchmarks/small_calls.py --sections memory``).

``page_out()`` asks the kernel to reclaim those pages (``madvise(MADV_PAGEOUT)``,
Linux 5.4 and later): it keeps every page's contents (a page written since the
library was loaded stays; a clean one is read back from the file when touched
again), so it is safe whatever runs next, and a page another process maps stays
too. onnxps calls it after each of its own numba loads and compiles (the fused
kernels, a row kernel's first compile, the encoding loops); elsewhere, or before
Linux 5.4, it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import Any

__all__ = ["LIBRARY", "page_out"]

log = logging.getLogger("onnxps.kernels")

LIBRARY = "libllvmlite"  # the file name's start: llvmlite's one shared library
_MADV_PAGEOUT = 21  # linux/mman.h
_libc: list[Any] = []


def _mappings() -> list[tuple[int, int]]:
    """(start, stop) of every mapping of LLVM's library in this process."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].rsplit("/", 1)[-1].startswith(LIBRARY):
            start, _, stop = fields[0].partition("-")
            found.append((int(start, 16), int(stop, 16)))
    return found


def page_out() -> int:
    """Ask the kernel to reclaim the resident pages of LLVM's library; the bytes of
    the mappings advised (0 when llvmlite is not loaded or the kernel refuses)."""
    if "llvmlite" not in sys.modules or not sys.platform.startswith("linux"):
        return 0
    if not _libc:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.append(libc)
    advised = 0
    for start, stop in _mappings():
        if _libc[0].madvise(start, stop - start, _MADV_PAGEOUT) != 0:
            log.debug(
                "madvise(MADV_PAGEOUT) on LLVM's pages failed: errno %d",
                ctypes.get_errno(),
            )
            return advised
        advised += stop - start
    return advised
