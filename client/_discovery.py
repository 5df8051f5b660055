"""Find each shard's primary in etcd (docs/cluster.md "Replicated shards").

``Client("etcd://H:P[,H:P]/PREFIX")`` (``etcds://`` for TLS, see
``onnxps.wire.coordinator``) reads the shard count (``PREFIX/layout``) and
each shard's primary (``PREFIX/shards/I/primary``, written by the servers' election)
through etcd's HTTP JSON gateway (``etcd3gw``, the ``replication`` extra). On a
NOT_PRIMARY or UNAVAILABLE answer the client reads the primary again and resends the
same request (same seq: the new primary answers a repeat with its first result),
within the call's deadline.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from onnxps.wire.coordinator import (
    CoordinatorTls,
    failure,
    gateway_clients,
    is_coordinator,
    parse_coordinator,
)

__all__ = ["CoordinatorTls", "Discovery", "Placement", "follows", "is_coordinator"]


@dataclass(frozen=True)
class Placement:
    """The placement map of a cluster found through etcd (docs/resharding.md):
    ``version`` (one more at each change), ``shards`` (new groups are placed over
    this many), ``serving`` (shards 0..serving-1 hold groups), ``owners`` (the
    shard of each name a resharding moved) and ``moving`` (name -> (from, to) of
    the moves under way: served by ``from`` until they flip)."""

    version: int
    shards: int
    serving: int
    owners: Mapping[str, int]
    moving: Mapping[str, tuple[int, int]]

    @classmethod
    def from_json(cls, raw: bytes) -> Placement:
        doc = json.loads(raw)
        shards = int(doc["shards"])
        return cls(
            int(doc.get("version", 0)),
            shards,
            int(doc.get("serving", shards)),
            {str(k): int(v) for k, v in (doc.get("owners") or {}).items()},
            {
                str(k): (int(m["from"]), int(m["to"]))
                for k, m in (doc.get("moving") or {}).items()
            },
        )

    def owner(self, name: str) -> int | None:
        """The shard that serves ``name`` now, when the map says (None: the one
        that holds it)."""
        if name in self.moving:
            return self.moving[name][0]
        return self.owners.get(name)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def follows(error: Exception) -> bool:
    """Whether a call refused so is resent to the shard's primary, read again."""
    if getattr(error, "reason", None) == "NOT_PRIMARY":
        return True
    code = getattr(error, "code", None)
    return code is not None and getattr(code, "name", "") == "UNAVAILABLE"


