"""A group's tensors as one flat buffer: per-tensor views over one allocation.

A group of many small tensors (a model's biases and norms) used to pay every
per-tensor cost once per tensor and per push: a kernel call per tensor and array,
a finiteness check per gradient, a copy per tensor for a pull. As torch's
multi-tensor kernels and FSDP's flat parameters do, a group keeps X, V and H each
as ONE contiguous buffer and hands out per-tensor views of it (names, shapes and
the ONNX order unchanged); a push whose gradients arrive in one flat buffer
(``FlatArrays``) steps the whole group as one array, in cache-sized blocks that
ignore tensor boundaries. The step is element-wise with per-group scalars, so the
result is bit for bit the one of stepping each tensor alone.

The wire has the same form (``layout_digest``): a push or pull that names the
group's layout digest carries its tensors as ONE tensor of the group's elements
back to back, checked by one digest, one element count and one dtype instead of
a header per tensor (docs/protocol.md, "The flat form").
"""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "FlatArrays",
    "FlatLayout",
    "FlatValues",
    "flat_views",
    "kept_flat",
    "layout_digest",
    "per_tensor",
]

Array = np.ndarray[Any, Any]


class FlatArrays(list[Array]):
    """Arrays that are views, in order and back to back, of one C-contiguous 1-D
    buffer (``flat``): a push's gradients read into one allocation.

    ``unviewed`` holds no views until ``viewed`` makes them: a flat push (the
    flat form) is stepped as one array, and only a WAL record, a sync round's
    buffer or a message naming one gradient reads it per tensor (those call
    ``per_tensor``). A list, not a lazy sequence: C code reads its items
    directly."""

    def __init__(
        self,
        arrays: Sequence[Array],
        flat: Array,
        shapes: Sequence[tuple[int, ...]] | None = None,
    ) -> None:
        super().__init__(arrays)
        self.flat = flat
        self._shapes = shapes  # views still to make (``unviewed``)

    @classmethod
    def unviewed(cls, flat: Array, shapes: Sequence[tuple[int, ...]]) -> FlatArrays:
        """``flat`` as tensors of ``shapes``, their views made when first read
        (``viewed``)."""
        return cls((), flat, shapes)

    def viewed(self) -> FlatArrays:
        """These arrays with their per-tensor views made (once)."""
        if self._shapes is not None:
            self[:] = flat_views(self.flat, self._shapes)
            self._shapes = None
        return self


def per_tensor(arrays: Sequence[Array]) -> Sequence[Array]:
    """A push's gradients as one array per tensor (``FlatArrays.viewed``)."""
    return arrays.viewed() if isinstance(arrays, FlatArrays) else arrays


class FlatValues(tuple[Array, ...]):
    """Per-tensor views of one version's copy, and (``flats``) the flat buffers
    they are views of: X (then V, H), each one array."""

    flats: tuple[Array, ...]

    def __new__(cls, views: Sequence[Array], flats: Sequence[Array]) -> FlatValues:
        out = super().__new__(cls, views)
        out.flats = tuple(flats)
        return out


def kept_flat(got: list[Array], lent: Sequence[Array]) -> list[Array]:
    """``lent`` (a ``FlatArrays``) when ``got`` are its very arrays (a reader
    filled the buffers it was lent), else ``got``."""
    if isinstance(lent, FlatArrays) and len(got) == len(lent):
        if all(a is b for a, b in zip(got, lent, strict=True)):
            return lent
    return got


def flat_views(flat: Array, shapes: Sequence[tuple[int, ...]]) -> list[Array]:
    """Views of ``flat`` shaped like ``shapes``, one after another."""
    out, offset = [], 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        out.append(flat[offset : offset + n].reshape(shape))
        offset += n
    return out


class FlatLayout:
    """Where each tensor of a group sits in its flat buffers."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.offsets = [0]
        for n in sizes:
            self.offsets.append(self.offsets[-1] + int(n))
        self.total = self.offsets[-1]

    def pieces(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """The flat range ``start:stop`` as (tensor, start, stop) pieces, in order
        (tensors with no element in it, such as empty ones, are left out)."""
        offsets = self.offsets
        i = bisect_right(offsets, start) - 1
        out = []
        while start < stop:
            end = min(stop, offsets[i + 1])
            if end > start:
                out.append((i, start - offsets[i], end - offsets[i]))
                start = end
            i += 1
        return out

    def per_tensor(
        self, done: Callable[[int, int, int], None]
    ) -> Callable[[int, int, int], None]:
        """``done(i, start, stop)`` of tensors, called from a flat stepper's
        ``done(0, start, stop)`` of the flat buffer."""

        def flat_done(_: int, start: int, stop: int) -> None:
            for piece in self.pieces(start, stop):
                done(*piece)

        return flat_done


def layout_digest(
    names: Sequence[str], shapes: Sequence[tuple[int, ...]], dtype: np.dtype[Any]
) -> bytes:
    """The 16-byte digest a flat push or pull names (``GroupInfo.layout``): of
    the tensors' names, shapes and dtype, in order. Groups that share it hold
    their elements in the same places; empty (no flat form) below two tensors."""
    if len(shapes) < 2:
        return b""
    text = json.dumps(
        [np.dtype(dtype).newbyteorder("<").str, list(names), [list(s) for s in shapes]],
        separators=(",", ":"),
    )
    return hashlib.sha256(text.encode()).digest()[:16]
