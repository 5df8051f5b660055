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
) -> None:
    """Apply record ``h`` (with its ``arrays``) through the store's replay methods;
    ``source`` names where it was read, for the errors of its image."""
    op, name = h["op"], h["group"]
    if op == "push":
        store.replay_push(
            name,
            arrays,
            client_id=h["client_id"],
            seq=h["seq"],
            base_version=h["base_version"],
            learning_rate=h["lr"],
        )
    elif op == "push_rows":
        store.replay_push_rows(
            name,
            arrays,
            client_id=h["client_id"],
            seq=h["seq"],
            base_version=h["base_version"],
            learning_rate=h["lr"],
        )
    elif op == "sync_step":
        store.replay_sync_step(name, len(h["contributors"]))
    elif op == "create":
        store.replay_create(
            GroupImage.from_json(h["image"], arrays, source),
            request_id=h.get("request_id", ""),
        )
    elif op == "delete":
        store.replay_delete(name)
    elif op == "set_lr":
        store.replay_set_learning_rate(name, h["lr"])
    elif op == "rewind":
        store.replay_rewind(GroupImage.from_json(h["image"], arrays, source))
    else:
        log.warning("write-ahead log record of unknown op %r skipped", op)
