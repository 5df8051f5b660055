"""Snapshots on disk: one directory of .npy files plus a JSON manifest per generation.

Writing goes to ``snap-<gen>.tmp``; every file is fsynced, the manifest (with the
sha256 and size of every file, and a sha256 of the manifest itself) is written last,
then the directory is renamed to ``snap-<gen>`` and its parent fsynced. A snapshot
directory without the ``.tmp`` suffix is therefore complete unless it was damaged or
edited afterwards, which the checksums catch. The layout is documented in
docs/FORMAT.md.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnxps.wire.image import GroupImage, ImageFormatError

from ..store._group import GroupCapture, GroupRuntime
from ._wal import _write_all, c_order, fsync_dir

__all__ = [
    "FORMAT_VERSION",
    "Manifest",
    "SaveResult",
    "SnapshotError",
    "list_snapshots",
    "load_group",
    "load_snapshot",
    "read_manifest",
    "write_snapshot",
]

Array = np.ndarray[Any, Any]

FORMAT = "onnxps-snapshot"
FORMAT_VERSION = 3  # 3: the manifest carries its own sha256
LEGACY_VERSIONS = (2,)  # read without a manifest checksum (written before it existed)
MANIFEST = "manifest.json"
MANIFEST_SHA256 = "manifest_sha256"
_BLOCK = 16 << 20


class SnapshotError(Exception):
    """A snapshot that cannot be loaded; the message names the file and why."""


@dataclass(frozen=True)
class Manifest:
    """The checked facts of a snapshot's ``manifest.json``."""

    path: str  # of manifest.json
    generation: int
    wal_lsn: int  # every log record up to this one is in the snapshot
    groups: list[dict[str, Any]]
    files: dict[str, Any]


@dataclass(frozen=True)
class SaveResult:
    """A snapshot written: its directory, how many groups, how many bytes."""

    path: str
    groups: int
    bytes: int


_HASHER: ThreadPoolExecutor | None = None


def _hasher() -> ThreadPoolExecutor:
    """One thread that hashes while the caller does I/O (both release the GIL).

    A single worker runs submitted updates in order, so chunks hash in file order.
    """
    global _HASHER
    if _HASHER is None:
        _HASHER = ThreadPoolExecutor(1, thread_name_prefix="onnxps-sha256")
    return _HASHER


def snapshot_dir_name(gen: int) -> str:
    return f"snap-{gen:012d}"


def list_snapshots(root: str) -> list[tuple[int, str]]:
    """(generation, path) of every finished snapshot directory, newest first."""
    out = []
    for entry in os.listdir(root):
        if entry.startswith("snap-") and not entry.endswith(".tmp"):
            try:
                out.append((int(entry[5:]), os.path.join(root, entry)))
            except ValueError:
                continue
    return sorted(out, reverse=True)


def next_generation(root: str) -> int:
    gens = [0]
    for entry in os.listdir(root):
        digits = entry[5:].removesuffix(".tmp")
        if entry.startswith("snap-") and digits.isdigit():
            gens.append(int(digits))
    return max(gens) + 1


def _write_array(directory: str, name: str, a: Array, files: dict[str, Any]) -> str:
    a = c_order(a)
    head = io.BytesIO()
    fmt = np.lib.format
    fmt.write_array_header_1_0(head, fmt.header_data_from_array_1_0(a))
    header = head.getvalue()
    data = a.reshape(-1).data.cast("B")
    sha = hashlib.sha256(header)
    hashed = _hasher().submit(sha.update, data)
    fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        _write_all(fd, header)
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
        hashed.result()
    files[name] = {"sha256": sha.hexdigest(), "bytes": len(header) + len(data)}
    return name


def _write_group(
    directory: str, idx: int, captured: GroupCapture, files: dict[str, Any]
) -> dict[str, Any]:
    prefix = f"g{idx:05d}"
    runtime = captured.runtime
    clients: list[list[Any]] = []
    rows: list[list[int]] = []
    for cid, (floor, results) in runtime.dedup.items():
        clients.append([cid, int(floor), len(results)])
        rows.extend([s, t, int(a)] for s, t, a in results)
    table = np.array(rows, dtype=np.uint64).reshape(-1, 3)
    return (
        {
            "image": captured.image.to_json(),
            "arrays": [
                _write_array(directory, f"{prefix}-a{j}.npy", a, files)
                for j, a in enumerate(captured.image.arrays)
            ],
            "covered_lsn": runtime.covered_lsn,
            "workers": list(runtime.workers),
            "dead": list(runtime.dead),
            "pending": [
                [
                    key,
                    [
                        _write_array(directory, f"{prefix}-p{k}-{j}.npy", a, files)
                        for j, a in enumerate(arrays)
                    ],
                ]
                for k, (key, arrays) in enumerate(sorted(runtime.pending.items()))
            ],
            "dedup": {
                "clients": clients,
                "file": _write_array(directory, f"{prefix}-dedup.npy", table, files),
            },
        }
        | ({"created_by": runtime.created_by} if runtime.created_by else {})
        | ({"rewound": list(runtime.rewound)} if runtime.rewound[1] else {})
    )


