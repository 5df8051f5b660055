"""Replicated shards (issue 23): real etcd, real `onnxps serve` processes.

A shard's servers elect a primary in etcd; the primary ships its write-ahead log to
the standbys and acknowledges a push once the synchronous standby holds it; a killed
primary is replaced by the standby that holds every acknowledged push, and clients
of ``Client("etcd://...")`` follow it with the same seq (exactly once).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _etcd import EtcdProcess, HoldingProxy
from _procs import clean_env
from _replica_sets import Replicas
from _replicas import (
    SIZE,
    TTL,
    ReplicaSet,
    _acked,
    _create,
    _kill,
    _metrics_text,
    _replay,
    _serial,
    _wait_acked,
    _workers,
)
from onnxps.client import (
    Adagrad,
    Client,
    FailedPreconditionError,
    NotFoundError,
    PermissionDeniedError,
)


@pytest.mark.slow
def test_a_standby_holds_every_acknowledged_push_and_refuses_writes(
    replicas: object,
) -> None:
    rs: ReplicaSet = replicas(2)  # type: ignore[operator]
    p = rs.primary_with_group()
    s = 1 - p
    with Client(rs.url, timeout=30) as c:
        assert c.address == rs.addresses[p]
        ts = [c.push("g", np.full(SIZE, 0.5, np.float32)) for _ in range(5)]
    assert ts == [1, 2, 3, 4, 5]
    rs.wait_t(s, "g", 5)
    t_p, x_p = rs.state(p, "g")
    t_s, x_s = rs.state(s, "g")
    assert (t_p, t_s) == (5, 5)
    np.testing.assert_array_equal(x_s, x_p)
    with Client(rs.addresses[s], timeout=10) as c:
        with pytest.raises(FailedPreconditionError) as err:
            c.push("g", np.ones(SIZE, np.float32))
    assert err.value.reason == "NOT_PRIMARY"
    assert err.value.metadata["primary"] == rs.addresses[p]
    assert rs.state(s, "g")[0] == 5  # the refused push changed nothing


@pytest.mark.slow
def test_a_killed_primary_is_replaced_and_the_client_follows(replicas: object) -> None:
    rs: ReplicaSet = replicas(2)  # type: ignore[operator]
    p = rs.primary_with_group()
    with Client(rs.url, timeout=60) as c:
        assert [c.push("g", np.full(SIZE, 0.5, np.float32)) for _ in range(3)] == [
            1, 2, 3,
        ]  # fmt: skip
        rs.procs[p].kill()
        rs.procs[p].wait()
        new = rs.primary(not_=p)
        assert new == 1 - p
        rs.start(p)  # rejoins as a standby: pushes need a synchronous standby
        # The same client, same call: it finds the new primary in etcd.
        assert c.push("g", np.full(SIZE, 0.5, np.float32)) == 4
        assert c.address == rs.addresses[new]
    rs.wait_t(p, "g", 4)
    np.testing.assert_array_equal(rs.state(p, "g")[1], rs.state(new, "g")[1])


@pytest.mark.slow
def test_kill_minus_9_of_the_primary_10_times_under_4_workers_loses_and_repeats_nothing(
    replicas: object, tmp_path: Path
) -> None:
    rs: ReplicaSet = replicas(3)  # type: ignore[operator]
    rs.primary()
    rs.wait_sync()
    _create(rs.url)
    out = tmp_path / "acked.jsonl"
    # the workers push until the kills are over (at most ``count`` each)
    workers, count, kills = 4, 100_000, 10
    stop = tmp_path / "stop"
    procs = _workers(rs.url, workers, count, out, stop)
    try:
        for _ in range(kills):
            # 40 pushes acknowledged since the last kill, and every worker still
            # pushing: each kill is under load
            _wait_acked(out, len(_acked(out)) + 40, procs)
            assert all(w.poll() is None for w in procs), "the workers finished"
            # a standby holds every acknowledged push (else none may be promoted:
            # the shard would wait for this primary to come back)
            rs.wait_sync()
            p = rs.primary()
            rs.procs[p].kill()
            rs.procs[p].wait()
            rs.primary(not_=p)
            rs.start(p)
        _wait_acked(out, len(_acked(out)) + 40, procs)  # the last primary serves
        stop.touch()
        for w in procs:
            assert w.wait(timeout=180) == 0, out.with_suffix(".w0.err").read_text()
    finally:
        for w in procs:
            if w.poll() is None:
                w.kill()
                w.wait()
    records = _acked(out)
    total = len(records)
    assert total >= kills * 40
    # Every push was acknowledged once, each at its own T: none applied twice.
    assert sorted(r["t"] for r in records) == list(range(1, total + 1))
    for i in rs.procs:
        rs.wait_t(i, "g", total)
    xs = [rs.state(i, "g")[1] for i in rs.procs]
    for x in xs[1:]:
        np.testing.assert_array_equal(x, xs[0])
    np.testing.assert_array_equal(xs[0], _replay(records))


@pytest.mark.slow
def test_a_frozen_primary_acknowledges_nothing_after_a_new_one_is_elected(
    replicas: object,
) -> None:
    rs: ReplicaSet = replicas(3)  # type: ignore[operator]
    p = rs.primary_with_group()
    old = Client(rs.addresses[p], timeout=10)
    assert old.push("g", np.full(SIZE, 0.5, np.float32)) == 1
    os.kill(rs.procs[p].pid, signal.SIGSTOP)
    new = rs.primary(not_=p)
    rs.wait_sync()
    with Client(rs.url, timeout=60) as c:
        assert c.push("g", np.full(SIZE, 0.5, np.float32)) == 2
    os.kill(rs.procs[p].pid, signal.SIGCONT)
    try:
        with pytest.raises(Exception) as err:  # noqa: B017 - any refusal
            old.push("g", np.full(SIZE, 0.25, np.float32), timeout=10)
    finally:
        old.close()
    assert type(err.value).__name__ in (
        "FailedPreconditionError", "UnavailableError", "DeadlineExceededError",
    ), err.value  # fmt: skip
    # The old primary stepped down and exited (status 75: restart me as a standby).
    assert rs.procs[p].wait(timeout=30) == 75
    assert rs.state(new, "g")[0] == 2
    rs.start(p)
    rs.wait_t(p, "g", 2)
    np.testing.assert_array_equal(rs.state(p, "g")[1], rs.state(new, "g")[1])


@pytest.mark.slow
def test_a_standby_killed_and_restarted_catches_up(replicas: object) -> None:
    rs: ReplicaSet = replicas(3)  # type: ignore[operator]
    p = rs.primary_with_group()
    standby = next(i for i in rs.procs if i != p)
    with Client(rs.url, timeout=60) as c:
        for _ in range(5):
            c.push("g", np.full(SIZE, 0.5, np.float32))
        rs.procs[standby].kill()
        rs.procs[standby].wait()
        for _ in range(5):
            c.push("g", np.full(SIZE, 0.5, np.float32))
        rs.start(standby)
        for _ in range(5):
            c.push("g", np.full(SIZE, 0.5, np.float32))
    rs.wait_t(standby, "g", 15)
    np.testing.assert_array_equal(rs.state(standby, "g")[1], rs.state(p, "g")[1])


@pytest.mark.slow
def test_a_push_resent_to_the_new_primary_is_answered_not_applied_again(
    replicas: object,
) -> None:
    rs: ReplicaSet = replicas(2)  # type: ignore[operator]
    p = rs.primary_with_group()
    g = np.full(SIZE, 0.5, np.float32)
    first = _raw_push(rs.addresses[p], g, "worker-7", 41)
    assert (first.update_count, first.applied, first.duplicate) == (1, True, False)
    rs.procs[p].kill()
    rs.procs[p].wait()
    new = rs.primary(not_=p)
    rs.start(p)
    rs.wait_sync()
    # the reply was lost: the worker resends
    again = _raw_push(rs.addresses[new], g, "worker-7", 41)
    assert (again.update_count, again.duplicate) == (1, True)
    assert rs.state(new, "g")[0] == 1


@pytest.mark.slow
def test_with_tokens_a_standby_follows_with_its_replication_token(
    replicas: object, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("adm-5c1d9e admin *\nrep-8b2f4a replication *\n")
    rs: ReplicaSet = replicas(  # type: ignore[operator]
        2,
        extra=("--tokens-file", str(tokens)),
        env={"ONNXPS_REPLICATION_TOKEN": "rep-8b2f4a"},
    )
    p = rs.primary()
    assert rs.wait_sync() == [f"m{1 - p}"]
    with Client(rs.url, timeout=30, token="adm-5c1d9e") as c:
        c.create_group(
            "g", Adagrad(), learning_rate=0.1, tensors={"x": np.zeros(SIZE, np.float32)}
        )
        assert c.push("g", np.full(SIZE, 0.5, np.float32)) == 1
    with Client(rs.addresses[1 - p], timeout=30, token="adm-5c1d9e") as c:
        deadline = time.monotonic() + 30
        while _update_count(c, "g") != 1:  # applied after its ack
            assert time.monotonic() < deadline, "the standby did not apply the push"
            time.sleep(0.05)
    # The replication token follows the log and does nothing else.
    with Client(rs.addresses[p], timeout=30, token="rep-8b2f4a") as c:
        with pytest.raises(PermissionDeniedError) as err:
            c.push("g", np.full(SIZE, 0.5, np.float32))
    assert err.value.reason == "ROLE_FORBIDS_METHOD"


def _update_count(c: Client, group: str) -> int:
    """T of ``group`` on a standby; -1 before it applied the group's creation."""
    try:
        return c.describe_group(group).update_count
    except NotFoundError:
        return -1


