"""The placement map a resharding keeps in etcd (``PREFIX/placement``,
docs/resharding.md), read by every server of the cluster.

A server polls the key and tells its store's ``Moves`` which names another shard
owns (answered MOVED) and which are on their way here (held), so it answers
rightly after a restart too, when what the resharding tool told it is gone.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..store import ParameterStore
from ._etcd import CoordinatorUnavailable, Etcd

__all__ = ["PlacementWatch", "parse_placement"]

log = logging.getLogger("onnxps.replication")

POLL_SECONDS = 0.5


def parse_placement(raw: bytes) -> tuple[int, dict[str, int], dict[str, Any]]:
    """``(version, owners, moving)`` of the map's JSON."""
    doc = json.loads(raw)
    owners = {str(k): int(v) for k, v in dict(doc.get("owners", {})).items()}
    moving: Mapping[str, Any] = doc.get("moving", {}) or {}
    return int(doc.get("version", 0)), owners, dict(moving)


class PlacementWatch:
    """Polls ``PREFIX/placement`` and hands each new version to the store."""

    def __init__(self, etcd: Etcd, prefix: str, shard: int, store: ParameterStore):
        self.etcd = etcd
        self.key = f"{prefix}/placement"
        self.shard = shard
        self.store = store
        self._seen = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name="onnxps-placement", daemon=True
        )

    def start(self) -> None:
        self.poll()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            self.poll()

    def read_now(self, seconds: float = 5.0) -> bool:
        """Read the map at once (a standby taking the lead: its last poll may be
        half a second old, and a move fenced since must be fenced here before it
        acknowledges anything). False when etcd did not answer in ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            if self.poll():
                return True
            if time.monotonic() >= deadline or self._stop.wait(0.1):
                return False

    def poll(self) -> bool:
        """Read the map; False when etcd did not answer (asked again later)."""
        try:
            kv = self.etcd.get(self.key)
        except CoordinatorUnavailable:
            return False  # asked again at the next poll
        if kv is None or kv.mod_revision == self._seen:
            return True
        try:
            version, owners, moving = parse_placement(kv.value)
        except (ValueError, TypeError, AttributeError) as exc:
            log.error("the placement map %s is malformed (%s): ignored", self.key, exc)
            return True
        self._seen = kv.mod_revision
        incoming = {
            name: int(m.get("from", -1))
            for name, m in moving.items()
            if int(m.get("to", -1)) == self.shard
        }
        # a move still copying ("copy": its log followed) is served here
        outgoing = {
            name: int(m.get("to", -1))
            for name, m in moving.items()
            if int(m.get("from", -1)) == self.shard and not m.get("copy")
        }
        self.store.moves.adopt(version, owners, incoming, outgoing)
        return True
