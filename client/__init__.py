"""The onnxps client library: push and pull in the ONNX ordering.

from onnxps.client import Client, Adam
with Client("127.0.0.1:50051") as ps:
    ps.create_group("mlp", Adam(), learning_rate=0.01, tensors={"w": w0, "b": b0})
    t = ps.push("mlp", g_w, g_b)
    w, b = ps.pull("mlp")

A cluster of shards: ``Client(["ps-0:50051", "ps-1:50051", "ps-2:50051"])``.
``AsyncClient`` is the same client for asyncio (``async with``, ``await ps.push``),
on one server; ``Client.push_background`` starts a push and returns a future at once.
"""

from onnxps.wire.codec import TensorFormatError
from onnxps.wire.encoding import Encoding, EncodingRangeError
from onnxps.wire.initializers import IdsTable, Normal, Uniform, Zeros

from ._async import AsyncClient
from ._client import (
    Client,
    GroupInfo,
    HistoryInfo,
    HistoryStep,
    LeaseInfo,
    PartInfo,
    PushResult,
    RewindInfo,
    SaveInfo,
    WorkerInfo,
)
from ._cluster import placement, shard_addresses, shard_ranking
from ._errors import (
    AlreadyExistsError,
    ClientClosedError,
    DataChannelError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OnnxpsError,
    PartsDivergedError,
    PermissionDeniedError,
    ResourceExhaustedError,
    RpcError,
    SharedMemoryError,
    UnauthenticatedError,
    UnavailableError,
)
from ._optimizers import Adagrad, Adam, Async, Momentum, Nesterov, OptimizerSpec, Sync
from ._records import RowsPage, TableInfo
from ._transfer import ExportFileError
from .shm import TensorBuffers

__all__ = [
    "Adagrad",
    "Adam",
    "AlreadyExistsError",
    "Async",
    "AsyncClient",
    "Client",
    "ClientClosedError",
    "DataChannelError",
    "DeadlineExceededError",
    "Encoding",
    "EncodingRangeError",
    "ExportFileError",
    "FailedPreconditionError",
    "GroupInfo",
    "HistoryInfo",
    "HistoryStep",
    "IdsTable",
    "InternalError",
    "InvalidArgumentError",
    "LeaseInfo",
    "Momentum",
    "Nesterov",
    "Normal",
    "NotFoundError",
    "OnnxpsError",
    "OptimizerSpec",
    "PartInfo",
    "PartsDivergedError",
    "PermissionDeniedError",
    "PushResult",
    "ResourceExhaustedError",
    "RewindInfo",
    "RowsPage",
    "RpcError",
    "SaveInfo",
    "SharedMemoryError",
    "Sync",
    "TableInfo",
    "TensorBuffers",
    "TensorFormatError",
    "UnauthenticatedError",
    "UnavailableError",
    "Uniform",
    "WorkerInfo",
    "Zeros",
    "placement",
    "shard_addresses",
    "shard_ranking",
]


def _public_module() -> None:
    """The exceptions print as ``onnxps.client.NotFoundError`` (the name to import
    and catch), not as the private module that defines them (those of
    ``onnxps.wire``, shared with the server, keep theirs)."""
    for name in __all__:
        value = globals()[name]
        if (
            isinstance(value, type)
            and issubclass(value, Exception)
            and value.__module__.startswith(f"{__name__}._")
        ):
            value.__module__ = __name__
            for member in vars(value).values():  # its methods too (griffe, pickle)
                if callable(member) and hasattr(member, "__module__"):
                    member.__module__ = __name__


_public_module()
