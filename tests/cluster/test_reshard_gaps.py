"""What resharding promises beyond its main path (docs/resharding.md): a cluster
of one shard grown under a worker made before the growth; a source shard whose
primary is killed -9 while a followed move copies its group; a sync group's log
followed while several workers push rounds to it. Real etcd, real shard
processes; every acknowledged push is checked against a serial replay."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _etcd import EtcdProcess
from _reshard import EtcdCluster, Workers, check_against_replay, create_groups
from onnxps.cli.reshard import Move, reshard, reshard_status, target_shard
from onnxps.client import Adagrad, Client, Sync
from onnxps.client._discovery import Discovery
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import SHARD_METADATA_KEY

pytestmark = pytest.mark.slow


def test_a_one_shard_cluster_grows_under_a_worker_made_before(
    tmp_path: Path, etcd_server: EtcdProcess, servers: Callable[..., Any]
) -> None:
    """A client of a one-shard cluster (``Client("etcd://...")``) made before the
    growth follows the groups moved to the new shard: no call fails."""
    cluster = EtcdCluster(tmp_path, etcd_server)
    shape = (8, 2, False, False)
    try:
        cluster.start(0, 1)
        with cluster.connect() as admin:
            names = create_groups(admin, *shape)
            # routed as a cluster of one shard, it still forks (one server)
            forked = admin.fork("plain0", "forked0", at_step=0)
            assert forked.group.update_count == 0
        with Workers(cluster, names) as workers:
            workers.wait_steps(40)
            cluster.start(1, 2)
            report = reshard(cluster.url, 2)
            assert report.moves and {(m.source, m.target) for m in report.moves} == {
                (0, 1)
            }
            workers.wait_steps(60)
        assert not workers.errors, workers.errors
        assert reshard_status(cluster.url)["state"] == "complete"
        check_against_replay(cluster, names, workers, servers(), shape, shards=2)
    finally:
        cluster.close()


def _moving_from(shard: int, grow_to: int, prefix: str) -> str:
    """A group name that growing to ``grow_to`` shards moves from ``shard`` to the
    new one."""
    return next(
        f"{prefix}{i}"
        for i in range(200)
        if target_shard(f"{prefix}{i}", grow_to - 1) == shard
        and target_shard(f"{prefix}{i}", grow_to) == grow_to - 1
    )


ROWS, COLS = 32768, 64  # float32: 8 MiB of X and 8 MiB of Adagrad's H
BIG_PUSH = 1024  # rows: a push of 256 KiB


def _rows_push(c: Client, name: str, step: int, rows: int = 16) -> int:
    rng = np.random.default_rng(step)
    ids = rng.integers(0, ROWS, rows)
    grads = rng.standard_normal((rows, COLS)).astype(np.float32)
    return c.push_rows(name, {"w": (ids, grads)}).update_count


def _big(c: Client, name: str) -> None:
    x = np.linspace(-1, 1, ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    c.create_group(name, Adagrad(epsilon=1e-7), learning_rate=0.1, tensors={"w": x})


def _primary_key(cluster: EtcdCluster, shard: int) -> Any:
    address = Discovery(cluster.url).primary(shard, time.monotonic() + 30)
    (key,) = [k for k, a in cluster.addresses.items() if a == address]
    return key


def _wait_ready(cluster: EtcdCluster, shard: int) -> None:
    """Until ``shard``'s primary has its synchronous standby (a create lands)."""
    end = time.monotonic() + 30
    while True:
        members = [m for m in Discovery(cluster.url).replicas(5)
                   if m["shard"] == shard]  # fmt: skip
        if any(m["sync"] for m in members):
            return
        assert time.monotonic() < end, members
        time.sleep(0.1)


def _wait_copy(cluster: EtcdCluster, name: str, tool: threading.Thread) -> None:
    """Until the map says ``name`` is being copied (its log followed)."""
    end = time.monotonic() + 60
    while True:
        moving = reshard_status(cluster.url).get("moving", {})
        if moving.get(name, {}).get("copy"):
            return
        assert tool.is_alive() and time.monotonic() < end, "no copy seen"
        time.sleep(0.01)


