"""Live resharding (docs/resharding.md): a cluster found through etcd grows from 2 to
3 shards and shrinks back to 2 while workers push, and every acknowledged push is
applied exactly once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _etcd import EtcdProcess
from _reshard import EtcdCluster, create_groups, push
from onnxps.cli.reshard import reshard, reshard_status
from onnxps.client import Client

pytestmark = pytest.mark.slow

WORKERS = 4


class Workers:
    """``WORKERS`` threads, each with its own client, pushing to the groups it
    owns (worker w: groups w, w+4, ...) in a fixed order until stopped; what each
    push answered is kept."""

    def __init__(self, cluster: EtcdCluster, names: list[str]) -> None:
        self.cluster = cluster
        self.names = names
        self.stop = threading.Event()
        self.acked: dict[str, int] = dict.fromkeys(names, 0)
        self.errors: list[BaseException] = []
        self.steps = [0] * WORKERS
        self.threads = [
            threading.Thread(target=self._run, args=(w,), daemon=True)
            for w in range(WORKERS)
        ]

    def _run(self, w: int) -> None:
        mine = self.names[w::WORKERS]
        try:
            with self.cluster.connect(client_id=f"worker{w}") as c:
                step = 0
                while not self.stop.is_set():
                    name = mine[step % len(mine)]
                    push(c, name, w, step)
                    self.acked[name] += 1
                    step += 1
                    self.steps[w] = step
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            self.errors.append(exc)

    def __enter__(self) -> Workers:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)

    def wait_steps(self, more: int) -> None:
        start = sum(self.steps)
        end = time.monotonic() + 30
        while sum(self.steps) < start + more and time.monotonic() < end:
            assert not self.errors, self.errors
            time.sleep(0.05)


def test_grow_2_to_3_and_shrink_back_under_4_workers(
    tmp_path: Path, etcd_server: EtcdProcess, servers: Callable[..., Any]
) -> None:
    cluster = EtcdCluster(tmp_path, etcd_server)
    try:
        cluster.start(0, 2)
        cluster.start(1, 2)
        with cluster.connect() as admin:
            names = create_groups(admin, 14, 5, ids=True)
        with Workers(cluster, names) as workers:
            workers.wait_steps(100)
            cluster.start(2, 3)
            grown = reshard(cluster.url, 3)
            assert grown.from_shards == 2 and grown.to_shards == 3
            assert grown.moves, "growing to 3 shards moves some groups"
            assert all(m.target == 2 for m in grown.moves)
            workers.wait_steps(100)
            shrunk = reshard(cluster.url, 2)
            assert {m.source for m in shrunk.moves} == {2}
            workers.wait_steps(100)
        assert not workers.errors, workers.errors
        cluster.stop(2)
        state = reshard_status(cluster.url)
        assert state["state"] == "complete" and state["to"] == 2
        assert state["serving"] == 2 and state["moving"] == {}
        # every acknowledged push applied exactly once, X as a serial replay
        # the same groups and pushes, serially, on one fresh server
        handle = servers()
        with cluster.connect() as c, Client(f"127.0.0.1:{handle.port}") as ref:
            create_groups(ref, 14, 5, ids=True)
            for w in range(WORKERS):
                mine = names[w::WORKERS]
                for step in range(workers.steps[w]):
                    push(ref, mine[step % len(mine)], w, step)
            for name in names:
                info = c.describe_group(name)
                assert info.update_count == workers.acked[name], name
                if info.parts:
                    assert {p.update_count for p in info.parts} == {
                        workers.acked[name]
                    }, name
                    assert len({p.shard for p in info.parts}) == len(info.parts)
                    assert {p.shard for p in info.parts} <= {0, 1}
                if name == "emb":
                    ids = np.arange(50)
                    rows = c.pull_rows(name, {"e": ids}, state=True)
                    again = ref.pull_rows(name, {"e": ids}, state=True)
                    assert sorted(rows) == sorted(again)
                    got = [rows[k] for k in sorted(rows)]
                    want = [again[k] for k in sorted(again)]
                else:
                    got = c.pull(name, state=True)
                    want = ref.pull(name, state=True)
                for a, b in zip(got, want, strict=True):
                    assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), name
    finally:
        cluster.close()
