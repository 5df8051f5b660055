"""A group's saved form, shared by the server's log and snapshots and by export files.

``GroupDefinition`` is everything that defines an optimizer group except its arrays;
``GroupImage`` is a definition with the arrays X_1..X_n, V_1..V_n, H_1..H_n (ONNX
output order), then for each ids table (``tables``, in order) its ids (int64 (k,),
ascending), X rows (k, dim) and the V rows, H rows as the operator has them.
``to_json``/``from_json`` carry a ``format_version``; a reader refuses a version it
does not know (a definition without ids tables has no ``tables`` key, as before).
The arrays travel beside the JSON, in whatever container holds it (a log frame's
body, snapshot ``.npy`` files, an ``.npz`` archive). NumPy and the
standard library only: no grpc. The layout is in docs/FORMAT.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "IMAGE_FORMAT_VERSION",
    "STATE_NAMES",
    "ConsistencyDefinition",
    "GroupDefinition",
    "GroupImage",
    "ImageFormatError",
    "TableDefinition",
]

Array = np.ndarray[Any, Any]

IMAGE_FORMAT_VERSION = 1

# The accumulators each ONNX operator keeps, in ONNX order (V before H).
STATE_NAMES: Mapping[str, tuple[str, ...]] = {
    "Adagrad": ("H",),
    "Momentum": ("V",),
    "Adam": ("V", "H"),
}


class ImageFormatError(ValueError):
    """A saved group that cannot be read; the message names where it came from."""


@dataclass(frozen=True)
class ConsistencyDefinition:
    mode: str = "async"  # "async" or "sync"
    sync_workers: int = 0
    reduction: str = "mean"  # "mean" or "sum"
    max_staleness: int | None = None


@dataclass(frozen=True)
class TableDefinition:
    """An ids table of a group: rows of ``dim`` keyed by int64 ids
    (``onnxps.client.initializers``); ``initializer`` is its ``to_json``."""

    name: str
    dim: int
    initializer: Mapping[str, Any]
    max_rows: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dim": self.dim,
            "initializer": dict(self.initializer),
            "max_rows": self.max_rows,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> TableDefinition:
        return cls(
            name=str(doc["name"]),
            dim=int(doc["dim"]),
            initializer=dict(doc["initializer"]),
            max_rows=int(doc["max_rows"]),
        )


@dataclass(frozen=True)
class GroupDefinition:
    """One optimizer group without its arrays (values as the server holds them)."""

    name: str
    optimizer: str  # "Adagrad", "Momentum" or "Adam"
    attributes: Mapping[str, Any]  # ONNX attribute name -> value
    learning_rate: float
    update_count: int  # T
    dtype: np.dtype[Any]  # float32 or float64
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    consistency: ConsistencyDefinition = field(default_factory=ConsistencyDefinition)
    allow_non_finite: bool = False
    lease_seconds: float = 10.0
    tables: tuple[TableDefinition, ...] = ()  # ids tables, after the tensors

    @property
    def state_names(self) -> tuple[str, ...]:
        return STATE_NAMES[self.optimizer]

    @property
    def dense_array_count(self) -> int:
        """X..., V..., H... of the tensors."""
        return len(self.names) * (1 + len(self.state_names))

    @property
    def array_count(self) -> int:
        """The arrays of a ``GroupImage`` of this definition: X..., V..., H..., then
        per ids table its ids, X rows, V rows, H rows."""
        per_table = 2 + len(self.state_names)
        return self.dense_array_count + len(self.tables) * per_table

    def to_json(self) -> dict[str, Any]:
        c = self.consistency
        return {
            "format_version": IMAGE_FORMAT_VERSION,
            "name": self.name,
            "optimizer": self.optimizer,
            "attributes": dict(self.attributes),
            "learning_rate": self.learning_rate,
            "update_count": self.update_count,
            "dtype": np.dtype(self.dtype).newbyteorder("<").str,
            "names": list(self.names),
            "shapes": [list(s) for s in self.shapes],
            "consistency": {
                "mode": c.mode,
                "sync_workers": c.sync_workers,
                "reduction": c.reduction,
                "max_staleness": c.max_staleness,
            },
            "allow_non_finite": self.allow_non_finite,
            "lease_seconds": self.lease_seconds,
        } | ({"tables": [t.to_json() for t in self.tables]} if self.tables else {})

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], source: str = "") -> GroupDefinition:
        where = f"{source}: " if source else ""
        version = doc.get("format_version")
        if version != IMAGE_FORMAT_VERSION:
            raise ImageFormatError(
                f"{where}group image format_version {version!r}; this onnxps reads "
                f"version {IMAGE_FORMAT_VERSION}"
            )
        try:
            definition = cls(
                name=str(doc["name"]),
                optimizer=str(doc["optimizer"]),
                attributes=dict(doc["attributes"]),
                learning_rate=float(doc["learning_rate"]),
                update_count=int(doc["update_count"]),
                dtype=np.dtype(doc["dtype"]).newbyteorder("="),
                names=tuple(str(n) for n in doc["names"]),
                shapes=tuple(tuple(int(d) for d in s) for s in doc["shapes"]),
                consistency=ConsistencyDefinition(**doc["consistency"]),
                allow_non_finite=bool(doc["allow_non_finite"]),
                lease_seconds=float(doc["lease_seconds"]),
                tables=tuple(
                    TableDefinition.from_json(t) for t in doc.get("tables", ())
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ImageFormatError(f"{where}malformed group image: {exc!r}") from exc
        if definition.optimizer not in STATE_NAMES:
            raise ImageFormatError(
                f"{where}unknown optimizer {definition.optimizer!r} in a group image"
            )
        if len(definition.names) != len(definition.shapes):
            raise ImageFormatError(
                f"{where}group image of {definition.name!r} has "
                f"{len(definition.names)} names and {len(definition.shapes)} shapes"
            )
        return definition


@dataclass(frozen=True)
class GroupImage:
    """A definition and its arrays X..., V..., H... (shapes as defined)."""

    definition: GroupDefinition
    arrays: Sequence[Array]

    def __post_init__(self) -> None:
        d = self.definition
        if len(self.arrays) != d.array_count:
            raise ImageFormatError(
                f"group image of {d.name!r} ({d.optimizer}, {len(d.names)} tensors) "
                f"needs {d.array_count} arrays, got {len(self.arrays)}"
            )
        n = len(d.shapes)
        for i, a in enumerate(self.arrays[: d.dense_array_count]):
            if a.dtype != d.dtype or tuple(a.shape) != d.shapes[i % n]:
                raise ImageFormatError(
                    f"group image of {d.name!r}: array {i} is {a.dtype} "
                    f"{tuple(a.shape)}, expected {d.dtype} {d.shapes[i % n]}"
                )
        for t, (ids, *rows) in zip(d.tables, self.table_arrays(), strict=True):
            ok = ids.dtype == np.int64 and ids.ndim == 1
            k = ids.shape[0] if ids.ndim == 1 else -1
            ok = ok and all(r.dtype == d.dtype and r.shape == (k, t.dim) for r in rows)
            if not ok or (k > 1 and not bool(np.all(ids[1:] > ids[:-1]))):
                raise ImageFormatError(
                    f"group image of {d.name!r}: ids table {t.name!r} needs int64 "
                    f"ids (k,) ascending and unique, and {d.dtype} rows (k, {t.dim}); "
                    f"got {ids.dtype} {ids.shape} and "
                    f"{[(str(r.dtype), r.shape) for r in rows]}"
                )

    def table_arrays(self) -> list[list[Array]]:
        """Per ids table: its ids, X rows, then V rows, H rows."""
        d = self.definition
        per = 2 + len(d.state_names)
        rest = list(self.arrays[d.dense_array_count :])
        return [rest[i * per : (i + 1) * per] for i in range(len(d.tables))]

    @property
    def name(self) -> str:
        return self.definition.name

    def to_json(self) -> dict[str, Any]:
        """The definition's JSON; the arrays are stored beside it, in order."""
        return self.definition.to_json()

    @classmethod
    def from_json(
        cls, doc: Mapping[str, Any], arrays: Sequence[Array], source: str = ""
    ) -> GroupImage:
        return cls(GroupDefinition.from_json(doc, source), list(arrays))
