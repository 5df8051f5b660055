"""Export groups to one .npz file and import them into another server.

The file is a NumPy ``.npz`` archive (``np.savez``, no pickle): a ``metadata`` entry
holding UTF-8 JSON (uint8 array) and, per group ``i``, arrays ``g<i>/<k>`` in ONNX
output order: X_1..X_n, then V_1..V_n, then H_1..H_n. See docs/FORMAT.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from ._optimizers import Adagrad, Adam, Async, Momentum, Sync

if TYPE_CHECKING:
    from ._client import Client, GroupInfo

__all__ = ["EXPORT_FORMAT_VERSION", "export_groups", "import_groups"]

EXPORT_FORMAT = "onnxps-export"
EXPORT_FORMAT_VERSION = 1
_OPTIMIZERS = {"Adagrad": Adagrad, "Momentum": Momentum, "Adam": Adam}


def _group_metadata(info: GroupInfo, update_count: int, count: int) -> dict[str, Any]:
    consistency = info.consistency
    return {
        "name": info.name,
        "optimizer": type(info.optimizer).__name__,
        "attributes": dataclasses.asdict(info.optimizer),
        "learning_rate": info.learning_rate,
        "update_count": update_count,
        "dtype": info.dtype.str,
        "tensors": [[n, list(s)] for n, s in info.tensors],
        "consistency": {
            "mode": "sync" if isinstance(consistency, Sync) else "async",
            **dataclasses.asdict(consistency),
        },
        "allow_non_finite": info.allow_non_finite,
        "lease_seconds": info.lease_seconds,
        "arrays": count,
    }


def export_groups(
    client: Client, path: str | os.PathLike[str], prefix: str = ""
) -> list[str]:
    """Write every group whose name starts with ``prefix``; returns their names.

    Each group's tensors, state and T come from one pull, so they belong together.
    """
    groups: list[dict[str, Any]] = []
    arrays: dict[str, Any] = {}
    for info in client.list_groups(prefix):
        t, values = client.pull_versioned(info.name, state=True)
        lr = client.describe_group(info.name).learning_rate
        meta = _group_metadata(info, t, len(values))
        meta["learning_rate"] = lr
        for k, a in enumerate(values):
            arrays[f"g{len(groups)}/{k}"] = a
        groups.append(meta)
    metadata = {
        "format": EXPORT_FORMAT,
        "format_version": EXPORT_FORMAT_VERSION,
        "groups": groups,
    }
    blob = np.frombuffer(json.dumps(metadata).encode("utf-8"), dtype=np.uint8)
    path = os.fspath(path)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        savez: Any = np.savez  # numpy's stub types **arrays as its own kwargs
        savez(f, metadata=blob, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return [g["name"] for g in groups]


def read_export(path: str | os.PathLike[str]) -> list[tuple[dict[str, Any], list[Any]]]:
    """(metadata, arrays) per group of an export file; checks the format version."""
    with np.load(os.fspath(path), allow_pickle=False) as z:
        metadata = json.loads(z["metadata"].tobytes().decode("utf-8"))
        if metadata.get("format") != EXPORT_FORMAT:
            raise ValueError(f"{path} is not an onnxps export file")
        version = metadata.get("format_version")
        if version != EXPORT_FORMAT_VERSION:
            raise ValueError(
                f"{path} has format_version {version!r}; this onnxps reads version "
                f"{EXPORT_FORMAT_VERSION}"
            )
        return [
            (g, [z[f"g{i}/{k}"] for k in range(g["arrays"])])
            for i, g in enumerate(metadata["groups"])
        ]


def import_groups(client: Client, path: str | os.PathLike[str]) -> list[str]:
    """Create every group of an export file, with its state, T and learning rate."""
    names = []
    for meta, arrays in read_export(path):
        n = len(meta["tensors"])
        c = meta["consistency"]
        consistency: Async | Sync
        if c["mode"] == "sync":
            consistency = Sync(c["workers"], c["reduction"])
        else:
            consistency = Async(c["max_staleness"])
        client.create_group(
            meta["name"],
            _OPTIMIZERS[meta["optimizer"]](**meta["attributes"]),
            learning_rate=meta["learning_rate"],
            tensors=[
                (tname, arrays[j]) for j, (tname, _) in enumerate(meta["tensors"])
            ],
            consistency=consistency,
            allow_non_finite=meta["allow_non_finite"],
            state=arrays[n:],
            update_count=meta["update_count"],
            lease_seconds=meta["lease_seconds"],
        )
        names.append(meta["name"])
    return names
