"""Model weights files: what a trained group becomes where it is served, and back.

A group's tensors X_1..X_n, by name, to and from the files a model loader reads:

- ``.safetensors`` (Hugging Face, PyTorch): ``read_safetensors``,
  ``write_safetensors``. The tensors keep their names; an onnxps export adds, in
  the file's ``__metadata__``, the definition of each group (optimizer, learning
  rate, settings), so that an import can create the groups again.
- ``.onnx`` (ONNX Runtime), in ``onnxps.wire.onnx_weights``: ``read_onnx`` takes a
  model's float initializers (in the model's order, the order of the group's
  tensors) and its optimizer node, if any; ``write_onnx`` writes trained values
  into a copy of a model, every other byte of it unchanged.

A float32 or float64 tensor is a weight. A tensor of integers or booleans (an ONNX
model's shapes and indices, a buffer's counter) is left out, and named in
``Weights.left_out``; a float16 or bfloat16 one, or float32 among float64, is
refused: a group holds one dtype, float32 or float64. NumPy and the standard
library here; the ``onnx`` and ``safetensors`` packages are optional extras,
imported when a file needs them (``MissingExtraError`` says which to install).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

import numpy as np

from .errors import OnnxpsError

__all__ = [
    "FORMATS",
    "Format",
    "MissingExtraError",
    "Progress",
    "Weights",
    "WeightsFileError",
    "file_format",
    "need",
    "read_safetensors",
    "removed_on_error",
    "weight_dtype",
    "write_safetensors",
]

Array = np.ndarray[Any, Any]
Format = Literal["npz", "safetensors", "onnx"]
FORMATS: Mapping[str, Format] = {
    ".npz": "npz",
    ".safetensors": "safetensors",
    ".onnx": "onnx",
}
# progress(done, total): bytes of tensors read, sent or written so far
Progress = Callable[[int, int], None]
WEIGHT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class WeightsFileError(OnnxpsError, ValueError):
    """A weights file that cannot be read or written as asked; the message names
    the file, what was expected and what to do. Nothing was written."""


class MissingExtraError(OnnxpsError, ImportError):
    """An optional package a file format needs is not installed."""


def need(package: str, extra: str, what: str) -> ModuleType:
    """Import ``package``, or raise ``MissingExtraError`` naming the extra."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise MissingExtraError(
            f"{what} needs the {package} package: pip install 'onnxps[{extra}]'"
        ) from None


def file_format(path: str | os.PathLike[str]) -> Format:
    """The format of ``path`` by its extension: ``.safetensors``, ``.onnx``; any
    other name is an ``.npz`` archive of groups (as ``export`` wrote before)."""
    ext = os.path.splitext(os.fspath(path))[1].lower()
    return FORMATS.get(ext, "npz")


@dataclass(frozen=True)
class Weights:
    """The float tensors of a file, in its order, and what was left out of them.

    ``left_out``: (name, dtype) of each tensor of integers or booleans;
    ``metadata``: a safetensors file's ``__metadata__`` (empty for ONNX);
    ``training``: an ONNX model's optimizer nodes (``onnx_weights.OnnxTraining``)."""

    tensors: list[tuple[str, Array]]
    left_out: list[tuple[str, str]] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    training: list[Any] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, a in self.tensors)


def weight_dtype(path: str, name: str, dtype: np.dtype[Any]) -> bool:
    """True for a weight (float32, float64); False for a tensor to leave out
    (integers, booleans, strings); ``WeightsFileError`` for another float."""
    if dtype in WEIGHT_DTYPES:
        return True
    if dtype.kind in "iubSUO":
        return False
    raise WeightsFileError(
        f"{path}: tensor {name!r} is {_dtype_name(dtype)}; an onnxps group holds "
        "float32 or float64: convert the model's floats to float32 first"
    )


def _dtype_name(dtype: Any) -> str:
    return str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype


def one_dtype(path: str, tensors: Sequence[tuple[str, Array]]) -> None:
    """``WeightsFileError`` unless every tensor has the same dtype."""
    kinds = {str(a.dtype) for _, a in tensors}
    if len(kinds) > 1:
        first = {k: next(n for n, a in tensors if str(a.dtype) == k) for k in kinds}
        raise WeightsFileError(
            f"{path} mixes "
            + " and ".join(f"{k} ({first[k]!r}...)" for k in sorted(kinds))
            + " tensors; a group holds one dtype: convert them to one first"
        )


