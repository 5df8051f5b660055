"""The error contract for clients in other languages, checked reason by reason.

The protocol page promises that every refusal carries a ``google.rpc.Status`` with a
``google.rpc.ErrorInfo`` (domain ``onnxps.v1``, a reason, and ``group`` in its
metadata when the call names a group) and, for INVALID_ARGUMENT with a known field, a
``google.rpc.BadRequest`` naming the field. Each case below makes one refusal over a
raw gRPC stub, as a Go or Node client would, and reads the details from the trailers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from onnxps.server.app import ServerConfig, ServerHandle, create_server
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import array_to_tensor, header_tensor

Stub = pb_grpc.ParameterServerServiceStub
F32 = pb.DATA_TYPE_FLOAT


def t32(values: Any, name: str = "") -> pb.Tensor:
    return array_to_tensor(np.asarray(values, np.float32), name)


def adagrad(name: str, x: Any, **kw: Any) -> pb.CreateGroupRequest:
    return pb.CreateGroupRequest(
        group=name,
        optimizer=pb.OptimizerSpec(adagrad=pb.Adagrad()),
        learning_rate=0.1,
        tensors=[t32(x, "w")],
        **kw,
    )


@dataclasses.dataclass(frozen=True)
class Refusal:
    reason: str
    code: grpc.StatusCode
    call: Callable[[Stub], Any]
    group: str | None  # the group the call names: must be in the metadata
    violation: str | None = None  # the BadRequest field, when one is known
    metadata: dict[str, str] = dataclasses.field(
        default_factory=dict
    )  # further entries


def _push(group: str, *grads: pb.Tensor, **kw: Any) -> Callable[[Stub], Any]:
    request = pb.PushRequest(group=group, gradients=list(grads), **kw)
    return lambda s: s.Push(request, timeout=10)


def _stream_push_bad_offset(s: Stub) -> Any:
    g = np.ones(3, np.float32)
    header = pb.PushRequest(group="g", gradients=[header_tensor(g)])
    bad = pb.TensorChunk(index=0, offset=4, data=g.tobytes())
    messages = [pb.PushStreamRequest(header=header), pb.PushStreamRequest(chunk=bad)]
    return s.PushStream(iter(messages), timeout=10)


def _sync_twice(s: Stub) -> Any:
    for seq in (1, 2):
        s.Push(
            pb.PushRequest(
                group="sync", gradients=[t32([1, 1, 1])], client_id="a", seq=seq
            ),
            timeout=10,
        )


def _row_push(group: str, name: str, indices: list[int]) -> Callable[[Stub], Any]:
    def call(s: Stub) -> Any:
        ids = np.asarray(indices, np.int64)
        rows = np.ones((len(indices), 2), np.float32)
        header = pb.PushRowsHeader(
            group=group,
            gradients=[
                pb.RowGradient(
                    name=name, indices=header_tensor(ids), values=header_tensor(rows)
                )
            ],
        )
        chunks = [
            pb.PushRowsRequest(
                chunk=pb.TensorChunk(index=i, offset=0, data=a.tobytes())
            )
            for i, a in enumerate((ids, rows))
        ]
        messages = [pb.PushRowsRequest(header=header), *chunks]
        return s.PushRows(iter(messages), timeout=10)

    return call


IA, FP = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION

REFUSALS = [
    Refusal(
        "GROUP_NOT_FOUND",
        grpc.StatusCode.NOT_FOUND,
        lambda s: s.Pull(pb.PullRequest(group="nope"), timeout=10),
        "nope",
    ),
    Refusal(
        "GROUP_EXISTS",
        grpc.StatusCode.ALREADY_EXISTS,
        lambda s: s.CreateGroup(adagrad("g", [0, 0, 0]), timeout=10),
        "g",
    ),
    Refusal(
        "GRADIENT_COUNT",
        IA,
        _push("g", t32([1, 1, 1]), t32([1, 1, 1])),
        "g",
        "gradients",
    ),
    Refusal(
        "DTYPE_MISMATCH",
        IA,
        _push("g", array_to_tensor(np.ones(3))),
        "g",
        "gradients[0].dtype",
    ),
    Refusal("SHAPE_MISMATCH", IA, _push("g", t32([1, 1])), "g", "gradients[0].dims"),
    Refusal(
        "NON_FINITE_GRADIENT",
        IA,
        _push("g", t32([1, np.nan, 1])),
        "g",
        "gradients[0]",
    ),
    Refusal(
        "BASE_VERSION_AHEAD",
        IA,
        _push("g", t32([1, 1, 1]), base_version=5),
        "g",
        "base_version",
    ),
    # The two refusals issue 25 found without group metadata and without BadRequest.
    Refusal(
        "INVALID_TENSOR",
        IA,
        _push("g", pb.Tensor(dtype=F32, dims=[3], raw_data=b"1234")),
        "g",
        "gradients[0].raw_data",
    ),
    Refusal(
        "DTYPE_MISMATCH",
        IA,
        lambda s: s.CreateGroup(
            pb.CreateGroupRequest(
                group="mixed",
                optimizer=pb.OptimizerSpec(adagrad=pb.Adagrad()),
                learning_rate=0.1,
                tensors=[t32([0, 0], "a"), array_to_tensor(np.zeros(2), "b")],
            ),
            timeout=10,
        ),
        "mixed",
        "tensors[1].dtype",
        {"expected": "float32", "received": "float64"},
    ),
    Refusal("INVALID_TENSOR", IA, _stream_push_bad_offset, "g"),
    Refusal(
        "INVALID_ARGUMENT",
        IA,
        lambda s: s.SetLearningRate(
            pb.SetLearningRateRequest(group="g", learning_rate=-1.0), timeout=10
        ),
        "g",
        "learning_rate",
    ),
    Refusal(
        "STALE_PUSH",
        FP,
        _push("stale", t32([1, 1, 1]), base_version=0),
        "stale",
        metadata={"update_count": "2"},
    ),
    Refusal("DUPLICATE_SYNC_PUSH", FP, _sync_twice, "sync"),
    Refusal(
        "OUT_OF_ENCODING_RANGE",
        FP,
        lambda s: s.Pull(
            pb.PullRequest(group="big", encoding=pb.ENCODING_FLOAT16), timeout=10
        ),
        "big",
    ),
    Refusal(
        "VERSION_NOT_REACHED",
        grpc.StatusCode.DEADLINE_EXCEEDED,
        lambda s: s.Pull(pb.PullRequest(group="g", min_version=99), timeout=1),
        "g",
    ),
    Refusal(
        "ROW_INDEX_OUT_OF_RANGE",
        IA,
        _row_push("rows", "w", [0, 9]),
        "rows",
        "gradients[0].indices",
    ),
    Refusal(
        "UNKNOWN_TENSOR",
        IA,
        _row_push("rows", "nope", [0]),
        "rows",
        "gradients[0].name",
    ),
    Refusal(
        "FAILED_PRECONDITION",
        FP,
        lambda s: s.Save(pb.SaveRequest(), timeout=10),
        None,
    ),
    Refusal(
        "LIMIT_EXCEEDED",
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        lambda s: s.CreateGroup(adagrad("huge", np.zeros(4096)), timeout=10),
        "huge",
    ),
]


@pytest.fixture(scope="module")
def stub() -> Iterator[Stub]:
    handle = create_server(
        ServerConfig(address="127.0.0.1:0", durability="none", max_group_bytes=4096)
    )
    handle.start()
    try:
        with grpc.insecure_channel(handle.address) as channel:
            s = Stub(channel)
            _setup(s, handle)
            yield s
    finally:
        handle.stop(grace=0)


def _setup(s: Stub, handle: ServerHandle) -> None:
    s.CreateGroup(adagrad("g", [0, 0, 0]), timeout=10)
    stale = adagrad("stale", [0, 0, 0])
    stale.consistency.max_staleness = 1
    s.CreateGroup(stale, timeout=10)
    for _ in range(2):
        s.Push(pb.PushRequest(group="stale", gradients=[t32([1, 1, 1])]), timeout=10)
    sync = adagrad("sync", [0, 0, 0])
    sync.consistency.mode = pb.CONSISTENCY_MODE_SYNC
    sync.consistency.sync_workers = 2
    s.CreateGroup(sync, timeout=10)
    s.CreateGroup(adagrad("big", [1e5, 0, 0]), timeout=10)
    rows = adagrad("rows", np.zeros((4, 2)))
    s.CreateGroup(rows, timeout=10)


def details(call: Callable[[], Any]) -> tuple[Any, Any, list[Any]]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    status = rpc_status.from_call(err.value)  # type: ignore[arg-type]
    assert status is not None, "no google.rpc.Status in the trailers"
    assert status.code == err.value.code().value[0]
    infos, violations = [], []
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            infos.append(info)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations += [v.field for v in bad.field_violations]
    assert len(infos) == 1, f"{len(infos)} ErrorInfo in the details"
    return err.value.code(), infos[0], violations


@pytest.mark.parametrize(
    "refusal", REFUSALS, ids=[f"{r.reason}-{i}" for i, r in enumerate(REFUSALS)]
)
def test_every_refusal_carries_its_error_details(stub: Stub, refusal: Refusal) -> None:
    code, info, violations = details(lambda: refusal.call(stub))
    assert (code, info.domain, info.reason) == (
        refusal.code,
        "onnxps.v1",
        refusal.reason,
    )
    metadata = dict(info.metadata)
    if refusal.group is not None:
        assert metadata.get("group") == refusal.group, metadata
    for key, value in refusal.metadata.items():
        assert metadata.get(key) == value, metadata
    if refusal.violation is not None:
        assert violations == [refusal.violation]
    if code != grpc.StatusCode.INVALID_ARGUMENT:
        assert violations == []
