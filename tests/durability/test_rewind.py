"""Rewind and fork (issue 40): a group's state as of an earlier step, from a
snapshot and the group's own log records.

The reference is the ONNX Adam step written out here in NumPy (the operator's
pseudo-code, coefficients in float64 rounded once to float32, as the server
computes them), applied serially from the state pulled at the step rewound to.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest
from _procs import StartServer
from onnxps.client import (
    Adam,
    Client,
    FailedPreconditionError,
    InvalidArgumentError,
    Sync,
)
from onnxps.server.app import ServerHandle
from onnxps.server.rpc._history import HISTORY_PAGE_STEPS
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import write_tensor

F32 = np.float32
N = 2_000
LR = 0.01


def _grads(count: int, seed: int = 40) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(N).astype(F32) for _ in range(count)]


def adam_step(
    x: np.ndarray, v: np.ndarray, h: np.ndarray, g: np.ndarray, t: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One ONNX Adam step at T=t (defaults: alpha 0.9, beta 0.999, epsilon 1e-6,
    held as float32 by the server), float32 arrays."""
    a, b, eps = float(F32(0.9)), float(F32(0.999)), float(F32(1e-6))
    r = LR * math.sqrt(1.0 - b**t) / (1.0 - a**t) if t > 0 else LR
    v = v * F32(a) + g * F32(1.0 - a)
    h = h * F32(b) + (g * g) * F32(1.0 - b)
    x = x - (v / (np.sqrt(h) + F32(eps))) * F32(r)
    return x, v, h


def replay(
    state: list[np.ndarray], t: int, grads: list[np.ndarray]
) -> list[np.ndarray]:
    x, v, h = (np.array(a) for a in state)
    for k, g in enumerate(grads):
        x, v, h = adam_step(x, v, h, g, t + k)
    return [x, v, h]


def assert_state(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want) == 3
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w, strict=True)


def _train(
    c: Client, name: str, grads: list[np.ndarray], saves: tuple[int, ...] = ()
) -> dict[int, list[np.ndarray]]:
    """Push ``grads`` one step each; X, V, H pulled after every step (by T), and a
    snapshot written after the steps in ``saves``."""
    seen = {}
    for k, g in enumerate(grads):
        c.push(name, g)
        seen[k + 1] = c.pull(name, state=True)
        if k + 1 in saves:
            c.save()
    return seen


