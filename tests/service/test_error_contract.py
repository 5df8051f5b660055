"""The error contract for clients in other languages, checked reason by reason.

docs/protocol.md promises that every refusal carries a ``google.rpc.Status`` with a
``google.rpc.ErrorInfo`` (domain ``onnxps.v1``, a reason, and ``group`` in its
metadata when the call names a group) and, for INVALID_ARGUMENT with a known field, a
``google.rpc.BadRequest`` naming the field. Each case below makes one refusal over a
raw gRPC stub, as a Go or Node client would, and reads the details from the trailers.
A second test checks that every reason the server's code can give is in the page's
reason table, and that each is made here or by the test file named for it.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _servers import details
from grpc_status import rpc_status
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import array_to_tensor, header_tensor

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "docs" / "protocol.md"

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


def _row_push(
    group: str, name: str, indices: list[int], times: int = 1
) -> Callable[[Stub], Any]:
    def call(s: Stub) -> Any:
        ids = np.asarray(indices, np.int64)
        rows = np.ones((len(indices), 2), np.float32)
        gradient = pb.RowGradient(
            name=name, indices=header_tensor(ids), values=header_tensor(rows)
        )
        header = pb.PushRowsHeader(group=group, gradients=[gradient] * times)
        chunks = [
            pb.PushRowsRequest(
                chunk=pb.TensorChunk(index=i, offset=0, data=a.tobytes())
            )
            for i, a in enumerate((ids, rows) * times)
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
        "DUPLICATE_TENSOR",
        IA,
        _row_push("rows", "w", [0], times=2),
        "rows",
        "gradients[1].name",
    ),
    Refusal(
        "NOT_A_TABLE", IA, _row_push("rows", "s", [0]), "rows", "gradients[0].indices"
    ),
    Refusal(
        "BAD_SEGMENT",
        IA,
        _push(
            "g",
            header_tensor(np.ones(3, np.float32)),
            gradients_region=pb.SharedMemoryRegion(segment="../etc", offsets=[0]),
        ),
        "g",
        "gradients_region.segment",
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
def stub(module_servers: Callable[..., ServerHandle]) -> Iterator[Stub]:
    handle = module_servers(
        ServerConfig(address="127.0.0.1:0", durability="none", max_group_bytes=4096)
    )
    with grpc.insecure_channel(handle.address) as channel:
        s = Stub(channel)
        _setup(s, handle)
        yield s


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
    rows.tensors.append(t32(0.0, "s"))
    s.CreateGroup(rows, timeout=10)


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


@pytest.fixture(scope="module")
def strict_stub(module_servers: Callable[..., ServerHandle]) -> Iterator[Stub]:
    """A server without shared memory or a data port whose streams stall after
    0.3 s."""
    handle = module_servers(
        ServerConfig(
            address="127.0.0.1:0",
            durability="none",
            shared_memory="off",
            data_port="off",
            stall_seconds=0.3,
        )
    )
    with grpc.insecure_channel(handle.address) as channel:
        s = Stub(channel)
        s.CreateGroup(adagrad("g", [0, 0, 0]), timeout=10)
        yield s


def test_a_region_on_a_server_without_shared_memory_says_so(strict_stub: Stub) -> None:
    region = pb.SharedMemoryRegion(segment="onnxps-1-abc", offsets=[0])
    push = _push("g", header_tensor(np.ones(3, np.float32)), gradients_region=region)
    code, info, violations = details(lambda: push(strict_stub))
    assert (code, info.reason) == (FP, "SHARED_MEMORY_OFF")
    assert (dict(info.metadata), violations) == ({"group": "g"}, [])


def test_a_transfer_on_a_server_without_a_data_port_says_so(
    strict_stub: Stub,
) -> None:
    transfer = pb.DataTransfer(channel=b"x" * 16, transfer_id=1)
    push = _push("g", header_tensor(np.ones(3, np.float32)), transfer=transfer)
    code, info, violations = details(lambda: push(strict_stub))
    assert (code, info.reason) == (FP, "DATA_CHANNEL_OFF")
    assert (dict(info.metadata), violations) == ({"group": "g"}, [])


def test_a_stream_that_stops_sending_ends_stalled_without_details(
    strict_stub: Stub,
) -> None:
    """The one refusal without details, as docs/protocol.md says: the server ends
    a stalled stream from outside its handler (gRPC Python can only cancel the call
    with a code and a message there)."""
    released = threading.Event()

    def messages() -> Iterator[pb.PushStreamRequest]:
        g = np.ones(3, np.float32)
        yield pb.PushStreamRequest(
            header=pb.PushRequest(group="g", gradients=[header_tensor(g)])
        )
        released.wait(30)  # sends nothing more until the call has ended

    try:
        with pytest.raises(grpc.RpcError) as err:
            strict_stub.PushStream(messages(), timeout=20)
    finally:
        released.set()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert err.value.details() == (
        "the PushStream stream sent nothing for 0.3 s (--stall-seconds): "
        "the server ended it"
    )
    assert rpc_status.from_call(err.value) is None  # type: ignore[arg-type]


# Reasons whose refusal needs a set-up of its own (tokens, a full disk, a draining
# server, shared memory, a cluster): the test file that makes each.
ELSEWHERE = {
    "LAYOUT_MISMATCH": "test_flat_form.py",
    "NOT_PRIMARY": "test_replication.py",
    "MOVED": "test_reshard_moved.py",
    "GROUP_IMPORTING": "test_reshard_moved.py",
    "NOT_ACKNOWLEDGED": "test_replication_cancel.py",
    "BAD_MEMBER_ID": "test_replication_attacks.py",
    "STANDBY_NOT_MEMBER": "test_replication_attacks.py",
    "STATE_REPLACING": "test_adopting_reads.py",
    "STREAM_LIMIT": "test_stalled_calls.py",
    "INFLIGHT_BYTES": "test_limits.py",
    "MALFORMED_MESSAGE": "test_limits.py",
    "TOKEN_MISSING": "test_security.py",
    "TOKEN_UNKNOWN": "test_security.py",
    "ROLE_FORBIDS_METHOD": "test_security.py",
    "GROUP_NOT_PERMITTED": "test_security.py",
    "SHUTTING_DOWN": "test_cli.py",
    "WAL_WRITE_FAILED": "test_wal_hardening.py",
    "DISK_FULL": "test_wal_hardening.py",
    "WAL_UNLINKED": "test_wal_hardening.py",
    "SHARD_LAYOUT_MISMATCH": "test_cluster.py",
    "ROW_INDICES": "test_index_dtypes.py",
    "SEGMENT_NOT_YOURS": "test_shm_tenancy.py",
    "STALE_SEGMENT": "test_shm_tenancy.py",
    "SEGMENT_BUSY": "test_shared_memory.py",
    "DATA_CHANNEL_UNKNOWN": "test_data_channel.py",
    "INTERNAL": "test_availability.py",
    "PERMISSION_DENIED": "test_shared_memory.py",
    "UNAUTHENTICATED": "test_security.py",
    "REWOUND": "test_rewind.py",
    "STEP_NOT_RETAINED": "test_rewind.py",
    "STEP_AHEAD": "test_rewind.py",
    "NO_HISTORY": "test_rewind.py",
}

# Documented, and refused by the code, but no test yet checks the reason itself
# (most are checked by their status code only): the gap, kept visible here.
NOT_YET_CHECKED = {
    "SEQ_TOO_OLD",
    "SEGMENT_NOT_OWNED",
    "SEGMENT_UNAVAILABLE",
    "OTHER_PID_NAMESPACE",
    "DATA_CHANNEL_BUSY",
    "DATA_CHANNEL_BROKEN",
    "DATA_TRANSFER_STALE",
    "DATA_FRAME_STALLED",
    "DATA_FRAME_DEADLINE",
    "DATA_FRAME_SIZE",
    "DATA_FRAME_MISMATCH",
    "DATA_FRAME_TRUNCATED",
    # replication (tests/replication/test_replication.py makes NOT_PRIMARY; these two
    # need a standby that stops following at the right moment)
    "NOT_ENOUGH_REPLICAS",
    "NOT_REPLICATED",
}

_REASON_IN_CODE = re.compile(
    r'(?:reason=|default_reason = |REASON = )"([A-Z][A-Z0-9_]+)"'
    r"|(?:refuse|rich_status)\(\s*[^()]*?StatusCode\.[A-Z_]+,\s*[^,]+,"
    r'\s*"([A-Z][A-Z0-9_]+)"',
    re.S,
)
# Reasons server/interceptors/security.py passes through variables.
_SECURITY_REASONS = (
    "TOKEN_MISSING",
    "TOKEN_UNKNOWN",
    "ROLE_FORBIDS_METHOD",
    "GROUP_NOT_PERMITTED",
)


def reasons_in_code() -> set[str]:
    """Every reason the server's code gives (the cluster client's own are not on
    the wire)."""
    found: set[str] = set()
    for path in (ROOT / "server").rglob("*.py"):
        for m in _REASON_IN_CODE.finditer(path.read_text()):
            found.add(m.group(1) or m.group(2))
    security = (ROOT / "server" / "interceptors" / "security.py").read_text()
    found |= {r for r in _SECURITY_REASONS if f'"{r}"' in security}
    return found


def documented_reasons() -> set[str]:
    text = PROTOCOL.read_text()
    start = text.index("<!-- reasons -->")
    end = text.index("<!-- /reasons -->")
    return set(re.findall(r"`([A-Z][A-Z0-9_]+)`", text[start:end]))


def test_every_reason_the_server_gives_is_documented_and_tested() -> None:
    in_code = reasons_in_code()
    assert {"INVALID_TENSOR", "DATA_CHANNEL_BUSY", "TOKEN_UNKNOWN"} <= in_code
    assert sorted(in_code - documented_reasons()) == []
    made_here = {r.reason for r in REFUSALS} | {
        "SHARED_MEMORY_OFF",
        "DATA_CHANNEL_OFF",
        "STREAM_STALLED",
    }
    for reason in sorted(in_code - made_here - NOT_YET_CHECKED):
        assert reason in ELSEWHERE, f"{reason}: no test makes this refusal"
        where = next((ROOT / "tests").rglob(ELSEWHERE[reason]))
        assert reason in where.read_text(), f"{reason} is not in {where.name}"
    assert sorted(NOT_YET_CHECKED & (made_here | set(ELSEWHERE))) == []