def write_snapshot(
    root: str, gen: int, captures: Iterable[GroupCapture], wal_lsn: int
) -> SaveResult:
    """Write the groups (the caller captures them one at a time) as ``gen``."""
    final = os.path.join(root, snapshot_dir_name(gen))
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp)
    try:
        files: dict[str, Any] = {}
        groups: list[dict[str, Any]] = []
        for captured in captures:
            groups.append(_write_group(tmp, len(groups), captured, files))
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "generation": gen,
            "created_unix": time.time(),
            "wal_lsn": wal_lsn,
            "groups": groups,
            "files": files,
        }
        manifest[MANIFEST_SHA256] = _manifest_digest(manifest)
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        os.rename(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = sum(v["bytes"] for v in files.values())
    return SaveResult(final, len(groups), total)


def _read_array(directory: str, name: str, expect: dict[str, Any]) -> Array:
    path = os.path.join(directory, name)
    try:
        size = os.path.getsize(path)
        if size != expect["bytes"]:
            raise SnapshotError(
                f"{path}: {size} bytes on disk, the manifest says {expect['bytes']} "
                "(truncated or overwritten)"
            )
        sha = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            if dtype.hasobject or fortran:
                raise SnapshotError(f"{path}: not a plain C-order numeric array")
            header_len = f.tell()
            f.seek(0)
            sha.update(f.read(header_len))
            out = np.empty(shape, dtype=dtype)
            view = out.reshape(-1).data.cast("B")
            pos, hashed = 0, None
            while pos < len(view):
                n = f.readinto(view[pos : pos + _BLOCK])
                if not n:
                    raise SnapshotError(f"{path}: ends before its array data")
                hashed = _hasher().submit(sha.update, view[pos : pos + n])
                pos += n
            if hashed is not None:
                hashed.result()  # one worker in order: the last done means all done
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{path}: unreadable: {exc}") from exc
    if sha.hexdigest() != expect["sha256"]:
        raise SnapshotError(f"{path}: sha256 does not match the manifest (damaged)")
    return out


def _manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON, without its own checksum field."""
    rest = {k: v for k, v in manifest.items() if k != MANIFEST_SHA256}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def read_manifest(directory: str) -> Manifest:
    """The manifest of a snapshot, checked; raises SnapshotError naming it and why.

    The format and version are checked first (another version may hash otherwise),
    then the manifest's own sha256 (an edited or bit-flipped manifest), then that
    every field is there with the right type.
    """
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{path}: unreadable manifest: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SnapshotError(f"{path}: not an onnxps snapshot manifest")
    version = doc.get("format_version")
    if version != FORMAT_VERSION and version not in LEGACY_VERSIONS:
        raise SnapshotError(
            f"{path}: format_version {version!r}, this server reads version "
            f"{FORMAT_VERSION}; use the onnxps release that wrote it"
        )
    if version == FORMAT_VERSION:
        recorded = doc.get(MANIFEST_SHA256)
        if recorded is None:
            raise SnapshotError(f"{path}: has no {MANIFEST_SHA256} (damaged)")
        if recorded != _manifest_digest(doc):
            raise SnapshotError(
                f"{path}: {MANIFEST_SHA256} does not match the manifest "
                "(edited or damaged)"
            )
    try:
        manifest = Manifest(
            path=path,
            generation=_int(doc["generation"]),
            wal_lsn=_int(doc["wal_lsn"]),
            groups=list(doc["groups"]),
            files=dict(doc["files"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotError(f"{path}: malformed manifest: {exc!r}") from exc
    if manifest.wal_lsn < 0:
        raise SnapshotError(f"{path}: wal_lsn {manifest.wal_lsn} is negative")
    return manifest


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def load_snapshot(directory: str) -> tuple[Manifest, list[GroupCapture]]:
    """The manifest and every group; raises SnapshotError naming the bad file."""
    manifest = read_manifest(directory)
    path, files = manifest.path, manifest.files

    def read(name: str) -> Array:
        if not isinstance(name, str) or not isinstance(files.get(name), dict):
            raise SnapshotError(f"{path}: lists {name!r} without a checksum")
        return _read_array(directory, name, files[name])

    try:
        groups = [_read_group(entry, read, path) for entry in manifest.groups]
    except (ImageFormatError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SnapshotError(f"{path}: malformed group entry: {exc!r}") from exc
    return manifest, groups


def load_group(directory: str, index: int) -> GroupCapture:
    """Group ``index`` of the snapshot's manifest, alone (its files only are read
    and checked); raises SnapshotError naming the bad file."""
    manifest = read_manifest(directory)
    path, files = manifest.path, manifest.files

    def read(name: str) -> Array:
        if not isinstance(name, str) or not isinstance(files.get(name), dict):
            raise SnapshotError(f"{path}: lists {name!r} without a checksum")
        return _read_array(directory, name, files[name])

    try:
        return _read_group(manifest.groups[index], read, path)
    except (ImageFormatError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SnapshotError(f"{path}: malformed group entry: {exc!r}") from exc


def _rewound(value: Any) -> tuple[int, int]:
    to_step, from_step = value
    return int(to_step), int(from_step)


def _read_group(
    entry: dict[str, Any], read: Callable[[str], Array], path: str
) -> GroupCapture:
    image = GroupImage.from_json(
        entry["image"], [read(n) for n in entry["arrays"]], path
    )
    table = read(entry["dedup"]["file"])
    dedup, row = {}, 0
    for cid, floor, count in entry["dedup"]["clients"]:
        rows = table[row : row + count]
        dedup[cid] = (int(floor), [(int(s), int(t), int(a)) for s, t, a in rows])
        row += count
    runtime = GroupRuntime(
        covered_lsn=int(entry["covered_lsn"]),
        workers=tuple(entry["workers"]),
        dead=tuple(entry["dead"]),
        pending={k: [read(n) for n in names] for k, names in entry["pending"]},
        dedup=dedup,
        created_by=str(entry.get("created_by", "")),
        rewound=_rewound(entry.get("rewound", (0, 0))),
    )
    return GroupCapture(image, runtime)
