"""The gRPC servicer: a thin adapter over ``ParameterStore`` and the transports.

Each RPC decodes its request, calls the store (or the kernels, for Apply), encodes
the reply, and maps domain errors to a status with details
(``interceptors._status.status_of``). The RPCs are written in families
(``_groups``, ``_tensors``, ``_rows``, ``_history``) over the parts in
``_common.RpcFamily``; the servicer is their union.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

from ..errors import FailedPrecondition
from ._common import add_servicer, streaming
from ._groups import GroupRpcs
from ._history import HistoryRpcs
from ._rows import RowRpcs
from ._tensors import TensorRpcs

__all__ = ["ParameterServerServicer", "Replicate", "add_servicer"]

# The Replicate stream's handler (onnxps.server.replication): requests in, replies
# out (a record's reply encoded already: bytes).
Replicate = Callable[
    [Iterable[pb.ReplicateRequest], Any], Iterator[pb.ReplicateResponse | bytes]
]


class ParameterServerServicer(
    GroupRpcs, TensorRpcs, RowRpcs, HistoryRpcs, pb_grpc.ParameterServerServiceServicer
):
    """Every RPC of ``onnxps.v1.ParameterServerService``."""

    def __init__(
        self, *args: Any, replicate: Replicate | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        # A replicated shard's log shipping (none without --coordinator).
        self._replicate = replicate

    @streaming
    def Replicate(
        self, request_iterator: Iterable[pb.ReplicateRequest], context: Any
    ) -> Iterator[Any]:  # ReplicateResponse, or one encoded already (bytes)
        if self._replicate is None:
            raise FailedPrecondition(
                "this server is not part of a replicated shard (it was started "
                "without --coordinator)",
                reason="NOT_REPLICATED",
            )
        yield from self._replicate(request_iterator, context)
