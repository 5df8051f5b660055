"""The progress of ``onnxps export`` and ``import`` of model weights: a bar on a
terminal (one line, redrawn, as ``onnxps demo`` draws its own), a plain line every
few seconds anywhere else; shown for big models only, unless asked."""

from __future__ import annotations

import shutil
import time
from typing import TextIO

__all__ = ["BIG", "BytesProgress", "size"]

BIG = 64 * 1024 * 1024  # bytes moved (twice the model: pull and write, read and send)


def size(n: int) -> str:
    """``512 B``, ``1.5 KiB``, ``120.0 MiB``, ``2.3 GiB``."""
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


class BytesProgress:
    """``progress(done, total)`` for ``Client.export``/``import_``: shown when
    ``shown`` is True, or when it is None and ``total`` is at least ``BIG``."""

    def __init__(
        self,
        out: TextIO,
        shown: bool | None = None,
        tty: bool | None = None,
        every: float = 2.0,
    ) -> None:
        self.out = out
        self.shown = shown
        self.tty = out.isatty() if tty is None else tty
        self.every = 0.1 if self.tty else every
        self.start = time.monotonic()
        self._last = -1e9
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        if self.shown is None:
            self.shown = total >= BIG
        if not self.shown:
            return
        now = time.monotonic()
        final = done >= total
        if not final and now - self._last < self.every:
            return
        self._last = now
        text = self.line(done, total, now - self.start)
        if self.tty:
            self.out.write("\r\x1b[K" + text + ("\n" if final else ""))
        else:
            self.out.write(text + "\n")
        self._drawn = not final
        self.out.flush()

    def line(self, done: int, total: int, elapsed: float) -> str:
        frac = min(1.0, done / total) if total else 1.0
        stats = f"{100 * frac:3.0f}%  {size(done)}/{size(total)}  {elapsed:.1f}s"
        if not self.tty:
            return f"progress {stats}"
        room = shutil.get_terminal_size((80, 24)).columns - 1
        width = min(30, room - len(stats) - 3)
        if width < 5:
            return stats[:room]
        filled = int(width * frac)
        return f"[{'#' * filled}{'.' * (width - filled)}] {stats}"[:room]

    def close(self) -> None:
        """End a bar left drawn by a failure, so the error line starts clean."""
        if self._drawn and self.tty:
            self.out.write("\n")
            self.out.flush()
        self._drawn = False