def _listed(cluster: EtcdCluster, shard: int) -> list[str]:
    address = Discovery(cluster.url).primary(shard, time.monotonic() + 10)
    assert address is not None
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ParameterServerServiceStub(channel)
        reply = stub.ListGroups(
            pb.ListGroupsRequest(),
            timeout=10,
            metadata=((SHARD_METADATA_KEY, f"{shard}/3"),),
        )
    return [g.name for g in reply.groups]


def test_the_source_primary_killed_mid_copy_and_the_move_is_made_again(
    tmp_path: Path, etcd_server: EtcdProcess, servers: Callable[..., Any]
) -> None:
    """Replicated shards (a primary and a synchronous standby each): the source's
    primary is killed -9 while ``reshard`` copies a 16 MiB group and follows its
    log, a worker pushing to it. The copy cut off is abandoned and made again
    from the standby that took the lead; the move completes, every acknowledged
    push is applied once (T and X, V, H as a serial replay) and the map ends with
    the group owned by the new shard and no move under way."""
    cluster = EtcdCluster(tmp_path, etcd_server)
    name = _moving_from(0, 3, "big")
    acked = [0]
    errors: list[BaseException] = []
    stop = threading.Event()
    done: list[Any] = []
    try:
        for shard in (0, 1):
            for member in (0, 1):
                cluster.start_member(shard, 2, member, sync=1)
        for shard in (0, 1):
            _wait_ready(cluster, shard)
        with cluster.connect(split_bytes=1 << 30) as admin:
            _big(admin, name)

        def work() -> None:
            try:
                with cluster.connect(client_id="worker", split_bytes=1 << 30) as c:
                    while not stop.is_set():  # 256 KiB each: followed for
                        _rows_push(c, name, acked[0], BIG_PUSH)  # several rounds
                        acked[0] += 1
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        for member in (0, 1):
            cluster.start_member(2, 3, member, sync=1)
        _wait_ready(cluster, 2)
        while acked[0] < 20 and not errors:
            stop.wait(0.05)
        tool = threading.Thread(
            target=lambda: done.append(reshard(cluster.url, 3, timeout=10)),
            daemon=True,
        )
        tool.start()
        _wait_copy(cluster, name, tool)
        victim = _primary_key(cluster, 0)
        old = cluster.addresses[victim]
        cluster.procs[victim].kill()  # SIGKILL, mid-copy
        cluster.procs[victim].wait()
        cluster.start_member(0, 3, victim[1], sync=1)  # back, as a standby
        end = time.monotonic() + 30
        while Discovery(cluster.url).primary(0, time.monotonic() + 5) == old:
            assert time.monotonic() < end, "shard 0 kept its killed primary"
            time.sleep(0.1)
        tool.join(timeout=120)
        assert done, "reshard did not finish"
        (m,) = [m for m in done[0].moves if m.name == name]
        assert (m.source, m.target) == (0, 2) and m.followed
        # finished by the standby that took the lead: it dropped its copy once the
        # target held the group (it also sent log records when the kill cut the
        # copy off; a kill just after the fenced copy leaves none to send)
        assert f"deleted group {name}" in cluster.log((0, 1 - victim[1]))
        seen = acked[0]
        while acked[0] < seen + 20 and not errors:  # the target serves it
            stop.wait(0.05)
        stop.set()
        worker.join(timeout=60)
        assert not errors, errors
        state = reshard_status(cluster.url)
        assert state["state"] == "complete" and state["moving"] == {}
        assert [n for n, *_ in state["moved"]].count(name) == 1
        placement = Discovery(cluster.url).placement(time.monotonic() + 10)
        assert placement.owner(name) == 2 and placement.serving == 3
        ref = servers()
        with (
            cluster.connect(split_bytes=1 << 30) as c,
            Client(f"127.0.0.1:{ref.port}") as replay,
        ):
            for shard in (0, 1):  # no source lists it (its copy released)
                assert name not in _listed(cluster, shard)
            _big(replay, name)
            for step in range(acked[0]):
                _rows_push(replay, name, step, BIG_PUSH)
            assert c.describe_group(name).update_count == acked[0]
            for a, b in zip(
                c.pull(name, state=True), replay.pull(name, state=True), strict=True
            ):
                assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    finally:
        stop.set()
        cluster.close()


