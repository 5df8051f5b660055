"""Snapshots, the write-ahead log, restore and replay (issue 6)."""

from __future__ import annotations

from typing import Any

__all__ = ["attach"]


def attach(handle: Any, servicer: Any) -> None:
    """Restore state from the data directory and start snapshotting, if configured."""