@pytest.mark.slow
def test_status_of_a_replicated_cluster_lists_its_members(replicas: object) -> None:
    rs: ReplicaSet = replicas(2)  # type: ignore[operator]
    p = rs.primary_with_group()
    with Client(rs.url, timeout=30) as c:
        c.push("g", np.full(SIZE, 0.5, np.float32))
    deadline = time.monotonic() + 30
    while True:  # members register their lsn about once a second
        proc = subprocess.run(
            [sys.executable, "-m", "onnxps.cli", "status", rs.url],
            capture_output=True, text=True, env=clean_env(), timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        rows = [line.split() for line in lines[lines.index("") + 2 :]]
        if all(r[5] == "2" for r in rows) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert lines[lines.index("") + 1].split() == [
        "SHARD", "MEMBER", "ADDRESS", "ROLE", "TERM", "LSN", "LAG", "SYNC",
    ]  # fmt: skip
    s = 1 - p
    # lsn 2: the group's create and the push
    assert sorted(rows) == sorted(
        [
            ["0", f"m{p}", rs.addresses[p], "primary", "1", "2", "0", "-"],
            ["0", f"m{s}", rs.addresses[s], "standby", "1", "2", "0", "yes"],
        ]
    )
    assert lines[1].split()[0] == "g"  # the groups table first, from the primary


@pytest.mark.slow
def test_an_async_client_follows_a_failover(replicas: object) -> None:
    import asyncio

    from onnxps.client import AsyncClient

    rs: ReplicaSet = replicas(2)  # type: ignore[operator]
    p = rs.primary_with_group()
    g = np.full(SIZE, 0.5, np.float32)

    async def run() -> list[int]:
        async with AsyncClient(rs.url, timeout=60) as c:
            ts = [await c.push("g", g)]
            rs.procs[p].kill()
            rs.procs[p].wait()
            assert rs.primary(not_=p) == 1 - p
            rs.start(p)  # the new primary needs it as its synchronous standby
            ts.append(await c.push("g", g))
            assert c.address == rs.addresses[1 - p]
            return ts

    assert asyncio.run(run()) == [1, 2]


@pytest.mark.slow
def test_metrics_export_role_term_lag_and_failovers(
    replicas: object, tmp_path: Path
) -> None:
    rs: ReplicaSet = replicas(2, extra=("--metrics-port", "0"))  # type: ignore[operator]
    p = rs.primary_with_group()
    with Client(rs.url, timeout=30) as c:
        c.push("g", np.full(SIZE, 0.5, np.float32))
    s = 1 - p
    primary = _metrics_text(tmp_path / f"server{p}-1.log")
    standby = _metrics_text(tmp_path / f"server{s}-1.log")
    assert 'onnxps_replica_role{role="primary"} 1.0' in primary
    assert 'onnxps_replica_role{role="standby"} 1.0' in standby
    assert "onnxps_replica_term 1.0" in primary
    assert "onnxps_replica_term 1.0" in standby
    assert "onnxps_replica_failovers_total 1.0" in primary
    assert "onnxps_replica_failovers_total 0.0" in standby
    assert "onnxps_replica_lsn 2.0" in primary  # the create and the push
    assert "onnxps_replica_sync_standbys 1.0" in primary
    assert f'onnxps_replica_standby_lag_records{{member="m{s}"}} 0.0' in primary


@pytest.mark.slow
def test_a_standby_that_crashed_while_adopting_a_snapshot_is_not_promoted(
    replicas: object, tmp_path: Path
) -> None:
    rs: ReplicaSet = replicas(2)  # type: ignore[operator]
    p = rs.primary()
    s = 1 - p
    assert rs.wait_sync() == [f"m{s}"]
    _create(rs.url)
    with Client(rs.url, timeout=30) as c:
        assert c.push("g", np.full(SIZE, 0.5, np.float32)) == 1
    for i in (s, p):
        rs.procs[i].kill()
        rs.procs[i].wait()
    # What a standby killed in the middle of adopt_snapshot leaves behind.
    (tmp_path / f"data{s}" / "ADOPTING").write_bytes(b"")
    rs.start(s)
    deadline = time.monotonic() + 4 * TTL  # the old lease expires, s may campaign
    while time.monotonic() < deadline:
        info = rs.key("primary")
        assert not isinstance(info, dict) or info["member"] != f"m{s}"
        time.sleep(0.1)
    rs.start(p)  # the old primary (named in the sync key) takes the lead again
    assert rs.primary() == p
    marker = tmp_path / f"data{s}" / "ADOPTING"
    deadline = time.monotonic() + 60
    while marker.exists():  # s adopts p's snapshot: complete again
        assert time.monotonic() < deadline, "the standby did not catch up"
        time.sleep(0.05)
    rs.wait_t(s, "g", 1)


@pytest.mark.slow
def test_a_client_of_etcd_sends_frames_to_the_primary_and_follows_it(
    replicas: object,
) -> None:
    """By default a client of etcd sends small calls as frames to the primary's
    data port (no shared memory: the primary may move to another host); after a
    failover its calls go to the new primary, frames too."""
    rs: ReplicaSet = replicas(2)  # type: ignore[operator]
    p = rs.primary_with_group()
    g = np.full(SIZE, 0.5, np.float32)
    with Client(rs.url, timeout=60) as c:
        assert (c.shared_memory, c.data_channel, c.frames) == ("off", "auto", True)
        assert [c.push("g", g), c.push("g", g)] == [1, 2]
        ch = c._call_channels[0]
        assert (ch.address, ch.closed) == (rs.addresses[p], False)
        rs.procs[p].kill()
        rs.procs[p].wait()
        new = rs.primary(not_=p)
        rs.start(p)  # rejoins as a standby: pushes need a synchronous standby
        assert [c.push("g", g), c.push("g", g)] == [3, 4]
        ch = c._call_channels[0]
        assert (ch.address, ch.closed) == (rs.addresses[new], False)
    rs.wait_t(p, "g", 4)
    with Client(rs.url, timeout=30, shared_memory="on") as c:
        assert c.shared_memory == "on"


@pytest.mark.slow
def test_a_frame_call_answered_not_primary_drops_its_channel_and_follows(
    replica_sets: Any,
    etcd_proxy: HoldingProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The primary is deposed but keeps running (etcd, through a proxy, stops
    answering it: it cannot renew its lease, so it acknowledges nothing and another
    is elected). The client's next push goes as a frame on its channel to the old
    primary, which answers NOT_PRIMARY: the client drops that channel, resends over
    gRPC to the new primary with the same seq (applied once), and its next calls
    go as frames to the new primary."""
    rs: Replicas = replica_sets(0)
    rs.coordinators[0] = f"etcd://127.0.0.1:{etcd_proxy.port}/ps"
    rs.start(0)
    assert rs.primary() == 0
    rs.start(1)
    rs.start(2)
    rs.wait_sync()
    rs.create_group()
    g = np.full(SIZE, 0.5, np.float32)
    with Client(rs.url, timeout=60) as c, caplog.at_level("INFO", "onnxps"):
        assert c.frames is True
        assert [c.push("g", g), c.push("g", g)] == [1, 2]
        old = c._call_channels[0]
        assert (old.address, old.closed) == (rs.addresses[0], False)
        etcd_proxy.holding.set()  # the old primary's reads and renewals hang
        etcd_proxy.holding_keepalives.set()
        new = rs.primary(not_=0, timeout=60)
        assert c.push("g", g) == 3
        assert rs.procs[0].poll() is None  # alive: it answered, it did not vanish
        assert old.closed  # dropped on NOT_PRIMARY (not broken: nothing logged)
        assert [r.getMessage() for r in caplog.records if "call channel" in r.msg] == []
        assert c.address == rs.addresses[new]
        assert c.push("g", g) == 4
        ch = c._call_channels[0]
        assert (ch.address, ch.closed) == (rs.addresses[new], False)
    refused = [
        line
        for line in rs.log(0).splitlines()
        if "rpc Push group=g code=FAILED_PRECONDITION" in line
    ]
    # the push, refused twice by the old primary: as a frame, then over gRPC
    assert len(refused) == 2, rs.log(0)[-3000:]
    for i in (1, 2):
        rs.wait_t(i, "g", 4)
        t, x = rs.state(i, "g")
        assert t == 4
        np.testing.assert_array_equal(x, _serial([g] * 4))


@pytest.mark.slow
def test_etcd_stopped_and_restarted_loses_nothing_and_the_shard_goes_on(
    replicas: object,
    etcd_server: EtcdProcess,
) -> None:
    rs: ReplicaSet = replicas(2)  # type: ignore[operator]
    rs.primary()
    rs.wait_sync()
    _create(rs.url)
    g = np.full(SIZE, 0.5, np.float32)
    with Client(rs.url, timeout=30) as c:
        assert [c.push("g", g) for _ in range(3)] == [1, 2, 3]
        etcd_server.stop()
        time.sleep(2 * TTL)  # past every lease: nobody can renew one
        # Without etcd the primary cannot know it still leads: it acknowledges
        # nothing (it refuses before logging, so it need not step down).
        with pytest.raises(FailedPreconditionError) as err:
            c.push("g", g, timeout=3)
        assert err.value.reason == "NOT_PRIMARY"
        etcd_server.start()
        assert c.push("g", g) == 4  # resumes once etcd is back
    p = rs.primary()
    rs.wait_t(1 - p, "g", 4)
    assert rs.state(p, "g")[0] == 4
    np.testing.assert_array_equal(rs.state(p, "g")[1], rs.state(1 - p, "g")[1])


def _raw_push(address: str, g: np.ndarray, client_id: str, seq: int) -> Any:
    """One Push call, no client retries: the server's own answer."""
    from onnxps.v1 import parameter_server_pb2 as pb
    from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

    tensor = pb.Tensor(
        name="x", dtype=pb.DATA_TYPE_FLOAT, dims=[g.size], raw_data=g.tobytes()
    )
    request = pb.PushRequest(
        group="g", gradients=[tensor], client_id=client_id, seq=seq
    )
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.ParameterServerServiceStub(ch).Push(request, timeout=30)


@pytest.mark.slow
def test_without_a_synchronous_standby_pushes_are_refused_by_default(
    replicas: object,
) -> None:
    rs: ReplicaSet = replicas(2)  # type: ignore[operator]
    p = rs.primary_with_group()
    g = np.full(SIZE, 0.5, np.float32)
    with Client(rs.url, timeout=30) as c:
        assert c.push("g", g) == 1
        _kill(rs, 1 - p)
        # A client retries UNAVAILABLE until its deadline: ask the server once.
        with pytest.raises(grpc.RpcError) as err:
            _raw_push(rs.addresses[p], g, "w", 1)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert str(err.value.details()).startswith(
        "0 of the 1 synchronous standbys this shard needs (--sync-replicas) follow"
    )
    assert rs.state(p, "g")[0] == 1  # refused before anything was logged
    rs.start(1 - p)
    with Client(rs.url, timeout=60) as c:
        assert c.push("g", g) == 2  # once the standby caught up again


@pytest.mark.slow
def test_sync_policy_lower_acknowledges_with_the_standbys_left(
    replicas: object,
) -> None:
    rs: ReplicaSet = replicas(2, extra=("--sync-policy", "lower"))  # type: ignore[operator]
    p = rs.primary()
    s = 1 - p
    assert rs.wait_sync() == [f"m{s}"]
    _create(rs.url)
    g = np.full(SIZE, 0.5, np.float32)
    with Client(rs.url, timeout=30) as c:
        assert c.push("g", g) == 1
        _kill(rs, s)
        assert c.push("g", g) == 2  # acknowledged by the primary alone
        sync = rs.key("sync")
        assert isinstance(sync, dict) and sync["standbys"] == []  # s may lack T=2
        rs.start(s)
        assert rs.wait_sync() == [f"m{s}"]
        assert c.push("g", g) == 3
    rs.wait_t(s, "g", 3)


@pytest.mark.slow
def test_serve_says_when_it_cannot_reach_etcd(tmp_path: Path) -> None:
    from _etcd import free_port

    url = f"etcd://127.0.0.1:{free_port()}/ps"  # nothing listens there
    proc = subprocess.run(
        [sys.executable, "-m", "onnxps.cli", "serve", "--address", "127.0.0.1:0",
         "--durability", "wal", "--data-dir", str(tmp_path / "d"),
         "--coordinator", url, "--shard", "0/1"],
        capture_output=True, text=True, env=clean_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"onnxps: cannot reach etcd at {url} (waited 15 s)"), last
    assert last.endswith(
        "(check --coordinator: etcd's client address, "
        "etcd://HOST:PORT/PREFIX, and that etcd runs there)"
    ), last
    # what it tries, once (not a line every 0.5 s for 15 s), then the error
    about_etcd = [line for line in proc.stderr.splitlines() if "etcd" in line]
    assert len(about_etcd) == 2, proc.stderr
    assert about_etcd[0].endswith(
        f"etcd at {url} does not answer (etcd did not answer: 127.0.0.1:"
        f"{url.split(':')[2].split('/')[0]}: [Errno 111] Connection refused): "
        "trying for up to 15 s"
    ), about_etcd[0]


@pytest.mark.slow
def test_a_standby_restarted_under_load_catches_up_and_is_promoted(
    replicas: object, tmp_path: Path
) -> None:
    rs: ReplicaSet = replicas(2)  # type: ignore[operator]
    p = rs.primary()
    s = 1 - p
    rs.wait_sync()
    _create(rs.url)
    out = tmp_path / "acked.jsonl"
    workers, count = 2, 60
    procs = _workers(rs.url, workers, count, out)
    try:
        _wait_acked(out, 20, procs)
        _kill(rs, s)  # pushes are refused until it is back and caught up
        rs.start(s)
        _wait_acked(out, 50, procs)  # s is synchronous again: pushes go on
        assert rs.wait_sync() == [f"m{s}"]
        _kill(rs, p)
        assert rs.primary(not_=p) == s  # it holds every acknowledged push
        rs.start(p)
        for w in procs:
            assert w.wait(timeout=180) == 0, out.with_suffix(".w0.err").read_text()
    finally:
        for w in procs:
            if w.poll() is None:
                w.kill()
                w.wait()
    records = _acked(out)
    total = workers * count
    assert sorted(r["t"] for r in records) == list(range(1, total + 1))
    for i in rs.procs:
        rs.wait_t(i, "g", total)
    np.testing.assert_array_equal(rs.state(p, "g")[1], rs.state(s, "g")[1])
    np.testing.assert_array_equal(rs.state(s, "g")[1], _replay(records))
