"""Export groups to one .npz file and import them into another server.

The file is a NumPy ``.npz`` archive (``np.savez``, no pickle): a ``metadata`` entry
holding UTF-8 JSON (uint8 array) with one ``GroupImage`` JSON per group
(``onnxps.wire.image``), and per group ``i`` its arrays ``g<i>/<k>`` in ONNX output
order: X_1..X_n, then V_1..V_n, then H_1..H_n, then per ids table its ids, X rows,
V rows, H rows (``GroupImage``). See docs/FORMAT.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import numpy as np
from onnxps.wire.encoding import Encoding
from onnxps.wire.image import (
    ConsistencyDefinition,
    GroupDefinition,
    GroupImage,
    TableDefinition,
)
from onnxps.wire.initializers import IdsTable, initializer_from_json

from ._errors import OnnxpsError
from ._optimizers import Adagrad, Adam, Async, Momentum, OptimizerSpec, Sync

if TYPE_CHECKING:
    from ._ops import Op
    from ._records import GroupInfo

__all__ = [
    "EXPORT_FORMAT_VERSION",
    "OPTIMIZERS",
    "ExportFileError",
    "Existing",
    "ImportResult",
    "consistency_of",
    "definition_of",
    "export_op",
    "import_groups",
    "import_op",
    "optimizer_of",
    "read_export",
]

Existing = Literal["fail", "skip", "replace"]
Array = np.ndarray[Any, Any]
R = TypeVar("R")


class TransferHost(Protocol):
    """The client operations an export or import composes (``ClientCore``'s)."""

    def _describe_group(
        self, name: str, *, timeout: float | None = None
    ) -> Op[GroupInfo]: ...

    def _list_groups(
        self, prefix: str = "", *, timeout: float | None = None
    ) -> Op[list[GroupInfo]]: ...

    def _delete_group(self, name: str, *, timeout: float | None = None) -> Op[bool]: ...

    def _create_group(
        self,
        name: str,
        optimizer: OptimizerSpec,
        *,
        learning_rate: float,
        tensors: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
        consistency: Async | Sync | None = None,
        allow_non_finite: bool = False,
        state: Sequence[Any] | None = None,
        update_count: int = 0,
        lease_seconds: float | None = None,
        tables: Mapping[str, IdsTable] | None = None,
        table_rows: Sequence[Sequence[Any]] | None = None,
        timeout: float | None = None,
    ) -> Op[GroupInfo]: ...

    def _pull_versioned(
        self,
        group: str,
        *,
        state: bool = False,
        min_version: int | None = None,
        encoding: Encoding | None = None,
        timeout: float | None = None,
        out: Sequence[Array] | None = None,
        allow_parts_apart: bool = False,
    ) -> Op[tuple[int, list[Array]]]: ...

    def _export_rows(
        self,
        group: str,
        table: str,
        *,
        state: bool = False,
        page_size: int = 0,
        timeout: float | None = None,
    ) -> Op[tuple[Array, dict[str, Array]]]: ...


class BlockingTransferHost(TransferHost, Protocol):
    """A blocking client: it runs an operation to its result (``Client._run``)."""

    def _run(self, op: Op[R]) -> R: ...


class ExportFileError(OnnxpsError, ValueError):
    """An export file that cannot be read, or whose groups cannot be imported as
    asked; nothing was created. ``existing`` names the file's groups the server
    has already, when that is why (``existing="fail"``)."""

    def __init__(self, message: str, existing: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.existing = list(existing)


@dataclass(frozen=True)
class ImportResult:
    """What an import did with each group of the file, in file order."""

    imported: list[str]  # created, replaced or updated
    created: list[str]
    replaced: list[str]
    skipped: list[str]
    # .safetensors, .onnx: groups the server had, given the file's X (the rest kept)
    updated: list[str] = field(default_factory=list)
    # .safetensors, .onnx: (name, dtype) of the tensors of integers or booleans
    left_out: list[tuple[str, str]] = field(default_factory=list)


EXPORT_FORMAT = "onnxps-export"
EXPORT_FORMAT_VERSION = 2
OPTIMIZERS: dict[str, type[Adagrad] | type[Momentum] | type[Adam]] = {
    "Adagrad": Adagrad,
    "Momentum": Momentum,
    "Adam": Adam,
}


def definition_of(
    info: GroupInfo, update_count: int, learning_rate: float | None = None
) -> GroupDefinition:
    """The saved form of a group the server described (``learning_rate``: as
    described apart, when newer than ``info``'s)."""
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
        learning_rate=(info.learning_rate if learning_rate is None else learning_rate),
        update_count=update_count,
        dtype=info.dtype,
        names=tuple(n for n, _ in info.tensors),
        shapes=tuple(s for _, s in info.tensors),
        consistency=consistency,
        allow_non_finite=info.allow_non_finite,
        lease_seconds=info.lease_seconds,
        tables=tuple(
            TableDefinition(t.name, t.dim, t.initializer.to_json(), t.max_rows)
            for t in info.tables.values()
        ),
    )


def export_op(
    client: TransferHost,
    path: str | os.PathLike[str],
    prefix: str = "",
    group: str | None = None,
) -> Op[list[str]]:
    """Write every group whose name starts with ``prefix`` (or the one named
    ``group``); returns their names.

    Each group's tensors, state and T come from one pull, so they belong together.
    """
    images: list[GroupImage] = []
    infos = yield from client._list_groups(prefix)
    if group is not None:
        infos = [info for info in infos if info.name == group]
        if not infos:
            raise ExportFileError(
                f"the server has no group {group!r} (onnxps status lists them)"
            )
    for info in infos:
        if info.tensors:
            # parts that disagree are written as they are (T the lowest): an
            # export and import is how they are made to agree again
            pulled = client._pull_versioned(
                info.name, state=True, allow_parts_apart=True
            )
            t, values = yield from pulled
        else:
            t, values = info.update_count, []
        lr = (yield from client._describe_group(info.name)).learning_rate
        for table in info.tables:
            # An ids table is read page by page: export a group no one pushes to
            # for one consistent T (the image takes the dense pull's).
            ids, rows = yield from client._export_rows(info.name, table, state=True)
            values += [ids, *rows.values()]
        images.append(GroupImage(definition_of(info, t, lr), values))
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
    """Every group of an export file, all read and checked before this returns.

    Raises ``ExportFileError`` (naming the file and what is wrong with it) for a
    missing file, a file that is not an export, or a group that does not check.
    """
    path = os.fspath(path)
    try:
        return _read(path)
    except ExportFileError:
        raise
    except OSError as exc:
        raise ExportFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError, zipfile.BadZipFile, EOFError) as exc:
        raise ExportFileError(f"{path} is not an onnxps export file ({exc})") from None


