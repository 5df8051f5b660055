"""The data channel: tensor bytes on a plain TCP connection beside gRPC.

gRPC Python moves about 1 GB/s of stream chunks on this machine; a socket moves a
NumPy buffer with ``sendall``/``recv_into`` at about three times that. So a client
may ask (``DataChannelHello``, an ordinary authenticated RPC) for a single-use
ticket, connect to ``--data-port`` and present it; after that a Push or Pull names
the channel (``DataTransfer``) and its tensors' bytes travel on the socket as one
frame, while the gRPC call carries everything else (validation, statuses, exactly
once, the WAL: all unchanged). The wire format is in the proto, beside
``DataChannelHelloRequest``.

Rules that keep it simple:

- A channel serves one call at a time (another gets FAILED_PRECONDITION
  ``DATA_CHANNEL_BUSY``) and only calls made with the hello's token
  (``DATA_CHANNEL_UNKNOWN`` otherwise, as for an id that does not exist).
- Transfer ids grow on a channel: a call whose id is not above the last one
  (a transparent gRPC retry of a call that already ran) is refused with
  ``DATA_TRANSFER_STALE`` before anything is read, and the client resends the
  push over gRPC with the same seq (exactly once).
- Any failure in a call that uses a channel (a refusal, a short frame, a
  deadline, a cancelled call) closes the channel: where its byte stream stands
  is then unknown. The client opens another.
- With TLS (``--tls-cert``), every channel is TLS with the server's certificate,
  and with ``--tls-client-ca`` the client's certificate is required, as for gRPC.
- Handshakes run on short-lived threads, at most ``MAX_PENDING_HANDSHAKES`` at
  once and ``MAX_HANDSHAKES_PER_ADDRESS`` from one address, each with
  ``HANDSHAKE_SECONDS`` in all (TLS and preamble: a client that drips a byte at a
  time is cut off all the same); a new connection that finds no slot takes that of
  the oldest handshake that has had ``HANDSHAKE_GRACE_SECONDS`` (``_handshakes``),
  so silent connections cannot keep out clients with tickets. Tickets expire, and
  a reaper closes idle channels whose client went away (and the oldest idle ones
  beyond ``MAX_CHANNELS``), however many file descriptors the process has. Bytes
  waiting on an idle channel are a frame whose call has not reached its handler
  yet (a client sends both at once): the channel is closed for them only after
  ``UNASKED_SECONDS``.
- A frame that carries no byte for ``stall_seconds`` (either way: a client that
  stops sending, or stops reading) ends its call with DEADLINE_EXCEEDED, whether
  the call has a deadline or not.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets
import selectors
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from onnxps.wire.codec import DeferredEncoding, frame_bytes, widen_into
from onnxps.wire.frames import (
    CALL_MAGIC,
    CHANNEL_ID_BYTES,
    DATA_FRAME,
    DATA_MAGIC,
    TICKET_BYTES,
    close_socket,
)

from ..errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from ..store._waits import CallCancelled
from ._handshakes import Handshake, Handshakes

__all__ = [
    "MAGIC",
    "ChannelTable",
    "DataChannel",
    "DataChannels",
    "listen",
    "principal_of",
    "tls_context",
]

log = logging.getLogger("onnxps.datachannel")

Array = np.ndarray[Any, Any]

MAGIC = DATA_MAGIC
FRAME = DATA_FRAME  # transfer id, byte count
TICKET_SECONDS = 10.0
HANDSHAKE_SECONDS = 5.0
MAX_PENDING_HANDSHAKES = 64
MAX_HANDSHAKES_PER_ADDRESS = 32
# A handshake this young keeps its slot; an older one gives it to a new connection
HANDSHAKE_GRACE_SECONDS = 1.0
MAX_CHANNELS = 1024
# Call channels at once (``_frames``): each holds a thread while open; beyond
# this a client is refused and sends its calls over gRPC
MAX_CALL_CHANNELS = 64
_POLL = 0.25  # seconds between checks of a call's deadline and cancellation
_BLOCK = 4 << 20  # bytes received before the landed elements are checked
STALL_SECONDS = 30.0  # no byte of a frame for this long ends its call
REAP_SECONDS = 1.0  # between rounds of the reaper
# an idle channel holding bytes no call asked for is closed after this (a frame
# whose gRPC call is late comes first; its call takes the channel well within it)
UNASKED_SECONDS = 10.0


def tls_context(cert: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    """The data channel's TLS: the gRPC server's certificate and client CA."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if client_ca:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(client_ca)
    return ctx