class Discovery:
    """The primaries of a replicated cluster, read from etcd."""

    def __init__(
        self, url: str, timeout: float = 2.0, tls: CoordinatorTls | None = None
    ) -> None:
        """``tls``: the files of an ``etcds://`` url (None: the environment's,
        ``ONNXPS_COORDINATOR_CA``, ``_CERT``, ``_KEY``)."""
        address = parse_coordinator(url, tls)
        try:
            self._clients = gateway_clients(address, timeout)
        except ImportError as exc:
            raise ImportError(
                "Client('etcd://...') needs the etcd client: "
                "pip install 'onnxps[replication]'"
            ) from exc
        self.url = url
        self.prefix = address.prefix

    def _post(self, path: str, payload: dict[str, Any]) -> Any:
        """The first endpoint's answer to ``path``; ConnectionError when none
        answers, with the last one's reason."""
        last: Exception | None = None
        for client in self._clients:
            try:
                return client.post(client.get_url(path), json=payload)
            except Exception as exc:  # noqa: BLE001 - etcd3gw's or requests'
                last = exc
        raise ConnectionError(
            f"etcd at {self.url} did not answer: {failure(last) if last else None}"
        )

    def _get(self, key: str) -> bytes | None:
        result = self._post("/kv/range", {"key": _b64(key.encode())})
        kvs = result.get("kvs") or []
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    def _range(self, prefix: str) -> list[tuple[str, bytes]]:
        end = bytearray(prefix.encode())
        end[-1] += 1
        payload = {"key": _b64(prefix.encode()), "range_end": _b64(bytes(end))}
        return [
            (
                base64.b64decode(kv["key"]).decode(),
                base64.b64decode(kv.get("value", "")),
            )
            for kv in self._post("/kv/range", payload).get("kvs") or []
        ]

    def replicas(self, timeout: float) -> list[dict[str, Any]]:
        """Every member of every shard: ``shard``, ``member``, ``address``, ``role``,
        ``term``, ``lsn`` (as it last registered), ``following`` (a standby the
        primary names as following it in its term; None: the primary does not
        say, an earlier onnxps), ``lag`` (records behind its shard's primary;
        None for a standby that does not follow it: its lsn may count records of
        another term) and ``sync`` (named a synchronous standby)."""
        count = self.shard_count(time.monotonic() + timeout)
        # shards started beyond the count (a resharding is to make them owners)
        for key, _ in self._range(f"{self.prefix}/shards/"):
            index = key[len(self.prefix) + len("/shards/") :].split("/", 1)[0]
            if index.isdigit():
                count = max(count, int(index) + 1)
        out: list[dict[str, Any]] = []
        for shard in range(count):
            base = f"{self.prefix}/shards/{shard}/"
            keys = dict(self._range(base))
            sync = json.loads(keys.get(base + "sync", b"{}") or b"{}")
            members = {
                k[len(base) + len("members/") :]: json.loads(v)
                for k, v in keys.items()
                if k.startswith(base + "members/")
            }
            primary = json.loads(keys.get(base + "primary", b"{}") or b"{}")
            lead = members.get(primary.get("member", ""), {})
            current = (lead.get("role"), lead.get("term"))
            if current != ("primary", primary.get("term")):
                lead = {}  # the primary's key is not written yet in this term
            top = lead.get("lsn")
            standbys = lead.get("standbys")  # None: an earlier primary's key
            for name, m in sorted(members.items()):
                following = None
                if m.get("role") != "primary" and standbys is not None:
                    following = name in standbys
                lag = None
                if top is not None and following is not False:
                    lag = max(0, top - m["lsn"])
                out.append(
                    {
                        "shard": shard,
                        "member": name,
                        "address": m["address"],
                        "role": m["role"],
                        "term": m["term"],
                        "lsn": m["lsn"],
                        "following": following,
                        "lag": lag,
                        "sync": name in sync.get("standbys", []),
                    }
                )
        return out

    def placement(self, deadline: float) -> Placement:
        """The placement map (``PREFIX/placement``, docs/resharding.md); a cluster
        never resharded has none: version 0, every count the layout's."""
        raw = self._get(f"{self.prefix}/placement")
        if raw is None:
            count = self.shard_count(deadline)
            return Placement(0, count, count, {}, {})
        return Placement.from_json(raw)

    def placement_within(self, timeout: float) -> Placement:
        return self.placement(time.monotonic() + timeout)

    def shard_count(self, deadline: float) -> int:
        while True:
            raw = self._get(f"{self.prefix}/layout")
            if raw is not None:
                return int(raw)
            if time.monotonic() >= deadline:
                raise LookupError(
                    f"no onnxps cluster under {self.url}: {self.prefix}/layout is "
                    "missing (no server started with this --coordinator yet)"
                )
            time.sleep(0.1)

    def primary(self, shard: int, deadline: float) -> str | None:
        """The address of ``shard``'s primary; None when none is elected by then."""
        while True:
            try:
                raw = self._get(f"{self.prefix}/shards/{shard}/primary")
            except ConnectionError:
                raw = None  # etcd down: ask again until the deadline
            if raw is not None:
                info: Any = json.loads(raw)
                return str(info["address"])
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def resize(self, addresses: list[str], count: int, timeout: float) -> list[str]:
        """``addresses`` cut or grown to ``count`` shards (a resharding changed
        the shards that hold groups): a new shard's primary read here."""
        grown = list(addresses[:count])
        for i in range(len(grown), count):
            found = self.primary(i, time.monotonic() + timeout)
            if found is None:
                raise ConnectionError(
                    f"shard {i} under {self.url} has no primary: start its server "
                    "(onnxps serve --coordinator ... --shard I/M)"
                )
            grown.append(found)
        return grown

    def addresses(self, timeout: float) -> list[str]:
        """Every shard's primary (the shards the placement map says hold groups:
        during a resharding, the old and the new ones). A list even of one
        shard: a client routes as a cluster, so it follows the placement map
        when a resharding grows it (docs/resharding.md)."""
        deadline = time.monotonic() + timeout
        count = self.placement(deadline).serving
        found = []
        for i in range(count):
            address = self.primary(i, deadline)
            if address is None:
                raise LookupError(
                    f"shard {i} under {self.url} has no primary (none elected "
                    f"within {timeout:g} s)"
                )
            found.append(address)
        return found
