"""An ONNX model's initializers as weights: read them, and write trained values into
a copy of the model with every other byte unchanged.

``read_onnx`` parses the model with the ``onnx`` package. ``write_onnx`` checks the
values against the base model (``onnx`` again: names, dtypes, shapes), then copies
the base file and overwrites, in place, the bytes that hold each initializer's data:
its ``raw_data``, or its packed ``float_data``/``double_data``. A tensor of the same
dtype and shape has data of the same length, so no length prefix of the protobuf
changes, and the copy differs from the base only inside those data bytes (no
re-serialization: the graph, the metadata, the field order and every unknown field
are the base's bytes). The spans are found by walking the protobuf wire format of
``ModelProto.graph`` (field 7) and ``GraphProto.initializer`` (field 5) here.
"""

from __future__ import annotations

import mmap
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .weights import (
    Progress,
    Weights,
    WeightsFileError,
    need,
    one_dtype,
    removed_on_error,
    weight_dtype,
)

__all__ = [
    "TRAINING_DOMAIN",
    "OnnxTarget",
    "OnnxTraining",
    "OnnxWritten",
    "initializer_spans",
    "onnx_target",
    "read_onnx",
    "training_nodes",
    "write_onnx",
    "write_onnx_into",
]

Array = np.ndarray[Any, Any]

# field numbers of onnx.proto3
_MODEL_GRAPH = 7
_GRAPH_INITIALIZER = 5
_TENSOR_NAME = 8
_TENSOR_DATA = {9: "raw_data", 4: "float_data", 10: "double_data"}
_LEN = 2


TRAINING_DOMAIN = "ai.onnx.preview.training"
# inputs per tensor of each operator: X, G, then its accumulators
_PER_TENSOR = {"Adagrad": 3, "Momentum": 3, "Adam": 4}


@dataclass(frozen=True)
class OnnxTraining:
    """An optimizer node of a model's training information (``TrainingInfoProto``
    algorithm): the operator, its attributes (ONNX names), its learning rate R when
    the algorithm holds it as a constant initializer, and the tensors X it updates,
    in its input order."""

    optimizer: str  # "Adagrad", "Momentum" or "Adam"
    attributes: dict[str, Any]
    learning_rate: float | None
    tensors: list[str]


def training_nodes(model: Any, onnx: Any) -> list[OnnxTraining]:
    """The ``ai.onnx.preview.training`` optimizer nodes of a parsed model's
    training information, in order."""
    found = []
    for info in model.training_info:
        constants = {t.name: t for t in info.algorithm.initializer}
        for node in info.algorithm.node:
            per = _PER_TENSOR.get(node.op_type)
            if node.domain != TRAINING_DOMAIN or per is None:
                continue
            n = (len(node.input) - 2) // per
            attributes = {}
            for a in node.attribute:
                value = onnx.helper.get_attribute_value(a)
                attributes[a.name] = (
                    value.decode() if isinstance(value, bytes) else value
                )
            r = constants.get(node.input[0]) if node.input else None
            lr = None
            if r is not None:
                value = np.asarray(onnx.numpy_helper.to_array(r))
                lr = float(value) if value.size == 1 else None
            found.append(
                OnnxTraining(node.op_type, attributes, lr, list(node.input[2 : 2 + n]))
            )
    return found


@dataclass(frozen=True)
class OnnxWritten:
    """What ``write_onnx`` did: the initializers it wrote, and the float
    initializers of the base model it left as they were (in model order)."""

    written: list[str]
    kept: list[str]


