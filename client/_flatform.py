"""The flat form of a push or pull (docs/protocol.md, "The flat form"): a group's
tensors sent and received as ONE tensor of its elements back to back, naming the
group's layout digest (``GroupInfo.layout``), so that neither end pays a header,
a check or an array per tensor. The client learns a group's digest from
create_group and describe (``ShardOps.remember``), uses the form for a native
push or pull of a group of two or more tensors, and splits the one array it gets
back into views shaped like the group's tensors, for groups of many small
tensors (``pays``: larger ones go per tensor, which costs no copy into one
buffer and lands X straight in a caller's ``out``). When the server refuses the
digest (the group was created again with other tensors: LAYOUT_MISMATCH), the
client forgets it, describes the group again and sends the call per tensor.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._errors import FailedPreconditionError

__all__ = ["FLAT_AVERAGE_BYTES", "FlatForm", "is_layout_mismatch", "pays"]

Array = np.ndarray[Any, Any]
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_NDARRAY = {np.ndarray}

# The form is used for groups whose tensors average at most this: it saves a
# header, a check and an array per tensor, and costs a copy of the gradients into
# one buffer (and X out of one), which only groups of many small tensors win
FLAT_AVERAGE_BYTES = 64 << 10


def pays(nbytes: int, tensors: int) -> bool:
    """Whether a group of ``tensors`` tensors and ``nbytes`` bytes of X goes
    flat: two or more tensors, of ``FLAT_AVERAGE_BYTES`` or less on average."""
    return tensors > 1 and nbytes <= FLAT_AVERAGE_BYTES * tensors


class FlatForm:
    """A group's layout as the client last saw it: its digest, dtype and the
    tensors' shapes, and where each starts in the flat array."""

    __slots__ = (
        "digest",
        "dtype",
        "shapes",
        "offsets",
        "total",
        "_cuts",
        "_spare",
        "_lock",
    )

    def __init__(
        self, digest: bytes, dtype: np.dtype[Any], shapes: Sequence[tuple[int, ...]]
    ) -> None:
        self.digest = digest
        self.dtype = np.dtype(dtype)
        self.shapes = [tuple(s) for s in shapes]
        self.offsets = [0]
        for s in self.shapes:
            self.offsets.append(self.offsets[-1] + int(np.prod(s, dtype=np.int64)))
        self.total = self.offsets[-1]
        o = self.offsets
        # (start, stop, shape to reshape to, or None when the slice has it)
        self._cuts = [
            (o[i], o[i + 1], None if len(s) == 1 else s)
            for i, s in enumerate(self.shapes)
        ]
        # the flat gradient buffer of the last push, for the next one: a fresh
        # one per push costs its page faults every time
        self._spare: Array | None = None
        self._lock = threading.Lock()  # a client's threads may push at once

    def fits(self, arrays: Sequence[Any]) -> bool:
        """Whether ``arrays`` are the group's gradients as native arrays (same
        count, dtype and shapes): the push may go flat. (Each test is one pass
        in C over the arrays, not a Python loop: a group's many tensors are the
        form's reason to be.)"""
        if len(arrays) != len(self.shapes):
            return False
        return (
            set(map(type, arrays)) == _NDARRAY
            and set(map(_DTYPE, arrays)) == {self.dtype}
            and list(map(_SHAPE, arrays)) == self.shapes
        )

    def join(self, arrays: Sequence[Array]) -> Array:
        """The gradients back to back, one array (one copy), in the buffer the
        last push gave back (``give_back``) when no other push holds it."""
        with self._lock:
            buf, self._spare = self._spare, None
        if buf is None:
            buf = np.empty(self.total, self.dtype)
        return np.concatenate(arrays, axis=None, out=buf)

    def give_back(self, buf: Array) -> None:
        """``join``'s buffer, which the push that sent it no longer reads."""
        self._spare = buf

    def split(self, flat: Array) -> list[Array]:
        """Views of one flat array (``total`` elements) shaped like the group's
        tensors."""
        flat = flat.reshape(-1)
        if flat.size != self.total:
            raise ValueError(
                f"the server answered {flat.size} elements in the flat form; the "
                f"group's layout holds {self.total}"
            )
        return [
            flat[a:b] if s is None else flat[a:b].reshape(s) for a, b, s in self._cuts
        ]

    def split_all(self, flats: Sequence[Array]) -> list[Array]:
        """X (then V, H) of a flat pull: each split into the group's tensors."""
        return [v for flat in flats for v in self.split(flat)]


def is_layout_mismatch(exc: BaseException) -> bool:
    """Whether the server refused a call's layout digest (the group changed)."""
    return isinstance(exc, FailedPreconditionError) and exc.reason == "LAYOUT_MISMATCH"
