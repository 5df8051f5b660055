"""How a client of a cluster found through etcd follows its placement map
(docs/resharding.md): the shard count new groups are placed over, the owner of a
moved group, and the map read again when a shard answers MOVED (new shards get
their primary's address and call metadata). A part of ``ClientCore``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ._discovery import Discovery, Placement
from ._settings import with_default_port

__all__ = ["FollowsPlacement"]


class FollowsPlacement:
    """The placement map's part of a client (``ClientCore`` is made of it)."""

    _discovery: Discovery | None
    _placement: Placement | None = None  # read when the client is made
    # one lock for every client's rare map reads (MOVED answers)
    _placement_lock = threading.Lock()
    shards: int | None
    addresses: list[str]
    address: str
    timeout: float
    _metadatas: list[Any]

    def _metadata(self, shard: int = 0) -> Any:
        raise NotImplementedError

    @property
    def placement_shards(self) -> int | None:
        """New groups are placed over this many shards (docs/resharding.md)."""
        known = self._placement
        return self.shards if known is None else known.shards

    def owner(self, name: str) -> int | None:
        """The shard the placement map names for ``name`` (None: its holder's)."""
        placement = self._placement
        return None if placement is None else placement.owner(name)

    def refresh_placement(self) -> None:
        """Read the placement map in etcd again (a shard answered MOVED, or a
        listing met a group twice): follow a change of the shard count, the
        owners of moved groups. A client without etcd has none: nothing to do."""
        discovery = self._discovery
        if discovery is None:
            return
        placement = discovery.placement(time.monotonic() + self.timeout)
        with self._placement_lock:
            known = self._placement
            if known is not None and placement.version < known.version:
                return
            self._placement = placement
            if self.shards is None or placement.serving == len(self.addresses):
                return
            grown = discovery.resize(self.addresses, placement.serving, self.timeout)
            addresses = [with_default_port(a) for a in grown]
            # in place: the call channels (and any other holder) follow the list
            self.addresses[:] = addresses
            self.address = ",".join(addresses)
            self.shards = len(addresses)
            self._metadatas = [self._metadata(s) for s in range(len(addresses))]