def _varint(buf: Any, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _fields(buf: Any, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, start, end) of each field of the message at
    buf[start:end]: the payload's bounds for length-delimited fields, else the
    bounds of the value's bytes."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        number, kind = key >> 3, key & 7
        if kind == 0:
            begin = pos
            _, pos = _varint(buf, pos)
            yield number, kind, begin, pos
        elif kind == 1 or kind == 5:
            width = 8 if kind == 1 else 4
            yield number, kind, pos, pos + width
            pos += width
        elif kind == _LEN:
            size, pos = _varint(buf, pos)
            yield number, kind, pos, pos + size
            pos += size
        else:
            raise ValueError(f"protobuf wire type {kind} (groups) in field {number}")
    if pos != end:
        raise ValueError("a field runs past the end of its message")


def _one(buf: Any, start: int, end: int, number: int, what: str) -> tuple[int, int]:
    found = [(s, e) for n, k, s, e in _fields(buf, start, end) if n == number]
    if len(found) != 1:
        raise ValueError(f"{len(found)} {what} fields, expected 1")
    return found[0]


def initializer_spans(buf: Any) -> dict[str, tuple[int, int, str]]:
    """Name -> (start, end, field) of the data bytes of each initializer of the
    serialized model ``buf`` (end == start when it has no data bytes, as an empty
    tensor). ValueError when the bytes are not a model laid out as expected."""
    g0, g1 = _one(buf, 0, len(buf), _MODEL_GRAPH, "ModelProto.graph")
    spans: dict[str, tuple[int, int, str]] = {}
    for number, kind, t0, t1 in _fields(buf, g0, g1):
        if number != _GRAPH_INITIALIZER or kind != _LEN:
            continue
        name = ""
        data: list[tuple[int, int, str, int]] = []
        for n, k, s, e in _fields(buf, t0, t1):
            if n == _TENSOR_NAME:
                name = bytes(buf[s:e]).decode("utf-8")
            elif n in _TENSOR_DATA:
                data.append((s, e, _TENSOR_DATA[n], k))
        if name in spans:
            raise ValueError(f"initializer {name!r} twice")
        if len(data) > 1 or any(k != _LEN for *_, k in data):
            field = data[0][2]
            raise ValueError(
                f"initializer {name!r} holds its {field} in {len(data)} pieces "
                "(unpacked): save the model with onnx.save first"
            )
        s, e, field, _ = data[0] if data else (t1, t1, "raw_data", _LEN)
        spans[name] = (s, e, field)
    return spans


def _load(path: str, onnx: Any) -> Any:
    try:
        return onnx.load(path, load_external_data=False)
    except OSError as exc:
        raise WeightsFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # protobuf's DecodeError and the like
        raise WeightsFileError(f"{path} is not an ONNX model ({exc})") from None


def _np_dtype(path: str, t: Any, onnx: Any) -> np.dtype[Any]:
    if t.data_location == onnx.TensorProto.EXTERNAL:
        raise WeightsFileError(
            f"{path}: initializer {t.name!r} is stored in an external file; onnxps "
            "reads and writes models whose initializers are inside the .onnx file "
            "(onnx.load, then onnx.save with save_as_external_data=False)"
        )
    try:
        dtype: np.dtype[Any] = np.dtype(
            onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
        )
    except Exception:
        raise WeightsFileError(
            f"{path}: initializer {t.name!r} has ONNX data_type {t.data_type}, "
            "which onnx does not map to a NumPy dtype"
        ) from None
    return dtype


def read_onnx(
    path: str | os.PathLike[str], progress: Progress | None = None
) -> Weights:
    """The float32/float64 initializers of an ONNX model, in the model's order;
    integer and boolean initializers (shapes, indices) and sparse ones are left out
    and named in ``left_out``."""
    path = os.fspath(path)
    onnx = need("onnx", "onnx", "reading an .onnx model")
    model = _load(path, onnx)
    total = 0
    chosen = []
    left_out = []
    for t in model.graph.initializer:
        dtype = _np_dtype(path, t, onnx)
        if weight_dtype(path, t.name, dtype):
            chosen.append(t)
            total += int(np.prod(t.dims, dtype=np.int64)) * dtype.itemsize
        else:
            left_out.append((t.name, str(dtype)))
    left_out += [(s.values.name, "sparse") for s in model.graph.sparse_initializer]
    tensors = []
    done = 0
    for t in chosen:
        a = np.asarray(onnx.numpy_helper.to_array(t))
        tensors.append((t.name, a.astype(a.dtype.newbyteorder("="), copy=False)))
        done += a.nbytes
        if progress is not None:
            progress(done, total)
    one_dtype(path, tensors)
    return Weights(tensors, left_out, training=training_nodes(model, onnx))


Layout = Mapping[str, tuple[np.dtype[Any], tuple[int, ...]]]


@dataclass(frozen=True)
class OnnxTarget:
    """A model checked to take tensors of a layout (``onnx_target``): where each
    one's data bytes lie in it, and its float initializers not among them."""

    base: str
    layout: dict[str, tuple[np.dtype[Any], tuple[int, ...]]]
    spans: dict[str, tuple[int, int, str]]
    kept: list[str]


def _spans(base: str) -> dict[str, tuple[int, int, str]]:
    with open(base, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)
        try:
            return initializer_spans(view)
        except ValueError as exc:
            why = f"{base}: cannot locate its initializers ({exc})"
            raise WeightsFileError(why) from None
        finally:
            view.release()


def onnx_target(base: str | os.PathLike[str], layout: Layout) -> OnnxTarget:
    """Check that the model ``base`` has an initializer of each name of ``layout``
    with its dtype and shape, stored where it can be written in place;
    ``WeightsFileError`` (saying what to do) otherwise. Values are not needed
    yet: a group is checked before it is pulled."""
    base = os.fspath(base)
    onnx = need("onnx", "onnx", "writing an .onnx model")
    model = _load(base, onnx)
    inits = {t.name: t for t in model.graph.initializer}
    stray = [n for n in layout if n not in inits]
    if stray:
        raise WeightsFileError(
            f"{base} has no initializer {', '.join(map(repr, stray))}: the tensors "
            "written into a model are its initializers, by name (the model has "
            f"{', '.join(map(repr, list(inits)[:8]))}{'...' if len(inits) > 8 else ''})"
        )
    dtypes = {n: _np_dtype(base, t, onnx) for n, t in inits.items()}
    for name, (dtype, shape) in layout.items():
        have = (dtypes[name], tuple(inits[name].dims))
        if have != (np.dtype(dtype), tuple(shape)):
            raise WeightsFileError(
                f"{base}: initializer {name!r} is {have[0]} {have[1]}, the value "
                f"to write is {np.dtype(dtype)} {tuple(shape)}: write a group made "
                "from this model (onnxps import MODEL.onnx)"
            )
    kept = [
        n for n in inits if n not in layout and dtypes[n] in (np.float32, np.float64)
    ]
    del model, inits
    spans = _spans(base)
    for name, (dtype, shape) in layout.items():
        start, end, field = spans[name]
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if end - start != nbytes:
            raise WeightsFileError(
                f"{base}: initializer {name!r} holds {end - start} bytes of "
                f"{field} for {nbytes} bytes of values (stored in another field): "
                "save the model with onnx.save first"
            )
    checked = {n: (np.dtype(d), tuple(s)) for n, (d, s) in layout.items()}
    return OnnxTarget(base, checked, {n: spans[n] for n in layout}, kept)


def write_onnx_into(
    target: OnnxTarget,
    path: str | os.PathLike[str],
    values: Mapping[str, Array],
    progress: Progress | None = None,
) -> OnnxWritten:
    """Write a copy of the checked model to ``path`` with ``values`` (the target's
    layout) in place of its initializers' data, every other byte its own."""
    path = os.fspath(path)
    now = _spans(target.base)
    if any(now.get(n) != span for n, span in target.spans.items()):
        raise WeightsFileError(f"{target.base} changed since it was checked: again")
    data = {}
    for name, value in values.items():
        a = np.asarray(value)
        if target.layout.get(name) != (a.dtype, a.shape):
            raise WeightsFileError(
                f"{name!r} is {a.dtype} {a.shape}, not as {target.base} was checked "
                f"for: {target.layout.get(name)}"
            )
        little = a.astype(a.dtype.newbyteorder("<"), copy=False)
        data[name] = np.ascontiguousarray(little)
    if set(data) != set(target.layout):
        raise WeightsFileError(
            f"the values are not the tensors {target.base} was checked for"
        )
    tmp = f"{path}.tmp"
    total = sum(a.nbytes for a in data.values())
    done = 0
    with removed_on_error(tmp):
        shutil.copyfile(target.base, tmp)
        with open(tmp, "r+b") as out:
            for name, a in data.items():
                out.seek(target.spans[name][0])
                out.write(a.reshape(-1).view(np.uint8).data)
                done += a.nbytes
                if progress is not None:
                    progress(done, total)
            out.flush()
            os.fsync(out.fileno())
    os.replace(tmp, path)
    return OnnxWritten(list(data), target.kept)


def write_onnx(
    base: str | os.PathLike[str],
    path: str | os.PathLike[str],
    values: Mapping[str, Array],
    progress: Progress | None = None,
) -> OnnxWritten:
    """Write a copy of the model ``base`` to ``path`` with the initializers named in
    ``values`` holding those values (same dtype and shape as in ``base``), every
    other byte as in ``base``."""
    arrays = {n: np.asarray(a) for n, a in values.items()}
    target = onnx_target(base, {n: (a.dtype, a.shape) for n, a in arrays.items()})
    return write_onnx_into(target, path, arrays, progress)