# -- safetensors ---------------------------------------------------------------------
# https://github.com/huggingface/safetensors: 8 bytes (little-endian u64) N, N bytes
# of JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__":
# {str: str}}, then the tensors' bytes, little-endian, C order.
_ST_DTYPES: Mapping[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}
_ST_NUMPY = {v: k for k, v in _ST_DTYPES.items()}
_HEADER_LIMIT = 100 * 1024 * 1024  # the safetensors library's own limit


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Sequence[tuple[str, Array]],
    metadata: Mapping[str, str] | None = None,
    progress: Progress | None = None,
) -> None:
    """Write ``tensors`` (names unique) to a .safetensors file, in their order.

    Written here, tensor by tensor (no copy of the whole model in memory), to a
    temporary file renamed into place once complete."""
    path = os.fspath(path)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, a in tensors:
        code = _ST_DTYPES.get(str(a.dtype))
        if code is None:
            raise WeightsFileError(f"{path}: tensor {name!r} is {a.dtype}")
        if name in header:
            raise WeightsFileError(f"{path}: tensor {name!r} given twice")
        header[name] = {
            "dtype": code,
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # the data starts 8-aligned
    tmp = f"{path}.tmp"
    done = 0
    with removed_on_error(tmp), open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for _, a in tensors:
            little = a.astype(a.dtype.newbyteorder("<"), order="C", copy=False)
            f.write(np.ascontiguousarray(little).reshape(-1).view(np.uint8).data)
            done += a.nbytes
            if progress is not None:
                progress(done, offset)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def removed_on_error(path: str) -> Iterator[None]:
    """Remove the temporary file ``path`` when the block raises (a full disk, an
    interrupt): a failed write leaves nothing behind."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path)
        raise


def _safetensors_header(path: str) -> tuple[dict[str, Any], int]:
    """The JSON header, and where the tensors' bytes start."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > _HEADER_LIMIT:
            raise WeightsFileError(f"{path} is not a safetensors file (header size)")
        header = json.loads(f.read(size).decode("utf-8"))
    if not isinstance(header, dict):
        raise WeightsFileError(f"{path} is not a safetensors file")
    return header, 8 + size


def _span(entry: Mapping[str, Any]) -> int:
    begin, end = entry["data_offsets"]
    return int(end) - int(begin)


def read_safetensors(
    path: str | os.PathLike[str], progress: Progress | None = None
) -> Weights:
    """The float tensors of a .safetensors file, in the order of their bytes in
    it (the order they were written). The ``safetensors`` package checks the file
    (its header, that the tensors' bytes are where it says); each tensor is then
    read straight into its array (one copy of the model in memory)."""
    path = os.fspath(path)
    st = need("safetensors", "safetensors", "reading a .safetensors file")
    try:
        header, start = _safetensors_header(path)
        with st.safe_open(path, framework="numpy"):
            pass
    except WeightsFileError:
        raise
    except OSError as exc:
        raise WeightsFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # JSON, UTF-8, the library's SafetensorError
        raise WeightsFileError(f"{path} is not a safetensors file ({exc})") from None
    metadata = header.pop("__metadata__", None) or {}
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    chosen = []
    left_out = []
    for name, entry in entries:
        numpy_name = _ST_NUMPY.get(entry["dtype"])
        if numpy_name is None:  # BF16, F8_*: floats a group cannot hold
            raise WeightsFileError(
                f"{path}: tensor {name!r} is {entry['dtype']}; an onnxps group holds "
                "float32 or float64: convert the model's floats to float32 first"
            )
        if weight_dtype(path, name, np.dtype(numpy_name)):
            chosen.append(name)
        else:
            left_out.append((name, numpy_name))
    total = sum(_span(header[n]) for n in chosen)
    tensors = []
    done = 0
    with open(path, "rb") as f:
        for name in chosen:
            entry = header[name]
            dtype = np.dtype(_ST_NUMPY[entry["dtype"]]).newbyteorder("<")
            shape = tuple(int(d) for d in entry["shape"])
            f.seek(start + int(entry["data_offsets"][0]))
            a = np.fromfile(f, dtype, int(np.prod(shape, dtype=np.int64))).reshape(
                shape
            )
            tensors.append((name, a.astype(dtype.newbyteorder("="), copy=False)))
            done += a.nbytes
            if progress is not None:
                progress(done, total)
    one_dtype(path, tensors)
    return Weights(tensors, left_out, dict(metadata))
