"""Which connections to the data port may shake hands, and which are cut off.

Each handshake holds a thread until its client presents a ticket (or its
``HANDSHAKE_SECONDS`` are up), so at most ``limit`` run at once. A fixed number of
slots held for the whole handshake time let 448 silent connections in 30 s (one
host, 15 a second) refuse 489 of 496 honest handshakes. So:

- one address holds at most ``per_address`` slots: a flood from one host leaves
  the others' clients the rest;
- when a new connection finds no slot (in all, or of its address), it takes the
  slot of the oldest pending handshake that has had ``grace`` seconds (of its
  own address when that address is full, else of the address holding the most),
  and that connection is closed. An honest client sends its preamble as soon as
  it has connected (and shaken TLS hands), well within ``grace``, so only a
  flood of more than ``per_address / grace`` connections a second from a
  client's own address can keep it out;
- a connection that finds no slot whose handshake has had ``grace`` is refused.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

__all__ = ["Handshake", "Handshakes"]


class Handshake:
    """One pending handshake: its socket (the TLS one once wrapped), its address
    and when it began; ``cut`` once another connection took its slot."""

    __slots__ = ("address", "cut", "sock", "started")

    def __init__(self, sock: socket.socket, address: str, started: float) -> None:
        self.sock = sock
        self.address = address
        self.started = started
        self.cut = False


class Handshakes:
    """The pending handshakes of one data port (see the module's docstring)."""

    def __init__(
        self,
        limit: int,
        per_address: int,
        grace: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.per_address = per_address
        self.grace = grace
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[Handshake, None] = {}  # oldest first
        self.cut_off = 0  # handshakes whose slot a newer connection took (tests)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def admit(self, sock: socket.socket, address: str) -> Handshake | None:
        """A slot for a new connection from ``address`` (another handshake cut off
        for it, if need be), or None: refuse it."""
        now = self._clock()
        with self._lock:
            counts = Counter(h.address for h in self._pending)
            victim: Handshake | None = None
            if counts[address] >= self.per_address:
                victim = self._oldest(now, address)
                if victim is None:
                    return None
            elif len(self._pending) >= self.limit:
                busiest = max(counts, key=lambda a: counts[a])
                victim = self._oldest(now, busiest) or self._oldest(now, None)
                if victim is None:
                    return None
            if victim is not None:
                del self._pending[victim]
                victim.cut = True
                self.cut_off += 1
            entry = Handshake(sock, address, now)
            self._pending[entry] = None
        if victim is not None:  # its thread, blocked reading, sees the end
            with contextlib.suppress(OSError):
                victim.sock.shutdown(socket.SHUT_RDWR)
        return entry

    def _oldest(self, now: float, address: str | None) -> Handshake | None:
        for h in self._pending:  # oldest first
            if now - h.started < self.grace:
                return None
            if address is None or h.address == address:
                return h
        return None

    def rebind(self, entry: Handshake, sock: socket.socket) -> bool:
        """The handshake's socket is now ``sock`` (TLS-wrapped); False if it was
        cut off meanwhile (its thread closes it)."""
        with self._lock:
            entry.sock = sock
            return not entry.cut

    def finish(self, entry: Handshake) -> bool:
        """The client presented its preamble: its slot is free, and it is no
        longer cut off for a newer connection. False if it was cut off already."""
        with self._lock:
            self._pending.pop(entry, None)
            return not entry.cut
