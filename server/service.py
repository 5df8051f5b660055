"""The gRPC servicer: a thin adapter over ``ParameterStore`` and the transports.

Each RPC decodes its request, calls the store (or the kernels, for Apply), encodes
the reply, and maps domain errors to a status with details (``_status.status_of``).
The RPCs are written in families (``_rpc_groups``, ``_rpc_tensors``, ``_rpc_rows``)
over the parts in ``_rpc.RpcFamily``; the servicer is their union.
"""

from __future__ import annotations

from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

from ._rpc import add_servicer
from ._rpc_groups import GroupRpcs
from ._rpc_rows import RowRpcs
from ._rpc_tensors import TensorRpcs

__all__ = ["ParameterServerServicer", "add_servicer"]


class ParameterServerServicer(
    GroupRpcs, TensorRpcs, RowRpcs, pb_grpc.ParameterServerServiceServicer
):
    """Every RPC of ``onnxps.v1.ParameterServerService``."""
