"""The few etcd v3 calls a replica set needs, over etcd's HTTP JSON gateway.

The client is ``etcd3gw`` (the ``replication`` extra): etcd 3.4 and later serve the
gateway at ``/v3/``; it needs no generated protobuf code of its own, so it cannot
clash with the protobuf and grpcio versions onnxps pins. Calls go to the first
endpoint that answers, in the order given (``etcd://h1:p1,h2:p2/prefix``), over
HTTPS for ``etcds://`` (``onnxps.wire.coordinator``).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from onnxps.wire.coordinator import (
    CoordinatorAddress,
    CoordinatorTls,
    failure,
    gateway_clients,
)
from onnxps.wire.coordinator import parse_coordinator as _parse

from ..interceptors.security import ConfigError

__all__ = [
    "CoordinatorAddress",
    "CoordinatorTls",
    "CoordinatorUnavailable",
    "Etcd",
    "KeyValue",
    "parse_coordinator",
]


class CoordinatorUnavailable(ConnectionError):
    """No etcd endpoint answered (or one answered with an error)."""


def parse_coordinator(
    url: str, tls: CoordinatorTls | None = None
) -> CoordinatorAddress:
    """Parse ``etcd[s]://H:P[,H:P]/PREFIX`` (``onnxps.wire.coordinator``);
    ConfigError saying what is expected."""
    try:
        return _parse(url, tls)
    except ValueError as exc:
        raise ConfigError(f"--coordinator: {exc}") from None


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    version: int
    lease: int

    def json(self) -> Any:
        return json.loads(self.value)


def b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        base64.b64decode(raw["key"]).decode(),
        base64.b64decode(raw.get("value", "")),
        int(raw.get("mod_revision", 0)),
        int(raw.get("version", 0)),
        int(raw.get("lease", 0)),
    )


class Etcd:
    """etcd over its JSON gateway: get, put, delete, transactions and leases.

    Every call is bounded by ``timeout`` seconds per endpoint and raises
    ``CoordinatorUnavailable`` when no endpoint answers.
    """

    def __init__(self, address: CoordinatorAddress, timeout: float = 1.0) -> None:
        try:
            self._clients = gateway_clients(address, timeout)
        except ImportError as exc:  # pragma: no cover - the extra is missing
            raise ConfigError(
                "--coordinator needs the etcd client: pip install 'onnxps[replication]'"
            ) from exc
        self.address = address
        self.timeout = timeout
        self._first = 0

    def clone(self) -> Etcd:
        """Another client of the same endpoints: its own connections, so that a
        call on one never waits behind a call on the other."""
        return Etcd(self.address, timeout=self.timeout)

    def _post(self, path: str, payload: dict[str, Any]) -> Any:
        import etcd3gw.exceptions

        errors = []
        n = len(self._clients)
        for k in range(n):
            i = (self._first + k) % n
            client = self._clients[i]
            try:
                result = client.post(client.get_url(path), json=payload)
            except etcd3gw.exceptions.Etcd3Exception as exc:
                errors.append(f"{client.host}:{client.port}: {failure(exc)}")
                continue
            self._first = i
            return result
        raise CoordinatorUnavailable("etcd did not answer: " + "; ".join(errors))

    # -- keys -------------------------------------------------------------------
    def get(self, key: str) -> KeyValue | None:
        result = self._post("/kv/range", {"key": b64(key)})
        kvs = result.get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        end = bytearray(prefix.encode())
        end[-1] += 1
        result = self._post(
            "/kv/range", {"key": b64(prefix), "range_end": b64(bytes(end))}
        )
        return [_kv(raw) for raw in result.get("kvs") or []]

    def put(self, key: str, value: bytes | str, lease: int = 0) -> None:
        payload: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            payload["lease"] = lease
        self._post("/kv/put", payload)

    def txn(
        self,
        compare: Sequence[dict[str, Any]],
        success: Sequence[dict[str, Any]],
        failure: Sequence[dict[str, Any]] = (),
    ) -> bool:
        """An etcd transaction; whether its comparisons held (``success`` ran)."""
        result = self._post(
            "/kv/txn",
            {
                "compare": list(compare),
                "success": list(success),
                "failure": list(failure),
            },
        )
        return bool(result.get("succeeded", False))

    # -- leases -----------------------------------------------------------------
    def grant(self, ttl: int) -> int:
        return int(self._post("/lease/grant", {"TTL": ttl, "ID": 0})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``: its TTL, or -1 when it has expired already."""
        result = self._post("/lease/keepalive", {"ID": lease})
        return int(result.get("result", {}).get("TTL", -1))

    def time_to_live(self, lease: int) -> tuple[int, int]:
        """``lease``'s seconds left and the TTL it was granted (-1, 0: expired)."""
        result = self._post("/lease/timetolive", {"ID": lease})
        return int(result.get("TTL", -1)), int(result.get("grantedTTL", 0))

    def revoke(self, lease: int) -> None:
        self._post("/kv/lease/revoke", {"ID": lease})


# -- transaction parts --------------------------------------------------------------
def absent(key: str) -> dict[str, Any]:
    return {
        "key": b64(key),
        "result": "EQUAL",
        "target": "CREATE",
        "create_revision": 0,
    }


def mod_revision_is(key: str, revision: int) -> dict[str, Any]:
    return {
        "key": b64(key),
        "result": "EQUAL",
        "target": "MOD",
        "mod_revision": revision,
    }


def lease_is(key: str, lease: int) -> dict[str, Any]:
    """``key`` is attached to ``lease`` (etcd 3.3 and later)."""
    return {"key": b64(key), "result": "EQUAL", "target": "LEASE", "lease": lease}


def value_is(key: str, value: bytes) -> dict[str, Any]:
    return {"key": b64(key), "result": "EQUAL", "target": "VALUE", "value": b64(value)}


def put_op(key: str, value: bytes | str, lease: int = 0) -> dict[str, Any]:
    put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        put["lease"] = lease
    return {"request_put": put}


def delete_op(key: str) -> dict[str, Any]:
    return {"request_delete_range": {"key": b64(key)}}