@pytest.mark.slow
def test_a_rewind_is_bit_equal_goes_on_as_a_replay_and_survives_kill_9(
    server_processes: StartServer,
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    args = ("--durability", "wal", "--data-dir", str(data))
    proc, address = server_processes(
        tmp_path / "a.log", *args, "--snapshot-interval", "0"
    )
    grads = _grads(110)
    with Client(address, timeout=30) as c:
        c.create_group("g", Adam(), learning_rate=LR, tensors={"w": np.ones(N, F32)})
        seen = _train(c, "g", grads[:100], saves=(20, 70))
        at40 = seen[40]
        assert c.describe_group("g").update_count == 100
        done = c.rewind("g", to_step=40)
        assert (done.from_step, done.group.update_count) == (100, 40)
        # the snapshot at 20, then the group's records 21..40: 20 replayed
        assert (done.base, done.base_step, done.replayed) == ("snapshot", 20, 20)
        t, now = c.pull_versioned("g", state=True)
        assert t == 40
        assert_state(now, at40)
        for g in grads[100:110]:
            c.push("g", g)
        want = replay(at40, 40, grads[100:110])
        t, after = c.pull_versioned("g", state=True)
        assert t == 50
        assert_state(after, want)
        history = c.history("g")
        kinds = {(s.step, s.kind) for s in history.steps if s.kind != "step"}
        assert kinds == {(20, "snapshot"), (40, "rewind")}
        assert [s.step for s in history.steps] == list(range(20, 51))
        assert history.update_count == 50 and history.wal_bytes > 0
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc, address = server_processes(tmp_path / "b.log", *args)
    with Client(address, timeout=30) as c:
        t, restarted = c.pull_versioned("g", state=True)
        assert t == 50
        assert_state(restarted, want)
        # the steps of the dropped line are history, not the group's
        assert c.history("g").steps[-1].step == 50
        # and a rewind after the restart goes through the rewind's record
        done = c.rewind("g", to_step=45)
        assert (done.base, done.base_step, done.replayed) == ("rewind", 40, 5)
        assert_state(c.pull("g", state=True), replay(at40, 40, grads[100:105]))


def _wal_server(
    servers: Callable[..., ServerHandle], tmp_path: Path, **fields: object
) -> ServerHandle:
    return servers(
        address="127.0.0.1:0",
        durability="wal",
        data_dir=str(tmp_path / "data"),
        snapshot_interval=0,
        **fields,
    )


@pytest.mark.slow
def test_a_fork_and_its_group_go_on_apart_each_as_its_own_replay(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    server = _wal_server(servers, tmp_path)
    grads = _grads(60)
    other = _grads(10, seed=7)
    with Client(server.address) as c:
        c.create_group("g", Adam(), learning_rate=LR, tensors={"w": np.ones(N, F32)})
        seen = _train(c, "g", grads[:50])
        done = c.fork("g", "g-fork", at_step=30)
        # no snapshot: from the group's create record, 30 records replayed
        assert (done.base, done.base_step, done.replayed) == ("create", 0, 30)
        assert done.group.name == "g-fork" and done.group.update_count == 30
        assert_state(c.pull("g-fork", state=True), seen[30])
        for g, o in zip(grads[50:60], other, strict=True):
            c.push("g", g)
            c.push("g-fork", o)
        assert_state(c.pull("g", state=True), replay(seen[50], 50, grads[50:60]))
        assert_state(c.pull("g-fork", state=True), replay(seen[30], 30, other))
        assert c.describe_group("g-fork").update_count == 40
        # a fork's name is a new group's: one that exists is refused
        with pytest.raises(Exception, match="exists already"):
            c.fork("g", "g-fork", at_step=10)


def test_a_rewind_outside_retention_is_refused_with_the_oldest_step(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    server = _wal_server(servers, tmp_path, keep_snapshots=1)
    with Client(server.address) as c:
        c.create_group("g", Adam(), learning_rate=LR, tensors={"w": np.ones(N, F32)})
        _train(c, "g", _grads(30), saves=(10, 25))
        with pytest.raises(FailedPreconditionError) as refused:
            c.rewind("g", to_step=24)
        assert refused.value.reason == "STEP_NOT_RETAINED"
        assert refused.value.metadata["oldest_step"] == "25"
        assert refused.value.metadata["newest_step"] == "30"
        assert "the oldest step it can go back to is T=25" in str(refused.value)
        with pytest.raises(InvalidArgumentError) as ahead:
            c.rewind("g", to_step=31)
        assert ahead.value.reason == "STEP_AHEAD"
        assert c.describe_group("g").update_count == 30  # nothing changed
        assert c.history("g").oldest_step == 25
        c.rewind("g", to_step=25)
        assert c.describe_group("g").update_count == 25


def test_a_server_without_a_log_has_no_history(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    for server in (
        servers(),
        servers(durability="snapshot", data_dir=str(tmp_path / "s")),
    ):
        with Client(server.address) as c:
            c.create_group(
                "g", Adam(), learning_rate=LR, tensors={"w": np.ones(4, F32)}
            )
            for call in (lambda: c.rewind("g", to_step=0), lambda: c.history("g")):
                with pytest.raises(FailedPreconditionError) as refused:
                    call()
                assert refused.value.reason == "NO_HISTORY"


def test_a_long_history_comes_in_pages_each_under_grpcs_message_limit(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    """History lists at most a page of steps per reply (``more``, ``start_step``):
    the largest page the server sends fits gRPC's default 4 MiB limit, and the
    client joins the pages."""
    biggest = pb.HistoryResponse(
        group="g" * 1024,
        steps=[
            pb.HistoryStep(step=(1 << 64) - 1 - k, unix_time=1.8e9, kind="snapshot")
            for k in range(HISTORY_PAGE_STEPS)
        ],
        update_count=(1 << 64) - 1,
        snapshot_bytes=(1 << 64) - 1,
        wal_bytes=(1 << 64) - 1,
        more=True,
    )
    assert biggest.ByteSize() < 4 << 20
    server = _wal_server(servers, tmp_path)
    with Client(server.address) as c:
        c.create_group("g", Adam(), learning_rate=LR, tensors={"w": np.ones(4, F32)})
        for _ in range(250):
            c.push("g", np.ones(4, F32))
        whole = c.history("g")
        assert [s.step for s in whole.steps] == list(range(251))  # create, steps
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.ParameterServerServiceStub(channel)
        pages, start = [], 0
        while True:
            ask = pb.HistoryRequest(group="g", start_step=start, limit=100)
            page = stub.History(ask, timeout=10)
            pages.append([s.step for s in page.steps])
            if not page.more:
                break
            start = page.steps[-1].step + 1
        assert [len(p) for p in pages] == [100, 100, 51]
        assert sum(pages, []) == list(range(251))
        assert pages[2][-1] == 250 and pages[1][0] == 100
        # a limit above the server's page is held to it
        ask = pb.HistoryRequest(group="g", limit=HISTORY_PAGE_STEPS * 4)
        assert len(stub.History(ask, timeout=10).steps) == 251
        ask = pb.HistoryRequest(group="g", start_step=251)
        empty = stub.History(ask, timeout=10)
        assert (list(empty.steps), empty.more, empty.update_count) == ([], False, 250)


def _push(
    stub: pb_grpc.ParameterServerServiceStub,
    g: np.ndarray,
    seq: int,
    base_version: int | None = None,
) -> pb.PushResponse:
    req = pb.PushRequest(group="g", client_id="worker-1", seq=seq)
    if base_version is not None:
        req.base_version = base_version
    write_tensor(req.gradients.add(), g)
    reply: pb.PushResponse = stub.Push(req, timeout=10)
    return reply


def test_pushes_across_a_rewind_are_answered_by_the_line_they_belong_to(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    server = _wal_server(servers, tmp_path)
    grads = _grads(30)
    with (
        Client(server.address) as c,
        grpc.insecure_channel(server.address) as channel,
    ):
        stub = pb_grpc.ParameterServerServiceStub(channel)
        c.create_group("g", Adam(), learning_rate=LR, tensors={"w": np.ones(N, F32)})
        for k in range(20):
            assert _push(stub, grads[k], seq=1000 + k).update_count == k + 1
        at10 = None
        c.rewind("g", to_step=10)
        at10 = c.pull("g", state=True)
        # seq 1004 stepped to T=5, kept by the rewind: its first answer again
        kept = _push(stub, grads[4], seq=1004)
        assert (kept.update_count, kept.duplicate) == (5, True)
        # seq 1015 stepped to T=16, dropped: refused, not applied again
        with pytest.raises(grpc.RpcError) as dropped:
            _push(stub, grads[15], seq=1015)
        assert dropped.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "REWOUND" in str(dropped.value.trailing_metadata())
        assert "was rewound to T=10 (from T=20)" in str(dropped.value.details())
        # a push computed at T=15 of the old line: the new one is at 10
        with pytest.raises(FailedPreconditionError) as stale:
            c.push_detailed("g", grads[20], base_version=15)
        assert stale.value.reason == "REWOUND"
        assert stale.value.metadata["update_count"] == "10"
        assert c.describe_group("g").update_count == 10
        # new pushes go on from the rewound state
        assert _push(stub, grads[21], seq=1020, base_version=10).update_count == 11
        assert_state(c.pull("g", state=True), replay(at10, 10, grads[21:22]))
    # a graceful stop writes a snapshot after the rewind: restored from it, the
    # server still refuses what the rewind dropped
    server.stop(grace=0)
    again = _wal_server(servers, tmp_path)
    with (
        Client(again.address) as c,
        grpc.insecure_channel(again.address) as channel,
    ):
        stub = pb_grpc.ParameterServerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as dropped:
            _push(stub, grads[16], seq=1016)
        assert "REWOUND" in str(dropped.value.trailing_metadata())
        with pytest.raises(FailedPreconditionError) as stale:
            c.push_detailed("g", grads[20], base_version=15)
        assert stale.value.reason == "REWOUND"
        assert _push(stub, grads[21], seq=1020).duplicate
        assert c.describe_group("g").update_count == 11


@contextmanager
def _sync_workers(server: ServerHandle) -> Iterator[tuple[Client, Client]]:
    """Clients "a" and "b" of ``server``, the two workers of a Sync group "g" (Adam,
    ``N`` ones) that "a" creates."""
    with (
        Client(server.address, client_id="a") as a,
        Client(server.address, client_id="b") as b,
    ):
        a.create_group(
            "g",
            Adam(),
            learning_rate=LR,
            tensors={"w": np.ones(N, F32)},
            consistency=Sync(workers=2),
        )
        yield a, b


def test_a_sync_round_in_progress_is_dropped_and_its_waiting_worker_told(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    server = _wal_server(servers, tmp_path)
    grads = _grads(8)
    with _sync_workers(server) as (a, b):
        for k in range(3):  # three full rounds: T=3
            t = threading.Thread(target=a.push, args=("g", grads[k]))
            t.start()
            b.push("g", grads[k] + 1)
            t.join()
            if k == 0:
                before = a.pull("g", state=True)  # T=1
        assert a.describe_group("g").update_count == 3
        errors: list[BaseException] = []

        def waiting() -> None:
            try:
                a.push_detailed("g", grads[5], return_values=True)
            except BaseException as exc:  # noqa: BLE001 - asserted below
                errors.append(exc)

        worker = threading.Thread(target=waiting)
        worker.start()
        deadline = time.monotonic() + 30
        while a.describe_group("g").pending_contributions != 1:
            assert time.monotonic() < deadline, "the waiting worker's push never came"
            time.sleep(0.01)  # the waiting worker's push is buffered
        done = a.rewind("g", to_step=1)
        worker.join(timeout=10)
        assert not worker.is_alive()
        assert len(errors) == 1 and getattr(errors[0], "reason", "") == "REWOUND"
        assert (done.from_step, done.group.update_count) == (3, 1)
        assert done.group.pending_contributions == 0
        # from the create record: two contributions and the step, replayed
        assert (done.base, done.replayed) == ("create", 3)
        at1 = a.pull("g", state=True)
        assert_state(at1, before)
        # one round from T=1, both workers anew: the mean of their gradients
        t = threading.Thread(target=a.push, args=("g", grads[6]))
        t.start()
        b.push("g", grads[7])
        t.join()
        mean = (grads[6] + grads[7]) / F32(2)
        assert_state(a.pull("g", state=True), replay(at1, 1, [mean]))


def test_a_rewind_replays_its_group_records_only(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    server = _wal_server(servers, tmp_path)
    grads = _grads(30)
    with Client(server.address) as c:
        for name in ("g", "other"):
            c.create_group(
                name, Adam(), learning_rate=LR, tensors={"w": np.ones(N, F32)}
            )
        c.save()  # both at T=0
        for k in range(30):  # 30 records of each group, interleaved
            c.push("g", grads[k])
            c.push("other", grads[k])
            if k + 1 == 12:
                at12 = c.pull("g", state=True)
        done = c.rewind("g", to_step=12)
        assert (done.base, done.base_step, done.replayed) == ("snapshot", 0, 12)
        assert_state(c.pull("g", state=True), at12)
        assert c.describe_group("other").update_count == 30


def test_an_ids_table_is_rewound_with_its_rows(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    from onnxps.client import IdsTable

    server = _wal_server(servers, tmp_path)
    rng = np.random.default_rng(3)
    with Client(server.address) as c:
        c.create_group(
            "g",
            Adam(),
            learning_rate=LR,
            tensors={"b": np.zeros(3, F32)},
            tables={"emb": IdsTable(4)},
        )

        def table() -> list[bytes]:
            ids, rows = c.export_rows("g", "emb", state=True)
            return [ids.tobytes()] + [rows[k].tobytes() for k in sorted(rows)]

        new_ids = rng.choice(1 << 40, size=50, replace=False).astype(np.int64)
        for k in range(20):
            # ten pushes of new ids (5 each), then ten of the first ones again
            pick = new_ids[5 * k : 5 * k + 5] if k < 10 else new_ids[:5]
            g = rng.standard_normal((5, 4)).astype(F32)
            c.push_rows("g", {"emb": (pick, g)})
            if k + 1 == 8:
                at8 = (table(), c.pull("g", state=True), c.count_rows("g", "emb"))
        assert c.count_rows("g", "emb") == 50
        done = c.rewind("g", to_step=8)
        assert (done.from_step, done.replayed) == (20, 8)
        assert c.count_rows("g", "emb") == at8[2] == 40
        assert table() == at8[0]
        assert_state(c.pull("g", state=True), at8[1])


def test_history_rewind_and_fork_from_the_command_line(
    servers: Callable[..., ServerHandle],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from onnxps import cli

    server = _wal_server(servers, tmp_path)
    with Client(server.address) as c:
        for name in ("a", "b"):
            c.create_group(
                name, Adam(), learning_rate=LR, tensors={"w": np.ones(8, F32)}
            )
        for _ in range(6):
            c.push("a", np.ones(8, F32))
            c.push("b", np.ones(8, F32))
        assert cli.main(["history", server.address, "a"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].split() == ["STEP", "TAKEN", "(UTC)", "KIND"]
        assert out[1].split()[0::2] == ["0", "create"]
        assert out[2].split()[0] == "1-6" and out[2].split()[2] == "steps"
        assert out[-1].startswith("group a: T=6, reachable from T=0; retention holds")
        assert cli.main(["history", server.address, "a", "--every-step"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert [line.split()[0] for line in out[1:-1]] == [str(t) for t in range(7)]
        assert [line.split()[-1] for line in out[1:-1]] == ["create"] + ["step"] * 6
        assert cli.main(["rewind", server.address, "--all", "--to-step", "4"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert [line.split(":")[0] for line in out] == ["rewound a", "rewound b"]
        assert "T=4 (was 6); from the create at T=0 and 4 records replayed" in out[0]
        assert [g.update_count for g in c.list_groups()] == [4, 4]
        assert cli.main(["fork", server.address, "a", "a2", "--at-step", "2"]) == 0
        assert "forked a (T=4) as a2: T=2; from the create" in capsys.readouterr().out
        assert c.describe_group("a2").update_count == 2
        # --to-time: each group's last step taken at or before it
        c.push("a", np.ones(8, F32))  # a at 5, taken after the time below
        history = c.history("a")
        when = history.steps[-2].unix_time  # the rewind's landing at 4
        assert cli.main(["rewind", server.address, "a", "--to-time", str(when)]) == 0
        assert c.describe_group("a").update_count == 4
        # wrong usage: one line, status 2
        assert cli.main(["rewind", server.address, "--to-step", "1"]) == 2
        assert "give either GROUP or --all" in capsys.readouterr().err
        assert cli.main(["rewind", server.address, "a", "--to-step", "99"]) == 1
        err = capsys.readouterr().err
        assert "STEP_AHEAD" in err or "it cannot go to T=99" in err


def test_retention_keeps_a_time_window_and_a_byte_budget(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    import urllib.request

    window = _wal_server(
        servers, tmp_path / "w", keep_snapshots=1, keep_seconds=3600.0, metrics_port=0
    )
    budget = _wal_server(servers, tmp_path / "b", keep_snapshots=3, keep_bytes=1)
    for server in (window, budget):
        with Client(server.address) as c:
            c.create_group(
                "g", Adam(), learning_rate=LR, tensors={"w": np.ones(N, F32)}
            )
            _train(c, "g", _grads(15), saves=(5, 10, 15))
    with Client(window.address) as c:
        # one snapshot by count, but all three are younger than an hour
        assert len(list((tmp_path / "w" / "data" / "snapshots").iterdir())) == 3
        held = c.history("g")
        assert held.oldest_step == 5 and held.snapshot_bytes > 0
        url = f"http://127.0.0.1:{window.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        assert f'onnxps_retained_bytes{{kind="wal"}} {float(held.wal_bytes)}' in text
        assert 'onnxps_retained_bytes{kind="snapshots"}' in text
    with Client(budget.address) as c:
        # over the budget: only the newest snapshot stays, and the log after it
        assert len(list((tmp_path / "b" / "data" / "snapshots").iterdir())) == 1
        assert c.history("g").oldest_step == 15
        with pytest.raises(FailedPreconditionError, match="oldest step it can go"):
            c.rewind("g", to_step=14)


def test_rewind_and_fork_are_an_admins_and_a_fork_stays_in_its_prefixes(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    from onnxps.client import PermissionDeniedError

    tokens = tmp_path / "tokens.txt"
    tokens.write_text(
        "adm-a-0123456789abcdef admin a/\n"
        "wr-0123456789abcdef00 write *\n"
        "rd-0123456789abcdef00 read *\n"
    )
    server = _wal_server(servers, tmp_path, tokens_file=str(tokens))
    with Client(server.address, token="adm-a-0123456789abcdef") as admin:
        admin.create_group(
            "a/x", Adam(), learning_rate=LR, tensors={"w": np.ones(8, F32)}
        )
        for _ in range(3):
            admin.push("a/x", np.ones(8, F32))
        with pytest.raises(PermissionDeniedError) as outside:
            admin.fork("a/x", "b/x", at_step=1)
        assert outside.value.reason == "GROUP_NOT_PERMITTED"
        assert outside.value.metadata["group"] == "b/x"
        assert admin.fork("a/x", "a/y", at_step=1).group.update_count == 1
    with Client(server.address, token="wr-0123456789abcdef00") as writer:
        with pytest.raises(PermissionDeniedError) as role:
            writer.rewind("a/x", to_step=1)
        assert role.value.reason == "ROLE_FORBIDS_METHOD"
    with Client(server.address, token="rd-0123456789abcdef00") as reader:
        assert reader.history("a/x").update_count == 3
        with pytest.raises(PermissionDeniedError):
            reader.fork("a/x", "a/z", at_step=1)


def test_the_async_client_rewinds_forks_and_lists_history(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    import asyncio

    from onnxps.client import AsyncClient

    server = _wal_server(servers, tmp_path)
    grads = _grads(6)

    async def run() -> tuple[int, int, int, list[int]]:
        async with AsyncClient(server.address) as c:
            await c.create_group(
                "g", Adam(), learning_rate=LR, tensors={"w": np.ones(N, F32)}
            )
            for g in grads:
                await c.push("g", g)
            forked = await c.fork("g", "f", at_step=2)
            rewound = await c.rewind("g", to_step=3)
            history = await c.history("g")
            return (
                forked.group.update_count,
                rewound.group.update_count,
                rewound.replayed,
                [s.step for s in history.steps],
            )

    assert asyncio.run(run()) == (2, 3, 3, [0, 1, 2, 3])


@pytest.mark.slow
def test_the_torch_optimizer_skips_a_step_computed_before_a_rewind(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    from onnxps.torch import RemoteOptimizer

    server = _wal_server(servers, tmp_path)
    with Client(server.address) as c:
        w = torch.nn.Parameter(torch.ones(8))
        opt = RemoteOptimizer([w], c, group="g", lr=LR, on_stale="skip")
        for k in range(5):
            w.grad = torch.full((8,), 0.5)
            opt.step()
            if k + 1 == 2:
                at2 = c.pull("g")[0]
        c.rewind("g", to_step=2)
        w.grad = torch.full((8,), 0.5)
        opt.step()  # computed at T=5: refused REWOUND, skipped, X pulled
        assert opt.skipped_steps == 1
        np.testing.assert_array_equal(w.detach().numpy(), at2)
        assert c.describe_group("g").update_count == 2
        w.grad = torch.full((8,), 0.5)
        opt.step()  # from the rewound state
        assert c.describe_group("g").update_count == 3


def test_a_sync_group_rewinds_from_a_snapshot_taken_mid_round(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    server = _wal_server(servers, tmp_path)
    grads = _grads(8)
    with _sync_workers(server) as (a, b):
        seen = {}
        for k in range(3):  # rounds to T=3; a snapshot with a's push of round 2
            a.push("g", grads[2 * k])  # buffered: the round waits for b
            if k == 1:
                assert a.describe_group("g").pending_contributions == 1
                a.save()
            b.push("g", grads[2 * k + 1])
            seen[k + 1] = a.pull("g", state=True)
        done = a.rewind("g", to_step=2)
        # the snapshot (T=1, a's contribution pending), then b's push and the step
        assert (done.base, done.base_step, done.replayed) == ("snapshot", 1, 2)
        assert_state(a.pull("g", state=True), seen[2])