SYNC_WORKERS = 3
SYNC_SHAPE = (1024, 64)  # 256 KiB of X


def _sync_grad(worker: int, step: int) -> np.ndarray:
    """Whole numbers: their sum is exact in any order."""
    rng = np.random.default_rng([worker, step])
    return rng.integers(-4, 5, SYNC_SHAPE).astype(np.float32)


def _sync_group(c: Client, name: str) -> None:
    x = np.linspace(-1, 1, SYNC_SHAPE[0] * SYNC_SHAPE[1], dtype=np.float32)
    c.create_group(
        name,
        Adagrad(epsilon=1e-7),
        learning_rate=0.1,
        tensors={"w": x.reshape(SYNC_SHAPE)},
        consistency=Sync(workers=SYNC_WORKERS),
    )


def test_a_sync_group_is_followed_while_its_workers_push_rounds(
    tmp_path: Path, etcd_server: EtcdProcess, servers: Callable[..., Any]
) -> None:
    """A sync group (a quorum of 3 pushes per step) moved by following its log
    while its 3 workers push round after round, each waiting for its round's
    step (``return_values``). Pushes buffered on the source when it fences are
    answered MOVED and resent to the target, whose window answers them as
    buffered, and wait there for the step: after the cutover T is the rounds
    taken, no contribution is pending, and X, V, H equal a serial replay."""
    cluster = EtcdCluster(tmp_path, etcd_server)
    name = _moving_from(0, 3, "rounds")
    last = [1 << 30]  # the round the workers stop before (set after the move)
    rounds = [0] * SYNC_WORKERS
    errors: list[BaseException] = []
    moves: list[Move] = []
    try:
        cluster.start(0, 2)
        cluster.start(1, 2)
        with cluster.connect(split_bytes=1 << 30) as admin:
            _sync_group(admin, name)

        def work(w: int) -> None:
            try:
                with cluster.connect(client_id=f"w{w}", split_bytes=1 << 30) as c:
                    t = 0
                    while t < last[0]:
                        x = c.push(
                            name, _sync_grad(w, t), base_version=t, return_values=True
                        )
                        assert isinstance(x, list) and x[0].shape == SYNC_SHAPE
                        t += 1
                        rounds[w] = t
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

        workers = [
            threading.Thread(target=work, args=(w,), daemon=True)
            for w in range(SYNC_WORKERS)
        ]
        for thread in workers:
            thread.start()
        end = time.monotonic() + 30
        while min(rounds) < 10 and not errors:
            assert time.monotonic() < end, rounds
            time.sleep(0.05)
        cluster.start(2, 3)
        reshard(cluster.url, 3, progress=lambda m, done, total: moves.append(m))
        last[0] = max(rounds) + 10  # every worker reaches it: they go in step
        for thread in workers:
            thread.join(timeout=60)
        assert not errors, errors
        assert rounds == [last[0]] * SYNC_WORKERS
        (m,) = [m for m in moves if m.name == name]
        assert (m.source, m.target) == (0, 2) and m.followed
        ref = servers()
        with cluster.connect(split_bytes=1 << 30) as c:
            info = c.describe_group(name)
            assert (info.update_count, info.pending_contributions) == (last[0], 0)
            got = c.pull(name, state=True)
        replays = [
            Client(f"127.0.0.1:{ref.port}", client_id=f"w{w}")
            for w in range(SYNC_WORKERS)
        ]
        try:
            _sync_group(replays[0], name)
            for t in range(last[0]):
                for w, replay in enumerate(replays):
                    replay.push(name, _sync_grad(w, t), base_version=t)
            want = replays[0].pull(name, state=True)
            assert replays[0].describe_group(name).update_count == last[0]
        finally:
            for replay in replays:
                replay.close()
        for a, b in zip(got, want, strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        # what the target installed and applied is durable there: a restart
        # (its snapshot of the round copied, then the records it logged)
        cluster.stop(2)
        cluster.start(2, 3)
        with cluster.connect(split_bytes=1 << 30) as c:
            info = c.describe_group(name)
            assert (info.update_count, info.pending_contributions) == (last[0], 0)
            for a, b in zip(c.pull(name, state=True), want, strict=True):
                assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    finally:
        cluster.close()


def test_a_sync_round_half_pushed_moves_and_its_step_is_taken_once_on_the_target(
    tmp_path: Path, etcd_server: EtcdProcess, servers: Callable[..., Any]
) -> None:
    """Two of the three workers have pushed round 10 and wait for its step
    (``return_values``) while the group moves; the third pushes only after the
    move. The two buffered contributions move with the group (the target
    reports them pending), the waiting pushes follow MOVED to the target and get
    the step's X, and the step is taken once: X, V, H equal a serial replay."""
    cluster = EtcdCluster(tmp_path, etcd_server)
    name = _moving_from(0, 3, "half")
    hold, last = 10, 14
    go = threading.Event()
    rounds = [0] * SYNC_WORKERS
    got_x: dict[int, list[np.ndarray]] = {}
    errors: list[BaseException] = []
    try:
        cluster.start(0, 2)
        cluster.start(1, 2)
        with cluster.connect(split_bytes=1 << 30) as admin:
            _sync_group(admin, name)

        def work(w: int) -> None:
            try:
                with cluster.connect(client_id=f"w{w}", split_bytes=1 << 30) as c:
                    for t in range(last):
                        if t == hold and w == SYNC_WORKERS - 1:
                            go.wait(60)
                        x = c.push(
                            name,
                            _sync_grad(w, t),
                            base_version=t,
                            return_values=True,
                            timeout=60,
                        )
                        assert isinstance(x, list)
                        if t == hold:
                            got_x[w] = x
                        rounds[w] = t + 1
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

        workers = [
            threading.Thread(target=work, args=(w,), daemon=True)
            for w in range(SYNC_WORKERS)
        ]
        for thread in workers:
            thread.start()
        with cluster.connect(split_bytes=1 << 30) as c:
            end = time.monotonic() + 30
            while True:
                info = c.describe_group(name)
                if (info.update_count, info.pending_contributions) == (hold, 2):
                    break
                assert not errors and time.monotonic() < end, (info, errors)
                time.sleep(0.05)
            cluster.start(2, 3)
            report = reshard(cluster.url, 3)
            (m,) = [m for m in report.moves if m.name == name]
            assert (m.source, m.target) == (0, 2)
            # on the target now, the round still half pushed
            info = c.describe_group(name)
            assert (info.update_count, info.pending_contributions) == (hold, 2)
            assert rounds == [hold] * SYNC_WORKERS and not errors
            go.set()
            for thread in workers:
                thread.join(timeout=60)
            assert not errors, errors
            assert rounds == [last] * SYNC_WORKERS
            info = c.describe_group(name)
            assert (info.update_count, info.pending_contributions) == (last, 0)
            got = c.pull(name, state=True)
        ref = servers()
        replays = [
            Client(f"127.0.0.1:{ref.port}", client_id=f"w{w}")
            for w in range(SYNC_WORKERS)
        ]
        try:
            _sync_group(replays[0], name)
            for t in range(last):
                for w, replay in enumerate(replays):
                    replay.push(name, _sync_grad(w, t), base_version=t)
                if t == hold:
                    at_hold = replays[0].pull(name)
            want = replays[0].pull(name, state=True)
        finally:
            for replay in replays:
                replay.close()
        for w in range(SYNC_WORKERS):  # each got the step's X, once taken
            assert got_x[w][0].tobytes() == at_hold[0].tobytes()
        for a, b in zip(got, want, strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    finally:
        go.set()
        cluster.close()


def test_a_group_rewound_while_its_log_is_followed_moves_rewound(
    tmp_path: Path, etcd_server: EtcdProcess, servers: Callable[..., Any]
) -> None:
    """A 16 MiB group is rewound on its source while ``reshard`` copies it and
    follows its log, a worker pushing to it: the rewind's record (the group's
    whole state) is sent with the records that follow and applied on the
    target as a replay does. After the move the group is the line the worker's
    acknowledged pushes went on (the steps the rewind dropped are gone), against
    a serial replay of that line."""
    cluster = EtcdCluster(tmp_path, etcd_server)
    name = _moving_from(0, 3, "big")
    answered: list[int] = []  # the T each of the worker's pushes answered
    errors: list[BaseException] = []
    stop = threading.Event()
    done: list[Any] = []
    try:
        cluster.start(0, 2)
        cluster.start(1, 2)
        with cluster.connect(split_bytes=1 << 30) as admin:
            _big(admin, name)

        def work() -> None:
            try:
                with cluster.connect(client_id="worker", split_bytes=1 << 30) as c:
                    while not stop.is_set():
                        # 256 KiB each: a round with two of them is not the
                        # last, so the log is followed for several rounds
                        step = len(answered)
                        answered.append(_rows_push(c, name, step, BIG_PUSH))
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        while len(answered) < 20 and not errors:
            stop.wait(0.05)
        cluster.start(2, 3)
        admin = cluster.connect(split_bytes=1 << 30)
        admin.describe_group(name)  # warm: the rewind is one call
        tool = threading.Thread(
            target=lambda: done.append(reshard(cluster.url, 3)), daemon=True
        )
        tool.start()
        _wait_copy(cluster, name, tool)
        with admin:
            rewound = admin.rewind(name, to_step=5)
        assert rewound.group.update_count == 5
        tool.join(timeout=120)
        assert done, "reshard did not finish"
        seen = len(answered)
        while len(answered) < seen + 10 and not errors:  # the target serves it
            stop.wait(0.05)
        stop.set()
        worker.join(timeout=60)
        assert not errors, errors
        # the rewind was logged on the source and followed to the target: a
        # round of records as large as the group's state
        sent = [
            int(line.split("(")[1].split(" bytes")[0])
            for line in cluster.log(0).splitlines()
            if f"log records of group {name}" in line
        ]
        assert max(sent) > 2 * ROWS * COLS * 4, sent
        # the line the group is on: for each T up to the last answered, the last
        # push that answered it (the steps above 5 the rewind dropped were
        # answered again on the new line)
        line: dict[int, int] = {}
        for step, t in enumerate(answered):
            line[t] = step
        final = answered[-1]
        assert final > 6 and answered.count(6) == 2  # 6: before and after it
        ref = servers()
        with (
            cluster.connect(split_bytes=1 << 30) as c,
            Client(f"127.0.0.1:{ref.port}") as replay,
        ):
            _big(replay, name)
            for t in range(1, final + 1):
                assert _rows_push(replay, name, line[t], BIG_PUSH) == t
            assert c.describe_group(name).update_count == final
            for a, b in zip(
                c.pull(name, state=True), replay.pull(name, state=True), strict=True
            ):
                assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    finally:
        stop.set()
        cluster.close()


def test_a_group_deleted_while_its_log_is_followed_is_not_moved(
    tmp_path: Path, etcd_server: EtcdProcess
) -> None:
    """A group deleted on its source while ``reshard`` copies it: the move is
    abandoned (the target drops what it got) and the resharding goes on and
    completes; the group is nowhere, and a group made again under its name is
    placed over the new count."""
    cluster = EtcdCluster(tmp_path, etcd_server)
    name = _moving_from(0, 3, "big")
    done: list[Any] = []
    failed: list[BaseException] = []
    try:
        cluster.start(0, 2)
        cluster.start(1, 2)
        with cluster.connect(split_bytes=1 << 30) as admin:
            _big(admin, name)
            for step in range(5):
                _rows_push(admin, name, step)
        cluster.start(2, 3)
        admin = cluster.connect(split_bytes=1 << 30)
        admin.describe_group(name)  # warm: the delete is one call

        def run() -> None:
            try:
                done.append(reshard(cluster.url, 3))
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                failed.append(exc)

        tool = threading.Thread(target=run, daemon=True)
        tool.start()
        _wait_copy(cluster, name, tool)
        with admin:
            admin.delete_group(name)
        tool.join(timeout=120)
        assert not failed, failed
        assert done and name not in [m.name for m in done[0].moves]
        state = reshard_status(cluster.url)
        assert state["state"] == "complete" and state["moving"] == {}
        for shard in (0, 1, 2):
            assert name not in _listed(cluster, shard)
        with cluster.connect(split_bytes=1 << 30) as c:
            assert name not in [g.name for g in c.list_groups()]
            _big(c, name)
            assert c.describe_group(name).update_count == 0
        assert name in _listed(cluster, 2)  # placed over 3 shards
    finally:
        cluster.close()
