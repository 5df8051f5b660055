"""Serving on a Unix domain socket (``unix:PATH``, ``unix:///ABSOLUTE``).

The server owns its socket file: a stale one (left by a server that was killed) is
removed at start only when nobody answers on it, a live one is refused with a clear
message, the new socket is created with ``unix_socket_mode`` permissions (no moment
with wider ones: the umask is tightened around the bind), and the file is removed
when the server stops. The file's permissions are the socket's access control; TLS
and tokens work over it as over TCP.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["UnixSocket", "socket_mode", "unix_path"]

log = logging.getLogger("onnxps.server")

_UMASK_LOCK = threading.Lock()  # the umask is per process


def socket_mode(text: str) -> int | None:
    """``unix_socket_mode`` as permission bits (None when it is not 0..0777 octal)."""
    try:
        mode = int(text, 8)
    except ValueError:
        return None
    return mode if 0 <= mode <= 0o777 else None


def unix_path(address: str) -> str | None:
    """The file of a ``unix:`` address (gRPC's forms: ``unix:relative``,
    ``unix:/absolute``, ``unix:///absolute``); None for anything else."""
    if not address.startswith("unix:"):
        return None
    path = address[len("unix:") :]
    if path.startswith("//"):
        path = path[2:]  # unix://  + /absolute
    return path or None


def _listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return False
            raise
        return True


@dataclass
class UnixSocket:
    """The socket file of a server listening on ``unix:PATH``."""

    address: str
    path: str
    mode: int
    inode: int | None = None

    @classmethod
    def of(cls, address: str, mode_text: str) -> UnixSocket | None:
        path = unix_path(address)
        mode = socket_mode(mode_text)
        if path is None or mode is None:
            return None
        return cls(address, path, mode)

    def _clear_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(
                errno.EEXIST,
                f"cannot listen on {self.address}: {self.path} exists and is not a "
                "socket (remove it, or pass another --address)",
            )
        if _listening(self.path):
            raise OSError(
                errno.EADDRINUSE,
                f"cannot listen on {self.address}: a server is already listening on "
                f"{self.path} (is another onnxps running? pass another --address)",
            )
        os.unlink(self.path)
        log.info("removed the stale socket %s (nobody listened on it)", self.path)

    def bind(self, bind: Callable[[], int]) -> int:
        """Clear a stale socket, run ``bind`` with the mode in force, record the
        file (removed by ``remove``)."""
        self._clear_stale()
        with _UMASK_LOCK:
            old = os.umask(0o777 & ~self.mode)
            try:
                port = bind()
            finally:
                os.umask(old)
        os.chmod(self.path, self.mode)
        self.inode = os.lstat(self.path).st_ino
        return port

    def remove(self) -> None:
        """Unlink the socket, if it is still the one this server created."""
        if self.inode is None:
            return
        with contextlib.suppress(OSError):
            if os.lstat(self.path).st_ino == self.inode:
                os.unlink(self.path)
        self.inode = None