def principal_of(metadata: Any) -> str:
    """Who made a call, for binding channels to it: a digest of its bearer token
    ("" without one)."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            return hashlib.sha256(text.encode()).hexdigest()
    return ""


class DataChannel:
    """One client's connection: frames in and out, one call at a time."""

    def __init__(
        self,
        sock: socket.socket,
        principal: str,
        peer: str,
        stall_seconds: float = STALL_SECONDS,
    ) -> None:
        self.sock = sock
        self.principal = principal
        self.peer = peer
        self.stall_seconds = stall_seconds
        self.last_transfer = 0
        self.busy = False
        self.closed = False
        # when the reaper first found bytes waiting on it with no call (None: not)
        self.unasked_since: float | None = None

    def close(self) -> None:
        self.closed = True
        close_socket(self.sock)

    # -- frames --------------------------------------------------------------------
    def _recv_exact(
        self,
        view: memoryview,
        alive: Callable[[], bool],
        deadline: float | None,
        frame: tuple[int, int] | None = None,
    ) -> Iterator[int]:
        """Fill ``view``; yields the bytes landed so far after each block.
        ``frame``: where ``view`` starts in the frame and the frame's size (for
        the message when the frame is cut short)."""
        got = 0
        since = 0
        last = time.monotonic()  # when the last byte came
        while got < len(view):
            self._wait(alive, deadline, last, got, frame)
            try:
                n = self.sock.recv_into(view[got:], len(view) - got)
            except TimeoutError:
                continue
            if n == 0:
                at, total = frame or (0, len(view))
                raise InvalidArgument(
                    f"the data channel closed after {at + got} of {total} bytes of "
                    "this call's frame: the gradients are incomplete",
                    reason="DATA_FRAME_TRUNCATED",
                )
            got += n
            since += n
            last = time.monotonic()
            if since >= _BLOCK or got == len(view):
                since = 0
                yield got

    def _wait(
        self,
        alive: Callable[[], bool],
        deadline: float | None,
        last: float,
        got: int,
        frame: tuple[int, int] | None,
    ) -> None:
        """Raise if the call is over (cancelled, its deadline, or no byte since
        ``last`` for ``stall_seconds``: ``got`` bytes into ``frame``); else set
        the socket's timeout for the next receive."""
        if not alive():
            raise CallCancelled("the call was cancelled while its frame was arriving")
        now = time.monotonic()
        left = _POLL if deadline is None else deadline - now
        if left <= 0:
            raise DeadlineExceeded(
                "the call's deadline passed while its frame was arriving",
                reason="DATA_FRAME_DEADLINE",
            )
        if now - last >= self.stall_seconds:
            where = (
                "its header"
                if frame is None
                else f"byte {frame[0] + got} of {frame[1]}"
            )
            raise DeadlineExceeded(
                f"the data channel carried no byte of this call's frame for "
                f"{self.stall_seconds:g} s (at {where}; --stall-seconds): the call "
                "ended",
                reason="DATA_FRAME_STALLED",
            )
        self.sock.settimeout(min(left, _POLL))

    def read_header(
        self, transfer_id: int, alive: Callable[[], bool], deadline: float | None
    ) -> int:
        """The byte count of the frame of ``transfer_id`` (its header read)."""
        header = bytearray(FRAME.size)
        for _ in self._recv_exact(memoryview(header), alive, deadline):
            pass
        got_id, nbytes = FRAME.unpack(header)
        if got_id != transfer_id:
            raise InvalidArgument(
                f"the data channel's next frame is of transfer {got_id}, this call "
                f"names transfer {transfer_id}",
                reason="DATA_FRAME_MISMATCH",
            )
        return int(nbytes)

    def read_into(
        self,
        arrays: Sequence[Array],
        alive: Callable[[], bool],
        deadline: float | None,
        landed: Callable[[int, int], None],
        encodings: Sequence[int] = (),
    ) -> None:
        """Fill ``arrays`` (C-contiguous) in order from the frame's bytes;
        ``landed(i, elements)`` after each block of tensor i. Tensor i with a
        nonzero ``encodings[i]`` arrives as 2-byte values, widened into it block
        by block as they land."""
        total = sum(
            a.size * 2 if i < len(encodings) and encodings[i] else a.nbytes
            for i, a in enumerate(arrays)
        )
        at = 0
        stage: Array | None = None
        for i, a in enumerate(arrays):
            flat = a.reshape(-1)
            code = encodings[i] if i < len(encodings) else 0
            if not code:
                view = memoryview(flat.view(np.uint8))  # type: ignore[arg-type]
                for got in self._recv_exact(view, alive, deadline, (at, total)):
                    landed(i, got // a.itemsize)
                at += a.nbytes
                continue
            if stage is None:
                stage = np.empty(_BLOCK // 2, np.uint16)
            for start in range(0, flat.size, stage.size):
                part = stage[: min(stage.size, flat.size - start)]
                view = memoryview(part.view(np.uint8))  # type: ignore[arg-type]
                for _ in self._recv_exact(view, alive, deadline, (at, total)):
                    pass
                widen_into(flat[start : start + part.size], part, code)
                at += part.nbytes
                landed(i, start + part.size)

    def send(
        self,
        transfer_id: int,
        arrays: Sequence[Array | DeferredEncoding],
        deadline: float | None,
    ) -> None:
        """One frame: the header, then every array's bytes (a deferred encoding
        encoded block by block as it goes out)."""
        nbytes = sum(a.nbytes for a in arrays)
        self._send_all(memoryview(FRAME.pack(transfer_id, nbytes)), deadline)
        for part in frame_bytes(arrays):  # a deferred encoding: as it goes out
            self._send_all(part, deadline)

    def _send_all(self, data: memoryview, deadline: float | None) -> None:
        """Send ``data`` a block at a time: each block within the call's deadline
        and within ``stall_seconds`` (a client that stopped reading)."""
        for start in range(0, len(data), _BLOCK):
            left = self.stall_seconds
            if deadline is not None:
                left = min(left, deadline - time.monotonic())
            if left <= 0:
                raise DeadlineExceeded(
                    "the call's deadline passed while its frame was leaving",
                    reason="DATA_FRAME_DEADLINE",
                )
            self.sock.settimeout(left)
            try:
                self.sock.sendall(data[start : start + _BLOCK])
            except TimeoutError:
                raise DeadlineExceeded(
                    "the client stopped reading this call's frame on the data "
                    f"channel (a block of it was not taken within {left:g} s: the "
                    "call's deadline or --stall-seconds): the call ended",
                    reason="DATA_FRAME_STALLED",
                ) from None


def listen(host: str, port: int) -> socket.socket:
    """The data channel's listening socket on ``host:port`` (0: a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise OSError(
            exc.errno,
            f"cannot serve the data channel on {host}:{port}: "
            f"{exc.strerror or exc} (--data-port)",
        ) from None
    listener.listen(128)
    return listener


class ChannelTable:
    """The tickets and the open channels of one server: what its calls ask for
    (``hello``, ``use``), and what the listener (``DataChannels``) admits a
    connection into."""

    def __init__(self, port: int, *, call_channels: bool = False) -> None:
        self.port = port  # the listener's: a hello names it
        # whether call channels (CALL_MAGIC) are served (``_frames``)
        self.call_channels = call_channels
        self._lock = threading.Lock()
        self._tickets: dict[bytes, tuple[str, float, tuple[Any, ...]]] = {}
        self._call_socks: set[Any] = set()
        self._channels: dict[bytes, DataChannel] = {}
        self.calls = 0  # calls served on a channel (tests, logs)

    @property
    def open_channels(self) -> int:
        with self._lock:
            return len(self._channels)

    def hello(
        self, principal: str, metadata: Sequence[tuple[str, Any]] = ()
    ) -> tuple[int, bytes, float]:
        """A ticket for one connection of ``principal``: (port, ticket, seconds).
        ``metadata`` (the hello's) is what a call channel's calls carry."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = time.monotonic()
        with self._lock:
            for t in [t for t, (_, exp, _) in self._tickets.items() if exp < now]:
                del self._tickets[t]
            kept = tuple((k, v) for k, v in metadata)
            self._tickets[ticket] = (principal, now + TICKET_SECONDS, kept)
        return self.port, ticket, TICKET_SECONDS

    def admit(
        self, magic: bytes, ticket: bytes, sock: Any, peer: str, stall_seconds: float
    ) -> tuple[str, bytes | None, tuple[Any, ...] | None]:
        """A connection that presented ``ticket`` with ``magic``: (why it is
        refused or "", its channel id for a data channel, the hello's metadata
        for a call channel, then counted among the call channels)."""
        with self._lock:
            grant = self._tickets.pop(ticket, None)
            if grant is None or grant[1] < time.monotonic():
                why = "unknown, used or expired ticket: ask DataChannelHello again"
                return why, None, None
            if magic == CALL_MAGIC:
                if not self.call_channels:
                    return "no call channels here", None, None
                if len(self._call_socks) >= MAX_CALL_CHANNELS:
                    return (
                        f"{MAX_CALL_CHANNELS} call channels are open: use gRPC",
                        None,
                        None,
                    )
                self._call_socks.add(sock)
                return "", None, grant[2]
            channel_id = secrets.token_bytes(CHANNEL_ID_BYTES)
            self._channels[channel_id] = DataChannel(
                sock, grant[0], peer, stall_seconds
            )
            excess = len(self._channels) - MAX_CHANNELS
        if excess > 0:
            self._close_idle(excess)
        return "", channel_id, None

    def forget_call_channel(self, sock: Any) -> None:
        with self._lock:
            self._call_socks.discard(sock)

    def close(self) -> list[Any]:
        """Close every channel and forget every ticket; the call channels' sockets
        (for their listener to shut down)."""
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
            self._tickets.clear()
            call_socks, self._call_socks = list(self._call_socks), set()
        for ch in channels:
            ch.close()
        return call_socks

    # -- calls ---------------------------------------------------------------------
    @contextlib.contextmanager
    def use(
        self, channel_id: bytes, principal: str, transfer_id: int
    ) -> Iterator[DataChannel]:
        """The channel for one call; closed if the call fails."""
        with self._lock:
            ch = self._channels.get(channel_id)
            if ch is None or ch.principal != principal:
                raise FailedPrecondition(
                    "this data channel is not open on the server (closed after a "
                    "failed call, or of another token): open another "
                    "(DataChannelHello)",
                    reason="DATA_CHANNEL_UNKNOWN",
                )
            if ch.busy:
                raise FailedPrecondition(
                    "this data channel is carrying another call: a channel serves "
                    "one call at a time",
                    reason="DATA_CHANNEL_BUSY",
                )
            if transfer_id <= ch.last_transfer:
                self._channels.pop(channel_id, None)
                stale = True
            else:
                stale = False
                ch.busy = True
                ch.unasked_since = None
                ch.last_transfer = transfer_id
        if stale:
            ch.close()
            raise FailedPrecondition(
                f"transfer {transfer_id} is not above this channel's last "
                f"({ch.last_transfer}): a repeated call; nothing was read",
                reason="DATA_TRANSFER_STALE",
            )
        try:
            yield ch
        except BaseException:
            with self._lock:
                self._channels.pop(channel_id, None)
            ch.close()
            raise
        with self._lock:
            ch.busy = False
            self.calls += 1

    # -- housekeeping --------------------------------------------------------------
    def reap(self) -> None:
        """Close idle channels whose client hung up (readable at EOF), and those
        holding bytes no call has asked for after ``UNASKED_SECONDS``. (A client
        sends a push's frame as soon as it has started the gRPC call that names
        the channel: under load the frame comes first, and the call takes the
        channel once its handler runs.)"""
        with self._lock:
            idle = {ch.sock: key for key, ch in self._channels.items() if not ch.busy}
        if not idle:
            return
        # poll/epoll: select() cannot watch a descriptor above 1023
        with selectors.DefaultSelector() as sel:
            for sock in idle:
                with contextlib.suppress(ValueError, OSError):  # closed meanwhile
                    sel.register(sock, selectors.EVENT_READ, sock)
            readable: list[socket.socket] = [key.data for key, _ in sel.select(0)]
        now = time.monotonic()
        for sock in readable:
            hung_up = _at_eof(sock)
            with self._lock:
                ch = self._channels.get(idle[sock])
                if ch is None or ch.busy or ch.sock is not sock:
                    continue
                if not hung_up:  # a frame whose call has not come yet, or junk
                    if ch.unasked_since is None:
                        ch.unasked_since = now
                    if now - ch.unasked_since < UNASKED_SECONDS:
                        continue
                del self._channels[idle[sock]]
            ch.close()

    def _close_idle(self, count: int) -> None:
        with self._lock:
            idle = [k for k, ch in self._channels.items() if not ch.busy][:count]
            closing = [self._channels.pop(k) for k in idle]
        for ch in closing:
            ch.close()


class DataChannels:
    """The listener of one server's data channels: it accepts connections, runs
    their handshakes and admits them into its ``table``; call channels go to
    ``frame_calls`` (None: refused). A reaper closes the table's idle channels
    whose client went away and ends calls whose call channel closed."""

    def __init__(
        self,
        listener: socket.socket,
        table: ChannelTable,
        tls: ssl.SSLContext | None = None,
        *,
        frame_calls: Any = None,
        stall_seconds: float = STALL_SECONDS,
    ) -> None:
        self._listener = listener
        self.table = table
        self.frame_calls = frame_calls
        table.call_channels = frame_calls is not None
        self._tls = tls
        self._stall_seconds = stall_seconds
        self.handshakes = Handshakes(
            MAX_PENDING_HANDSHAKES, MAX_HANDSHAKES_PER_ADDRESS, HANDSHAKE_GRACE_SECONDS
        )
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def port(self) -> int:
        return self.table.port

    @property
    def calls(self) -> int:
        """Calls served on a data channel (tests, logs)."""
        return self.table.calls

    @property
    def open_channels(self) -> int:
        return self.table.open_channels

    def _close_idle(self, count: int) -> None:
        self.table._close_idle(count)

    def start(self) -> DataChannels:
        for target, name in (
            (self._accept_loop, "onnxps-data-accept"),
            (self._reap_loop, "onnxps-data-reap"),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info("data channel listening on port %d", self.port)
        return self

    def close(self) -> None:
        self._stopped.set()
        close_socket(self._listener)  # wakes the thread blocked in accept()
        for sock in self.table.close():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(timeout=2)

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return  # closed
            entry = self.handshakes.admit(sock, addr[0])
            if entry is None:
                _refuse(sock, "too many connections are shaking hands: retry")
                continue
            t = threading.Thread(
                target=self._handshake,
                args=(sock, f"{addr[0]}:{addr[1]}", entry),
                name="onnxps-data-hello",
                daemon=True,
            )
            t.start()

    def _handshake(self, sock: socket.socket, peer: str, entry: Handshake) -> None:
        deadline = time.monotonic() + HANDSHAKE_SECONDS  # for all of it
        serve_calls: tuple[Any, ...] | None = None
        try:
            sock.settimeout(HANDSHAKE_SECONDS)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:  # the same certificate (and client CA) as gRPC
                sock = self._tls.wrap_socket(
                    sock, server_side=True, do_handshake_on_connect=False
                )
                if not self.handshakes.rebind(entry, sock):
                    raise ConnectionError("cut off for a newer connection")
                # ssl's handshake takes the socket's timeout for all of it
                sock.do_handshake()
            preamble = _recv_all(sock, len(MAGIC) + TICKET_BYTES, deadline)
            if preamble is None:
                _refuse(
                    sock,
                    f"no complete preamble within {HANDSHAKE_SECONDS:g} s: a "
                    "handshake has that long in all",
                )
                return
            if not self.handshakes.finish(entry):  # its slot went to a newer one
                raise ConnectionError("cut off for a newer connection")
            magic = preamble[: len(MAGIC)]
            if magic not in (MAGIC, CALL_MAGIC):
                _refuse(sock, "not an onnxps data channel preamble (magic ONNXPSD1)")
                return
            ticket = preamble[len(MAGIC) :]
            why, channel_id, serve_calls = self.table.admit(
                magic, ticket, sock, peer, self._stall_seconds
            )
            if why:
                _refuse(sock, why)
                return
            if serve_calls is not None:  # served below, its handshake slot freed
                sock.sendall(b"\x00" + bytes(CHANNEL_ID_BYTES))
            else:
                assert channel_id is not None
                sock.sendall(b"\x00" + channel_id)
                log.debug("data channel opened for %s", peer)
        except OSError:  # ssl.SSLError too: a client without the right certificate
            if serve_calls is not None:  # counted among the call channels: no more
                self.table.forget_call_channel(sock)
                serve_calls = None
            sock.close()
        finally:
            self.handshakes.finish(entry)
        if serve_calls is not None:
            try:
                self.frame_calls.serve(sock, serve_calls, peer, self._stall_seconds)
            except OSError:
                log.debug("call channel of %s closed", peer)
            finally:
                self.table.forget_call_channel(sock)
                sock.close()

    # -- housekeeping --------------------------------------------------------------
    def _reap_loop(self) -> None:
        """Close idle channels whose client hung up (readable at EOF), and end
        the calls of call channels whose client closed them."""
        while not self._stopped.wait(REAP_SECONDS):
            try:
                if self.frame_calls is not None:  # their client closed the channel
                    self.frame_calls.watch()
                self.table.reap()
            except Exception:  # noqa: BLE001 - logged; the next round tries again
                log.exception("the data channel reaper failed; retrying")


def _recv_all(sock: socket.socket, n: int, deadline: float) -> bytes | None:
    """``n`` bytes, all of them by ``deadline`` (None: not in time). A peer that
    closes first is an ``OSError``."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        sock.settimeout(left)
        try:
            part = sock.recv(n - len(buf))
        except TimeoutError:
            return None
        if not part:
            raise ConnectionError("the peer closed the connection mid-handshake")
        buf += part
    return bytes(buf)


def _at_eof(sock: socket.socket) -> bool:
    """Whether readable ``sock``'s peer hung up (no byte waiting: its EOF, or an
    error), read without taking a byte (on a TLS socket: of the TCP stream)."""
    try:
        return not socket.socket.recv(sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    except OSError:
        return True


def _refuse(sock: socket.socket, why: str) -> None:
    data = why.encode()[:1000]
    with contextlib.suppress(OSError):
        sock.sendall(b"\x01" + struct.pack("<H", len(data)) + data)
    with contextlib.suppress(OSError):
        sock.close()
