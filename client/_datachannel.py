"""The client's side of the data channel: tensor bytes on a socket beside gRPC.

A server started with ``--data-port`` hands out single-use tickets
(``DataChannelHello``); the client connects to that port on the server's host,
presents the ticket and gets a channel id. A push or pull then names the channel
and a transfer id in its gRPC request, and the tensors' bytes travel as one frame
on the socket: the little-endian uint64 transfer id, the uint64 byte count, then
the tensors back to back. The wire format is in the proto, beside
``DataChannelHelloRequest``; the server's side is
``onnxps.server.transports._datachannel``.

A channel carries one call at a time; the client keeps idle ones for the next
calls and closes a channel whenever a call on it fails.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import ssl
import struct
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from onnxps.wire.codec import TensorFormatError, frame_bytes
from onnxps.wire.encoding import widen_into
from onnxps.wire.frames import (
    CHANNEL_ID_BYTES,
    DATA_FRAME,
    DATA_MAGIC,
    close_socket,
    recv_exact,
)

__all__ = [
    "ChannelBroken",
    "ChannelPool",
    "ChannelRefused",
    "DataChannel",
    "connect",
    "split_frame",
    "tls_context",
]

Array = np.ndarray[Any, Any]

MAGIC = DATA_MAGIC
FRAME = DATA_FRAME
IDLE_CHANNELS = 4
# Elements widened at a time as an encoded frame lands.
WIDEN_BLOCK_ELEMENTS = 1 << 19


class ChannelRefused(Exception):
    """The server refused the connection (its one-line reason)."""


class ChannelBroken(Exception):
    """A data channel failed in a call without the call saying why (the server
    went away, or the socket broke): the operation falls back to gRPC."""


class DataChannel:
    """One connection: frames out and in, for one call at a time."""

    def __init__(self, sock: socket.socket, channel_id: bytes) -> None:
        self.sock = sock
        self.id = channel_id
        self._transfers = itertools.count(1)
        self.closed = False

    def next_transfer(self) -> int:
        return next(self._transfers)

    def close(self) -> None:
        self.closed = True
        close_socket(self.sock)

    def send_frame(
        self, transfer_id: int, arrays: Sequence[Array], timeout: float | None
    ) -> None:
        self.sock.settimeout(timeout)
        self.sock.sendall(FRAME.pack(transfer_id, sum(a.nbytes for a in arrays)))
        for part in frame_bytes(arrays):  # a deferred encoding: as it goes out
            self.sock.sendall(part)

    def recv_frame(
        self,
        transfer_id: int,
        timeout: float | None,
        into: Sequence[Array] | None,
        widen: int = 0,
        widen_dtype: np.dtype[Any] | None = None,
    ) -> Array | list[Array]:
        """The frame of ``transfer_id``: into ``into`` (C-contiguous arrays whose
        sizes add up to the frame's) and returned, else one uint8 buffer. With
        ``widen`` (an encoding), the frame holds 2-byte values, widened into
        ``into`` (else, with ``widen_dtype``, into one new 1-D array of that
        dtype, returned alone in a list) block by block as they land."""
        self.sock.settimeout(timeout)
        header = bytearray(FRAME.size)
        self._fill(memoryview(header))
        got_id, nbytes = FRAME.unpack(header)
        if got_id != transfer_id:
            raise ChannelBroken(
                f"the data channel sent the frame of transfer {got_id}, this call is "
                f"transfer {transfer_id}"
            )
        if widen and into is not None and sum(a.size * 2 for a in into) == nbytes:
            self._widen_into(into, widen)
            return list(into)
        if widen and into is None and widen_dtype is not None and nbytes % 2 == 0:
            flat = np.empty(nbytes // 2, widen_dtype)
            self._widen_into([flat], widen)
            return [flat]
        if not widen and into is not None and sum(a.nbytes for a in into) == nbytes:
            for a in into:
                self._fill(memoryview(a.reshape(-1)).cast("B"))  # type: ignore[arg-type]
            return list(into)
        buf = np.empty(nbytes, np.uint8)
        self._fill(memoryview(buf))  # type: ignore[arg-type]
        return buf

    def _widen_into(self, into: Sequence[Array], code: int) -> None:
        stage = np.empty(
            min(WIDEN_BLOCK_ELEMENTS, max(a.size for a in into) or 1), "<u2"
        )
        for a in into:
            flat = a.reshape(-1)
            for start in range(0, flat.size, stage.size):
                part = stage[: min(stage.size, flat.size - start)]
                self._fill(memoryview(part.view(np.uint8)))  # type: ignore[arg-type]
                widen_into(flat[start : start + part.size], part, code)

    def _fill(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:], len(view) - got)
            if n == 0:
                raise ChannelBroken(
                    f"the server closed the data channel after {got} of {len(view)} "
                    "bytes"
                )
            got += n


def tls_context(
    root_certificates: bytes | None,
    private_key: bytes | None,
    certificate_chain: bytes | None,
) -> ssl.SSLContext:
    """TLS for a channel, as the client's gRPC channel has it: the server checked
    against ``root_certificates`` (else the system's), this client's certificate
    presented when it has one (mutual TLS)."""
    ctx = ssl.create_default_context(
        cadata=root_certificates.decode() if root_certificates else None
    )
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if private_key and certificate_chain:
        # ssl reads a certificate and key from files only: a private directory
        # holds them for the moment it takes.
        with tempfile.TemporaryDirectory(prefix="onnxps-tls-") as d:
            cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
            for path, data in ((cert, certificate_chain), (key, private_key)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            ctx.load_cert_chain(cert, key)
    return ctx


def connect(
    host: str,
    port: int,
    ticket: bytes,
    timeout: float,
    tls: ssl.SSLContext | None = None,
    server_name: str | None = None,
    magic: bytes = MAGIC,
) -> DataChannel:
    """Open a channel: connect (TLS with ``tls``, the server's certificate checked
    for ``server_name`` or ``host``), present ``ticket``, read the channel id."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=server_name or host)
        sock.sendall(magic + ticket)
        status = _recv_exact(sock, 1)
        if status == b"\x00":
            return DataChannel(sock, _recv_exact(sock, CHANNEL_ID_BYTES))
        (length,) = struct.unpack("<H", _recv_exact(sock, 2))
        reason = _recv_exact(sock, length).decode(errors="replace")
        raise ChannelRefused(reason)
    except BaseException:
        sock.close()
        raise


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    got = recv_exact(sock, n)
    if got is None:
        raise ChannelBroken("the server closed the data channel while connecting")
    return bytes(got)


def split_frame(
    buf: Array, specs: Sequence[tuple[np.dtype[Any], Sequence[int]]]
) -> list[Array]:
    """The arrays of a frame received whole: views of ``buf`` in order."""
    arrays = []
    at = 0
    for dtype, dims in specs:
        count = math.prod(dims)
        end = at + count * dtype.itemsize
        if end > buf.size:
            raise TensorFormatError(
                f"the data channel frame holds {buf.size} bytes; the reply's tensors "
                f"need {end} or more"
            )
        arrays.append(buf[at:end].view(dtype).reshape(tuple(dims)))
        at = end
    if at != buf.size:
        raise TensorFormatError(
            f"the data channel frame holds {buf.size} bytes; the reply's tensors {at}"
        )
    return arrays


class ChannelPool:
    """A client's idle channels to one server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[DataChannel] = []

    def take(self) -> DataChannel | None:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def give_back(self, ch: DataChannel) -> None:
        if ch.closed:
            return
        with self._lock:
            if len(self._idle) < IDLE_CHANNELS:
                self._idle.append(ch)
                return
        ch.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for ch in idle:
            ch.close()
