"""Which kernel path a ``Stepper`` takes: NumPy, or numba's fused loops.

``ONNXPS_KERNELS`` chooses: ``auto`` (the default) takes the fused path when numba
imports and compiles, ``numpy`` always takes the NumPy path, ``numba`` takes the fused
path or fails with the reason. Both paths give the same bits. The first use compiles
the fused kernels (2 to 20 s) or loads them from numba's on-disk cache (1 to 3 s,
half of it importing numba) and logs which path is in use, once. Once loaded,
LLVM's pages go back to the kernel (``onnxps.wire._pageout``): the kernels run
without it.

A server does not wait for that: ``load_in_background`` loads them on a thread
while it restores its data and joins its replica set, and until they are loaded
``current_path`` answers None on the auto path: a ``Stepper`` steps with NumPy (the
same bits) and takes the fused kernels at its first step after they are in. An
explicit ``numba`` waits for them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from onnxps.wire._pageout import page_out

__all__ = [
    "ENV",
    "KERNEL_PATHS",
    "current_path",
    "fused_kernels",
    "kernel_path",
    "load_in_background",
]

ENV = "ONNXPS_KERNELS"
KERNEL_PATHS = ("numpy", "numba")
_CHOICES = ("auto", *KERNEL_PATHS)

log = logging.getLogger("onnxps.kernels")

_lock = threading.Lock()
_loaded = False
_kernels: dict[str, Callable[..., Any]] | None = None
_failure = ""
_logged: set[str] = set()
_loading: threading.Thread | None = None  # load_in_background's
_start_lock = threading.Lock()


def fused_kernels() -> dict[str, Callable[..., Any]] | None:
    """numba's compiled kernels by operator, or None when numba cannot give them."""
    global _loaded, _kernels, _failure
    with _lock:
        if not _loaded:
            start = time.perf_counter()
            try:
                from . import _numba

                _kernels = _numba.load()
                page_out()  # LLVM's code, not needed again until a compile
            except ImportError as exc:
                _failure = f"numba is not installed ({exc})"
            except Exception as exc:  # noqa: BLE001 - any compile failure: say it
                _failure = f"numba failed to compile the kernels: {exc!r}"
            else:
                import numba

                note = _numba.cache_note(_kernels)
                level = logging.WARNING if "no writable" in note else logging.INFO
                log.log(
                    level,
                    "onnxps kernels: numba %s fused kernels ready in %.2f s (%s)",
                    numba.__version__,
                    time.perf_counter() - start,
                    note,
                )
            _loaded = True
        return _kernels


def load_in_background() -> None:
    """Load the fused kernels on a thread now, unless ``ONNXPS_KERNELS`` says numpy
    (or nothing it knows: ``kernel_path`` says so when asked) or a load began."""
    global _loading
    try:
        choice = _choice(None)[1]
    except ValueError:
        return
    with _start_lock:
        if choice == "numpy" or _loaded or _loading is not None:
            return
        _loading = threading.Thread(
            target=fused_kernels, name="onnxps-kernels", daemon=True
        )
        _loading.start()


def current_path(requested: str | None = None) -> str | None:
    """``kernel_path(requested)``, or None (NumPy for now: ask again later) while
    ``load_in_background``'s load runs and the choice is auto. Never waits for it."""
    if not _loaded and _loading is not None and _choice(requested)[1] == "auto":
        if "loading" not in _logged:
            _logged.add("loading")
            log.info("onnxps kernels: NumPy path until the fused kernels are loaded")
        return None
    return kernel_path(requested)


def _choice(requested: str | None) -> tuple[str, str]:
    """(where the choice came from, the choice); ValueError for an unknown one."""
    source = "kernels=" if requested is not None else f"{ENV}="
    choice = requested if requested is not None else os.environ.get(ENV, "")
    choice = choice.strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(
            f"{source}{choice!r} is not a kernel path: expected one of "
            f"{', '.join(_CHOICES)}"
        )
    return source, choice


def kernel_path(requested: str | None = None) -> str:
    """``"numpy"`` or ``"numba"``: ``requested``, else ``ONNXPS_KERNELS``, else auto.

    Raises ValueError for an unknown choice and RuntimeError when ``numba`` is asked
    for and cannot be had. Waits for the fused kernels when they are being loaded.
    """
    source, choice = _choice(requested)
    path = choice
    if choice != "numpy":
        path = "numba" if fused_kernels() is not None else "numpy"
        if choice == "numba" and path != "numba":
            raise RuntimeError(
                f"{source}numba, but {_failure}: install it with "
                "pip install 'onnxps[fast]', or choose auto or numpy"
            )
    _log_once(path, choice, source)
    return path


def _log_once(path: str, choice: str, source: str) -> None:
    if path in _logged:
        return
    _logged.add(path)
    if path == "numba":
        log.info("onnxps kernels: fused numba path (%s%s)", source, choice)
    elif choice == "numpy":
        log.info("onnxps kernels: NumPy path (%snumpy)", source)
    else:
        log.info(
            "onnxps kernels: NumPy path (%s; pip install 'onnxps[fast]' for the "
            "fused path)",
            _failure,
        )
