"""Redo one logged change on a store: a restart's replay, a standby applying its
primary's record, and a rewind computing a group's state as of an earlier step."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from onnxps.wire.image import GroupImage

from ..store import ParameterStore

__all__ = ["redo"]

log = logging.getLogger("onnxps.durability")


def redo(
    store: ParameterStore,
    h: dict[str, Any],
    arrays: list[np.ndarray[Any, Any]],
    source: str,
    logged: bool = False,
) -> None:
    """Apply record ``h`` (with its ``arrays``) through the store's replay methods;
    ``source`` names where it was read, for the errors of its image; ``logged``:
    log it in the store's journal too (a resharding's move brings it from the
    group's source shard)."""
    op, name = h["op"], h["group"]
    if op == "push":
        store.replay_push(
            name,
            arrays,
            client_id=h["client_id"],
            seq=h["seq"],
            base_version=h["base_version"],
            learning_rate=h["lr"],
            logged=logged,
        )
    elif op == "push_rows":
        store.replay_push_rows(
            name,
            arrays,
            client_id=h["client_id"],
            seq=h["seq"],
            base_version=h["base_version"],
            learning_rate=h["lr"],
            logged=logged,
        )
    elif op == "sync_step":
        store.replay_sync_step(name, len(h["contributors"]), logged)
    elif op == "create":
        store.replay_create(
            GroupImage.from_json(h["image"], arrays, source),
            request_id=h.get("request_id", ""),
            moved=h.get("moved"),  # a resharding's move (store._moves)
        )
    elif op == "delete":
        store.replay_delete(name, logged)
    elif op == "set_lr":
        store.replay_set_learning_rate(name, h["lr"], logged)
    elif op == "rewind":
        store.replay_rewind(GroupImage.from_json(h["image"], arrays, source), logged)
    else:
        log.warning("write-ahead log record of unknown op %r skipped", op)
