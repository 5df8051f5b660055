"""What the operations written apart from the client core (rows, routing, transfer)
need of it: ``CoreHost``, implemented by ``ClientCore``. They are typed against this
protocol, not the core's class, so no module imports back up into the core."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
from onnxps.wire.encoding import Encoding

from ._ops import Deadline, Op
from ._records import GroupInfo

__all__ = ["CoreHost"]


class CoreHost(Protocol):
    address: str
    addresses: list[str]
    client_id: str
    shards: int | None
    timeout: float
    gradient_encoding: Encoding
    pull_encoding: Encoding
    _seq: Iterator[int]
    _sizes: dict[str, int]
    _dtypes: dict[str, np.dtype[Any]]

    def _deadline(self, timeout: float | None) -> Deadline: ...

    def _encoding(self, value: Any, default: Encoding, what: str) -> Encoding: ...

    def _chunks(
        self, message: Any, header: Any, arrays: list[Any]
    ) -> Callable[[], Iterator[Any]]: ...

    def _describe_group(
        self, name: str, *, timeout: float | None = None
    ) -> Op[GroupInfo]: ...
