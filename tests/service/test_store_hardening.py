"""Issue 11, items 5, 7, 8, 9 and 10: bounded exactly-once windows, the sync quorum,
the update count's range, values refused when given, and a push's answer when its
group is deleted while the push waits for the log. Real servers on port 0."""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
import numpy as np
import pytest
from onnxps.client import (
    Adagrad,
    Adam,
    Client,
    FailedPreconditionError,
    InvalidArgumentError,
    Momentum,
    Sync,
)
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.server.kernels import make_attrs
from onnxps.server.store import ParameterStore, StoreLimits
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

W = np.zeros(4, np.float32)
G = np.ones(4, np.float32)


def _durable(data_dir: Path, mode: str) -> ServerConfig:
    return ServerConfig(
        address="127.0.0.1:0",
        durability=mode,
        data_dir=str(data_dir),
        snapshot_interval=0,
    )


# -- item 5: the exactly-once windows are bounded by age and count ---------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _windows(store: ParameterStore) -> dict[str, Any]:
    (captured,) = list(store.capture())
    return dict(captured.runtime.dedup)


def test_windows_beyond_the_client_count_are_dropped_least_recent_first() -> None:
    clock = Clock()
    store = ParameterStore(StoreLimits(dedup_clients=3), clock=clock)
    store.create_group("g", make_attrs("Adagrad"), 0.1, [("w", W)])
    for k in range(5):
        clock.now += 1
        store.push("g", [G], client_id=f"c{k}", seq=7)
    assert sorted(_windows(store)) == ["c2", "c3", "c4"]
    # A live client's resend is still answered with its first result.
    again = store.push("g", [G], client_id="c2", seq=7)
    assert (again.update_count, again.applied, again.duplicate) == (3, True, True)
    assert store.describe("g").update_count == 5
    # c2 is now the most recently used: the next new client drops c3.
    store.push("g", [G], client_id="c5", seq=1)
    assert sorted(_windows(store)) == ["c2", "c4", "c5"]


def test_windows_idle_past_dedup_seconds_are_dropped() -> None:
    clock = Clock()
    store = ParameterStore(StoreLimits(dedup_seconds=60), clock=clock)
    store.create_group("g", make_attrs("Adagrad"), 0.1, [("w", W)])
    store.push("g", [G], client_id="old", seq=1)
    clock.now += 59
    store.push("g", [G], client_id="live", seq=1)
    store.reap_leases()
    assert sorted(_windows(store)) == ["live", "old"]  # within 60 s: both kept
    dup = store.push("g", [G], client_id="old", seq=1)
    assert dup.duplicate and dup.update_count == 1
    clock.now += 61
    store.reap_leases()
    assert _windows(store) == {}


def test_memory_for_many_client_ids_is_bounded() -> None:
    store = ParameterStore(StoreLimits(dedup_clients=100))
    store.create_group("g", make_attrs("Adagrad"), 0.1, [("w", W)])
    for k in range(2000):
        store.push("g", [G], client_id=f"client-{k}", seq=1)
    windows = _windows(store)
    assert len(windows) == 100
    assert min(windows) == "client-1900"
    assert store.describe("g").update_count == 2000


def test_windows_survive_a_restart_in_snapshot_mode(
    servers: Callable[[ServerConfig], ServerHandle], tmp_path: Path
) -> None:
    server = servers(_durable(tmp_path, "snapshot"))
    with Client(server.address, timeout=10) as c:
        c.create_group("g", Adagrad(), learning_rate=0.1, tensors={"w": W})
    stub = pb_grpc.ParameterServerServiceStub(grpc.insecure_channel(server.address))
    grad = pb.Tensor(dtype=pb.DATA_TYPE_FLOAT, dims=[4], raw_data=G.tobytes())
    push = pb.PushRequest(group="g", client_id="w1", seq=42, gradients=[grad])
    assert stub.Push(push, timeout=10).update_count == 1
    server.stop(grace=1)
    server = servers(_durable(tmp_path, "snapshot"))
    stub = pb_grpc.ParameterServerServiceStub(grpc.insecure_channel(server.address))
    reply = stub.Push(push, timeout=10)
    assert (reply.update_count, reply.duplicate) == (1, True)


