"""Export groups to one .npz file and import them into another server.

The file is a NumPy ``.npz`` archive (``np.savez``, no pickle): a ``metadata`` entry
holding UTF-8 JSON (uint8 array) with one ``GroupImage`` JSON per group
(``onnxps.client.image``), and per group ``i`` its arrays ``g<i>/<k>`` in ONNX output
order: X_1..X_n, then V_1..V_n, then H_1..H_n. See docs/FORMAT.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from ._optimizers import Adagrad, Adam, Async, Momentum, OptimizerSpec, Sync
from .image import ConsistencyDefinition, GroupDefinition, GroupImage

if TYPE_CHECKING:
    from ._records import GroupInfo
    from ._requests import ClientCore, Op

__all__ = ["EXPORT_FORMAT_VERSION", "export_op", "import_op", "read_export"]

EXPORT_FORMAT = "onnxps-export"
EXPORT_FORMAT_VERSION = 2
_OPTIMIZERS: dict[str, type[Adagrad] | type[Momentum] | type[Adam]] = {
    "Adagrad": Adagrad,
    "Momentum": Momentum,
    "Adam": Adam,
}


def _definition(info: GroupInfo, update_count: int) -> GroupDefinition:
    c = info.consistency
    consistency = (
        ConsistencyDefinition("sync", c.workers, c.reduction)
        if isinstance(c, Sync)
        else ConsistencyDefinition("async", max_staleness=c.max_staleness)
    )
    return GroupDefinition(
        name=info.name,
        optimizer=type(info.optimizer).__name__,
        attributes=dataclasses.asdict(info.optimizer),
        learning_rate=info.learning_rate,
        update_count=update_count,
        dtype=info.dtype,
        names=tuple(n for n, _ in info.tensors),
        shapes=tuple(s for _, s in info.tensors),
        consistency=consistency,
        allow_non_finite=info.allow_non_finite,
        lease_seconds=info.lease_seconds,
    )


def export_op(
    client: ClientCore, path: str | os.PathLike[str], prefix: str = ""
) -> Op[list[str]]:
    """Write every group whose name starts with ``prefix``; returns their names.

    Each group's tensors, state and T come from one pull, so they belong together.
    """
    images: list[GroupImage] = []
    for info in (yield from client._list_groups(prefix)):
        t, values = yield from client._pull_versioned(info.name, state=True)
        lr = (yield from client._describe_group(info.name)).learning_rate
        definition = dataclasses.replace(_definition(info, t), learning_rate=lr)
        images.append(GroupImage(definition, values))
    metadata = {
        "format": EXPORT_FORMAT,
        "format_version": EXPORT_FORMAT_VERSION,
        "groups": [image.to_json() for image in images],
    }
    arrays = {
        f"g{i}/{k}": a
        for i, image in enumerate(images)
        for k, a in enumerate(image.arrays)
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
    return [image.name for image in images]


def read_export(path: str | os.PathLike[str]) -> list[GroupImage]:
    """Every group of an export file; checks the format versions."""
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
        images = []
        for i, doc in enumerate(metadata["groups"]):
            definition = GroupDefinition.from_json(doc, os.fspath(path))
            arrays = [z[f"g{i}/{k}"] for k in range(definition.array_count)]
            images.append(GroupImage(definition, arrays))
        return images


def _optimizer(definition: GroupDefinition) -> OptimizerSpec:
    return _OPTIMIZERS[definition.optimizer](**definition.attributes)


def _consistency(c: ConsistencyDefinition) -> Async | Sync:
    if c.mode == "sync":
        return Sync(c.sync_workers, "sum" if c.reduction == "sum" else "mean")
    return Async(c.max_staleness)


def import_op(client: ClientCore, path: str | os.PathLike[str]) -> Op[list[str]]:
    """Create every group of an export file, with its state, T and learning rate."""
    names = []
    for image in read_export(path):
        d = image.definition
        n = len(d.names)
        yield from client._create_group(
            d.name,
            _optimizer(d),
            learning_rate=d.learning_rate,
            tensors=list(zip(d.names, image.arrays[:n], strict=True)),
            consistency=_consistency(d.consistency),
            allow_non_finite=d.allow_non_finite,
            state=image.arrays[n:],
            update_count=d.update_count,
            lease_seconds=d.lease_seconds,
        )
        names.append(d.name)
    return names
