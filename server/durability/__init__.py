"""What survives a restart: the write-ahead log and snapshots.

The log (``_wal``; its on-disk format and its one reader in ``_walread``: where a
push's record is logged), snapshots (``_snapshot``) and ``Durability``
(``durability``), which restores the newest snapshot, replays the log through the
store and schedules the next snapshot; a group's history (``_history``: rewind,
fork, the steps it can go back to) is read from both. It may import ``store``
(the state it saves and replays) and ``errors`` only; ``replication``, ``rpc``
and the process wiring import it. ``from onnxps.server.durability import
Durability`` names the public records of ``durability``.
"""

from .durability import MODES, Durability, GroupHistory, Rewound, SaveResult

__all__ = ["MODES", "Durability", "GroupHistory", "Rewound", "SaveResult"]