# -- item 7: the sync quorum counts live distinct workers ------------------------------


def _wait(predicate: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_a_worker_restarted_under_a_new_id_does_not_shrink_the_quorum(
    server: ServerHandle,
) -> None:
    with Client(server.address, timeout=10) as admin:
        admin.create_group(
            "g", Adagrad(), learning_rate=0.1, tensors={"w": W},
            consistency=Sync(2), lease_seconds=0.5,
        )  # fmt: skip
        a, b = Client(server.address, timeout=10), Client(server.address, timeout=10)
        a.join("g")
        b.join("g")
        a.close()  # killed: no leave, its heartbeats stop
        _wait(lambda: admin.describe_group("g").quorum == 1)
        with Client(server.address, timeout=10) as a2, b:
            a2.join("g")  # the same worker, restarted under a new id
            assert admin.describe_group("g").quorum == 2
            first = b.push_detailed("g", G)
            assert (first.applied, first.update_count) == (False, 0)
            second = a2.push_detailed("g", G)
            assert (second.applied, second.update_count) == (True, 1)


def test_an_extra_id_that_joined_and_left_does_not_shrink_the_quorum(
    server: ServerHandle,
) -> None:
    with (
        Client(server.address, timeout=10) as a,
        Client(server.address, timeout=10) as b,
        Client(server.address, timeout=10) as extra,
    ):
        a.create_group(
            "g", Adagrad(), learning_rate=0.1, tensors={"w": W}, consistency=Sync(2)
        )
        a.join("g")
        b.join("g")
        extra.join("g")
        extra.leave("g")
        assert a.describe_group("g").quorum == 2
        first = a.push_detailed("g", G)
        assert (first.applied, first.update_count) == (False, 0)
        assert b.push_detailed("g", G).applied


def test_a_dead_worker_still_shrinks_the_quorum(server: ServerHandle) -> None:
    with Client(server.address, timeout=10) as a:
        a.create_group(
            "g", Adagrad(), learning_rate=0.1, tensors={"w": W},
            consistency=Sync(2), lease_seconds=0.5,
        )  # fmt: skip
        b = Client(server.address, timeout=10)
        a.join("g")
        b.join("g")
        b.close()
        _wait(lambda: a.describe_group("g").quorum == 1)
        assert a.push_detailed("g", G).applied


def test_an_anonymous_push_cannot_fill_a_sync_quorum(server: ServerHandle) -> None:
    with Client(server.address, timeout=10) as c:
        c.create_group(
            "g", Adagrad(), learning_rate=0.1, tensors={"w": W}, consistency=Sync(2)
        )
        stub = pb_grpc.ParameterServerServiceStub(grpc.insecure_channel(server.address))
        grad = pb.Tensor(dtype=pb.DATA_TYPE_FLOAT, dims=[4], raw_data=G.tobytes())
        for seq in (1, 2):
            with pytest.raises(grpc.RpcError) as info:
                stub.Push(pb.PushRequest(group="g", seq=seq, gradients=[grad]))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "every push needs a client_id" in (info.value.details() or "")
        info_ = c.describe_group("g")
        assert (info_.update_count, info_.pending_contributions) == (0, 0)


# -- item 8: T stays in range; nothing stored breaks ListGroups -----------------------


def test_update_count_that_could_overflow_is_refused(client: Client) -> None:
    for t in (2**63 - 1, 2**62 + 1):
        with pytest.raises(InvalidArgumentError) as info:
            client.create_group(
                "a/g", Adagrad(), learning_rate=0.1, tensors={"w": W}, update_count=t
            )
        assert f"update_count must be <= 2**62 = {2**62}" in info.value.details
    assert client.list_groups() == []


def test_a_push_past_the_last_step_is_refused_and_nothing_breaks(
    servers: Callable[[ServerConfig], ServerHandle], tmp_path: Path
) -> None:
    server = servers(_durable(tmp_path, "snapshot"))
    with Client(server.address, timeout=10) as c:
        c.create_group(
            "a/g", Adam(), learning_rate=0.1, tensors={"w": W}, update_count=2**62 - 1
        )
        assert c.push("a/g", G) == 2**62
        x = c.pull("a/g")
        with pytest.raises(FailedPreconditionError) as info:
            c.push("a/g", G)
        assert "the most steps a group takes (2**62" in info.value.details
        assert [g.update_count for g in c.list_groups()] == [2**62]
        np.testing.assert_array_equal(c.pull("a/g")[0], x[0])
    server.stop(grace=1)
    server = servers(_durable(tmp_path, "snapshot"))
    with Client(server.address, timeout=10) as c:
        assert [g.update_count for g in c.list_groups()] == [2**62]
        assert c.describe_group("a/g").update_count == 2**62
        with pytest.raises(FailedPreconditionError):
            c.push("a/g", G)


# -- item 9: every value that would make a group unusable is refused when given --------


@pytest.mark.parametrize("lease", [math.nan, math.inf, -1.0, 1e9])
def test_bad_lease_seconds_are_refused(client: Client, lease: float) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        client.create_group(
            "g", Adagrad(), learning_rate=0.1, tensors={"w": W}, lease_seconds=lease
        )
    assert "lease_seconds must be finite, > 0 and <= 86400, got" in info.value.details


BAD_STATE = {
    "adagrad-nan-H": (Adagrad(), [np.full(4, np.nan, np.float32)], "NaN or inf"),
    "adagrad-negative-H": (Adagrad(), [-np.ones(4, np.float32)], "must be >= 0"),
    "adam-negative-H": (Adam(), [W, -np.ones(4, np.float32)], "must be >= 0"),
    "momentum-inf-V": (
        Momentum(alpha=0.9, beta=0.1),
        [np.full(4, np.inf, np.float32)],
        "NaN or inf",
    ),
}


@pytest.mark.parametrize("case", BAD_STATE.values(), ids=BAD_STATE.keys())
def test_bad_state_at_create_is_refused(
    client: Client, case: tuple[Any, Sequence[Any], str]
) -> None:
    optimizer, state, message = case
    with pytest.raises(InvalidArgumentError) as info:
        client.create_group(
            "g", optimizer, learning_rate=0.1, tensors={"w": W}, state=state
        )
    assert message in info.value.details
    assert client.list_groups() == []


def test_non_finite_state_is_kept_when_allowed(client: Client) -> None:
    client.create_group(
        "g", Momentum(alpha=0.9, beta=0.1), learning_rate=0.1, tensors={"w": W},
        state=[np.full(4, np.inf, np.float32)], allow_non_finite=True,
    )  # fmt: skip
    assert np.isinf(client.pull("g", state=True)[1]).all()


@pytest.mark.parametrize("lr", [1e300, -0.1, math.nan, math.inf])
def test_bad_learning_rates_are_refused_everywhere(client: Client, lr: float) -> None:
    expected = "must be finite and in [0, 3.40282e+38] (the group's dtype is float32)"
    with pytest.raises(InvalidArgumentError) as info:
        client.create_group("g", Adagrad(), learning_rate=lr, tensors={"w": W})
    assert expected in info.value.details
    client.create_group("g", Adagrad(), learning_rate=0.1, tensors={"w": W})
    with pytest.raises(InvalidArgumentError) as info:
        client.set_learning_rate("g", lr)
    assert expected in info.value.details
    with pytest.raises(InvalidArgumentError) as info:
        client.push("g", G, learning_rate=lr)
    assert f"the push's learning_rate {expected}" in info.value.details
    assert client.describe_group("g").learning_rate == pytest.approx(0.1)
    assert client.push("g", G) == 1


def test_a_large_learning_rate_fits_a_float64_group(client: Client) -> None:
    w = np.zeros(4, np.float64)
    client.create_group("g", Adagrad(), learning_rate=1e300, tensors={"w": w})
    assert client.describe_group("g").learning_rate == 1e300


@pytest.mark.parametrize("dims", [[0, 2**62, 2**62], [0, 2**61], [1] * 65])
def test_create_group_with_dims_no_array_can_have(
    server: ServerHandle, dims: list[int]
) -> None:
    stub = pb_grpc.ParameterServerServiceStub(grpc.insecure_channel(server.address))
    tensor = pb.Tensor(name="w", dtype=pb.DATA_TYPE_FLOAT, dims=dims, raw_data=b"")
    request = pb.CreateGroupRequest(
        group="g",
        optimizer=Adagrad().to_proto(),
        learning_rate=0.1,
        tensors=[tensor],
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.CreateGroup(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tensor 'w' has" in (info.value.details() or "")
    header = pb.CreateGroupStreamRequest(header=request)
    with pytest.raises(grpc.RpcError) as info:
        stub.CreateGroupStream(iter([header]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- item 10: a push's answer is its own, whatever happens to the name meanwhile -------


class HeldJournal:
    """The server's own write-ahead log, with the first push's wait held open."""

    def __init__(self, journal: Any) -> None:
        self.journal = journal
        self.held: int | None = None
        self.waiting = threading.Event()
        self.release = threading.Event()

    def log(self, record: dict[str, Any], arrays: Sequence[Any]) -> int:
        lsn = int(self.journal.log(record, arrays))
        if record["op"] == "push" and self.held is None:
            self.held = lsn
        return lsn

    def check_writable(self) -> None:
        self.journal.check_writable()

    def wait(self, lsn: int) -> None:
        self.journal.wait(lsn)
        if lsn == self.held:
            self.waiting.set()
            assert self.release.wait(10)


def _wait_for_a_thread_in(function: Callable[..., Any]) -> None:
    """Until a thread of this process (a server thread in-process) runs ``function``."""
    code = function.__code__
    deadline = time.monotonic() + 20
    while True:
        for frame in sys._current_frames().values():
            f: FrameType | None = frame
            while f is not None:
                if f.f_code is code:
                    return
                f = f.f_back
        assert time.monotonic() < deadline, f"no thread entered {code.co_name}"
        time.sleep(0.01)


def test_a_push_waiting_for_the_log_answers_its_own_outcome(
    servers: Callable[[ServerConfig], ServerHandle], tmp_path: Path
) -> None:
    server = servers(_durable(tmp_path, "wal"))
    assert server.durability is not None
    held = HeldJournal(server.durability.journal)
    server.store.set_journal(held)
    replies: list[Any] = []
    with Client(server.address, timeout=20) as c:
        c.create_group("g", Adagrad(), learning_rate=0.1, tensors={"w": W})
        pusher = threading.Thread(
            target=lambda: replies.append(c.push_detailed("g", G, return_values=True))
        )
        pusher.start()
        assert held.waiting.wait(10)

        def delete_and_recreate() -> None:
            c.delete_group("g")
            c.create_group(
                "g", Adagrad(), learning_rate=0.5, tensors={"w": W}, update_count=7
            )

        # The delete waits for the group's lock, which the push holds until its
        # record is durable and its step applied (an acknowledgement means durable).
        other = threading.Thread(target=delete_and_recreate)
        other.start()
        _wait_for_a_thread_in(ParameterStore._delete)  # blocked: the push holds it
        held.release.set()
        pusher.join(20)
        other.join(20)
        (reply,) = replies
        assert (reply.update_count, reply.applied, reply.duplicate) == (1, True, False)
        expected = W - np.float32(0.1) / (np.float32(1) + np.float32(1e-6))
        np.testing.assert_allclose(reply.values[0], expected, rtol=1e-6)
        assert c.describe_group("g").update_count == 7
