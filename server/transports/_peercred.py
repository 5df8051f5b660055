"""The uid of a gRPC caller on this host, where the OS tells it.

gRPC Python gives a servicer the peer's address (``context.peer()``), not its
socket. For a TCP connection from this host (loopback), Linux lists the caller's
end of the connection in ``/proc/net/tcp`` (``tcp6``) with the uid that owns it,
as ``identd`` reads it: the line whose local address is the peer's address (a
read of the table takes milliseconds, so callers look a peer up once). A
Unix-socket peer (whose socket file mode is its access control), a remote peer
or a host without ``/proc`` gives None.
"""

from __future__ import annotations

import ipaddress
import struct

__all__ = ["peer_uid"]

_TABLES = {4: "/proc/net/tcp", 6: "/proc/net/tcp6"}
_ESTABLISHED = "01"


def _proc_hex(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    """``ip:port`` as /proc/net/tcp* writes a local address: each 32-bit word of
    the address in host byte order, in hex, then the port."""
    words = struct.unpack(f"={len(ip.packed) // 4}I", ip.packed)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def _address(peer: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """The IP address and port of a gRPC peer string ("ipv4:1.2.3.4:5",
    "ipv6:[::1]:5"); ValueError for any other form."""
    kind, _, rest = peer.partition(":")
    host, _, port = rest.rpartition(":")
    if kind not in ("ipv4", "ipv6") or not port.isdigit():
        raise ValueError(f"not a TCP peer: {peer!r}")
    host = host.removeprefix("[").removesuffix("]").split("%", 1)[0]
    return ipaddress.ip_address(host), int(port)


def peer_uid(peer: str) -> int | None:
    """The uid owning the caller's end of TCP connection ``peer``, or None when
    this host does not list it exactly once (not TCP, not from this host, no
    /proc)."""
    try:
        ip, port = _address(peer)
    except ValueError:
        return None
    wanted = [(_TABLES[ip.version], _proc_hex(ip, port))]
    if isinstance(ip, ipaddress.IPv4Address):  # or from an IPv6 socket, v4-mapped
        mapped = ipaddress.IPv6Address(f"::ffff:{ip}")
        wanted.append((_TABLES[6], _proc_hex(mapped, port)))
    for path, local in wanted:  # reading a table costs milliseconds: stop early
        uids = set(_owners(path, local))
        if uids:
            return uids.pop() if len(uids) == 1 else None
    return None


def _owners(path: str, local: str) -> list[int]:
    """The uids of the established connections in table ``path`` whose local end
    is ``local``."""
    found = []
    try:
        with open(path, encoding="ascii") as table:
            next(table, None)  # the column names
            for line in table:
                fields = line.split()
                if len(fields) > 7 and fields[1] == local and fields[3] == _ESTABLISHED:
                    found.append(int(fields[7]))
    except OSError:
        return []
    return found