def _read(path: str) -> list[GroupImage]:
    with np.load(path, allow_pickle=False) as z:
        if not isinstance(z, np.lib.npyio.NpzFile) or "metadata" not in z:
            raise ExportFileError(f"{path} is not an onnxps export file (no metadata)")
        metadata = json.loads(z["metadata"].tobytes().decode("utf-8"))
        if not isinstance(metadata, dict) or metadata.get("format") != EXPORT_FORMAT:
            raise ExportFileError(f"{path} is not an onnxps export file")
        version = metadata.get("format_version")
        if version != EXPORT_FORMAT_VERSION:
            raise ExportFileError(
                f"{path} has format_version {version!r}; this onnxps reads version "
                f"{EXPORT_FORMAT_VERSION}"
            )
        images = []
        for i, doc in enumerate(metadata["groups"]):
            definition = GroupDefinition.from_json(doc, path)
            arrays = [z[f"g{i}/{k}"] for k in range(definition.array_count)]
            images.append(GroupImage(definition, arrays))
    names = [image.name for image in images]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ExportFileError(f"{path} holds group {', '.join(twice)} more than once")
    return images


def optimizer_of(definition: GroupDefinition) -> OptimizerSpec:
    """The optimizer node of a saved group."""
    return OPTIMIZERS[definition.optimizer](**definition.attributes)


def consistency_of(c: ConsistencyDefinition) -> Async | Sync:
    """The consistency of a saved group."""
    if c.mode == "sync":
        return Sync(c.sync_workers, "sum" if c.reduction == "sum" else "mean")
    return Async(c.max_staleness)


def import_op(
    client: TransferHost,
    path: str | os.PathLike[str],
    *,
    existing: Existing = "fail",
    group: str | None = None,
) -> Op[ImportResult]:
    """Create every group of an export file (or the one named ``group``), with its
    state, T and learning rate.

    The whole file is read and checked first. A group the server already has is an
    error before anything is created (``existing="fail"``), left as it is
    (``"skip"``), or deleted and created from the file (``"replace"``).
    """
    if existing not in ("fail", "skip", "replace"):
        raise ValueError(f"existing must be fail, skip or replace, got {existing!r}")
    images = read_export(path)
    if group is not None:
        images = [image for image in images if image.name == group]
        if not images:
            raise ExportFileError(f"{os.fspath(path)} holds no group {group!r}")
    on_server = {info.name for info in (yield from client._list_groups())}
    clashes = [image.name for image in images if image.name in on_server]
    if clashes and existing == "fail":
        raise ExportFileError(
            f"the server already has {_count(clashes, 'group')} of {os.fspath(path)}: "
            f'{", ".join(clashes)}; nothing was imported (existing="skip" keeps '
            "the server's, existing=\"replace\" deletes them and imports the file's)",
            clashes,
        )
    imported: list[str] = []
    created: list[str] = []
    replaced: list[str] = []
    skipped: list[str] = []
    for image in images:
        if image.name in on_server:
            if existing == "skip":
                skipped.append(image.name)
                continue
            yield from client._delete_group(image.name)
            replaced.append(image.name)
        else:
            created.append(image.name)
        yield from _create(client, image)
        imported.append(image.name)
    return ImportResult(imported, created, replaced, skipped)


def _count(items: Sequence[Any], noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def _create(client: TransferHost, image: GroupImage) -> Op[GroupInfo]:
    d = image.definition
    n = len(d.names)
    return client._create_group(
        d.name,
        optimizer_of(d),
        learning_rate=d.learning_rate,
        tensors=list(zip(d.names, image.arrays[:n], strict=True)),
        consistency=consistency_of(d.consistency),
        allow_non_finite=d.allow_non_finite,
        state=image.arrays[n : d.dense_array_count],
        update_count=d.update_count,
        lease_seconds=d.lease_seconds,
        tables={
            t.name: IdsTable(
                t.dim, initializer_from_json(t.initializer), t.max_rows, d.dtype
            )
            for t in d.tables
        },
        table_rows=image.table_arrays() if d.tables else None,
    )


def import_groups(
    client: BlockingTransferHost,
    path: str | os.PathLike[str],
    *,
    existing: Existing = "fail",
    group: str | None = None,
) -> ImportResult:
    """``import_op`` run by a blocking client (``onnxps import``)."""
    return client._run(import_op(client, path, existing=existing, group=group))
