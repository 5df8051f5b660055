"""Read-only copies of a group's version, shared by the callers that read it.

A pull's arrays are a read-only copy of one version, shared by every caller that
reads that version while any of them still holds it, so slow readers of a large
group hold one copy between them, not one each.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._flat import FlatValues, flat_views
from ._group import Group

__all__ = ["SharedCopies"]

Array = np.ndarray[Any, Any]


class SharedCopies:
    """The live copies, by (incarnation, T, with_state); freed with their last
    reader's arrays."""

    def __init__(self) -> None:
        # (incarnation, T, with_state) -> the buffer under a version's shared copy
        self._copies: weakref.WeakValueDictionary[tuple[int, int, bool], Array] = (
            weakref.WeakValueDictionary()
        )
        self._lock = threading.Lock()

    def values(self, g: Group, with_state: bool, layout: bytes = b"") -> FlatValues:
        """Under the group's lock: read-only arrays of its current version.

        One copy per version serves every reader that asks while another still holds
        it (a copy with state serves readers of X alone too). ``layout`` (the
        flat form, checked): the arrays are the flat buffers (X, then V, H).
        """
        g.check_layout(layout)
        # the group's flat buffers (``_flat``): one copy each, whatever the tensors
        arrays = [g.flat_x]
        if with_state:
            arrays += [g.flat_states[s] for s in g.attrs.state_names]
        key = (g.incarnation, g.update_count, with_state)
        base = self._get(key)
        if base is None and not with_state:
            base = self._get(key[:2] + (True,))
        if base is None:
            base = np.empty(sum(_slot_bytes(a) for a in arrays), np.uint8)
            for a, view in zip(arrays, _slots(base, arrays), strict=True):
                np.copyto(view, a)
            base.flags.writeable = False
            with self._lock:
                self._copies[key] = base
        flats = list(_slots(base, arrays))
        if layout:
            return FlatValues(flats, flats)
        return FlatValues([v for f in flats for v in flat_views(f, g.shapes)], flats)

    def _get(self, key: tuple[int, int, bool]) -> Array | None:
        with self._lock:
            return self._copies.get(key)


def _slot_bytes(a: Array) -> int:
    return -(-a.nbytes // 64) * 64  # 64-byte aligned


def _slots(base: Array, arrays: Sequence[Array]) -> Iterator[Array]:
    """Flat views of ``base`` shaped like each of ``arrays``, one after another."""
    offset = 0
    for a in arrays:
        yield base[offset : offset + a.nbytes].view(a.dtype)
        offset += _slot_bytes(a)
