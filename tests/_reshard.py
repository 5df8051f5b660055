"""A cluster found through etcd whose shards are ``onnxps serve`` processes, for the
resharding tests (docs/resharding.md): start and stop a shard, connect, and the
groups and pushes the tests move under load."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from _etcd import EtcdProcess
from _procs import start_server, stop
from onnxps.client import Adagrad, Client, IdsTable, Sync

SPLIT_BYTES = 256  # a group of 128 float32 (512 bytes) is split in 2 parts


class EtcdCluster:
    """Shard servers under one etcd prefix, one member each (``--shard I/N``)."""

    def __init__(self, tmp: Path, etcd: EtcdProcess, prefix: str = "/ps") -> None:
        self.tmp = tmp
        self.url = etcd.url(prefix)
        self.procs: dict[Any, subprocess.Popen[bytes]] = {}
        self.addresses: dict[Any, str] = {}
        self.starts: dict[Any, int] = {}
        self.logs: dict[Any, Path] = {}

    def start(self, shard: int, count: int) -> str:
        return self.start_member(shard, count, 0, key=shard)

    def start_member(
        self,
        shard: int,
        count: int,
        member: int,
        sync: int = 0,
        key: Any = None,
        durability: str = "wal",
    ) -> str:
        """Member ``member`` of shard ``shard`` (``--sync-replicas sync``); kept
        under ``key`` (default ``(shard, member)``)."""
        key = (shard, member) if key is None else key
        self.starts[key] = self.starts.get(key, 0) + 1
        name = f"{shard}" if member == 0 and sync == 0 else f"{shard}-{member}"
        log = self.tmp / f"shard{name}-{self.starts[key]}.log"
        proc, address = start_server(
            log,
            "--durability", durability,
            "--data-dir", str(self.tmp / f"data{name}"),
            "--coordinator", self.url,
            "--shard", f"{shard}/{count}",
            "--member-id", f"s{name}",
            "--lease-ttl", "2",
            "--sync-replicas", str(sync),
            "--snapshot-interval", "0",
        )  # fmt: skip
        self.procs[key], self.addresses[key] = proc, address
        self.logs[key] = log
        return address

    def start_shard(
        self, shard: int, count: int, members: int = 1, sync: int = 0
    ) -> None:
        """Shard ``shard`` of ``count``: one server (``start``), or ``members``
        members with ``--sync-replicas sync``."""
        if members == 1 and sync == 0:
            self.start(shard, count)
            return
        for member in range(members):
            self.start_member(shard, count, member, sync=sync)

    def start_shards(self, count: int, members: int = 1, sync: int = 0) -> None:
        """Shards 0 to ``count - 1`` of ``count``, each as ``start_shard`` makes it."""
        for shard in range(count):
            self.start_shard(shard, count, members, sync)

    def create_groups(self, *shape: Any, **kw: Any) -> list[str]:
        """``create_groups`` through a client of the cluster; the groups' names."""
        with self.connect() as admin:
            return create_groups(admin, *shape, **kw)

    def stop(self, key: Any) -> None:
        stop(self.procs.pop(key))

    def close(self) -> None:
        for shard in list(self.procs):
            self.stop(shard)

    def connect(self, **kw: Any) -> Client:
        return Client(self.url, **{"timeout": 30, "split_bytes": SPLIT_BYTES, **kw})

    def log(self, key: Any) -> str:
        return self.logs[key].read_text()


def plain(i: int) -> tuple[str, dict[str, np.ndarray]]:
    return f"plain{i}", {"w": np.linspace(-1, 1, 8 + i, dtype=np.float32)}


def split(i: int) -> tuple[str, dict[str, np.ndarray]]:
    return f"split{i}", {
        "a": np.linspace(0, 1, 96, dtype=np.float32).reshape(8, 12),
        "b": np.linspace(1, 2, 32 + i, dtype=np.float32),
    }


def create_groups(
    c: Client, n_plain: int, n_split: int, ids: bool, sync: bool = False
) -> list[str]:
    """The groups the workers push to; their names."""
    names = []
    for i in range(n_plain):
        name, tensors = plain(i)
        c.create_group(name, Adagrad(epsilon=1e-7), learning_rate=0.1, tensors=tensors)
        names.append(name)
    for i in range(n_split):
        name, tensors = split(i)
        c.create_group(name, Adagrad(epsilon=1e-7), learning_rate=0.1, tensors=tensors)
        names.append(name)
    if sync:  # a sync group of one worker: each push is a round
        c.create_group(
            "sync0",
            Adagrad(epsilon=1e-7),
            learning_rate=0.1,
            tensors=plain(0)[1],
            consistency=Sync(workers=1),
        )
        names.append("sync0")
    if ids:
        c.create_group(
            "emb", Adagrad(epsilon=1e-7), learning_rate=0.1, tables={"e": IdsTable(4)}
        )
        names.append("emb")
    return names


def gradient(
    name: str, worker: int, step: int, shapes: dict[str, tuple[int, ...]]
) -> Any:
    """The push a worker sends at a step: a deterministic value per call."""
    rng = np.random.default_rng([worker, step, len(name)])
    if name == "emb":
        ids = rng.integers(0, 50, 6)
        return {"e": (ids, rng.standard_normal((6, 4)).astype(np.float32))}
    return [rng.standard_normal(s).astype(np.float32) for s in shapes.values()]


def shapes_of(name: str) -> dict[str, tuple[int, ...]]:
    if name == "emb":
        return {}
    kind = name.rstrip("0123456789")
    i = int(name[len(kind) :])
    tensors = split(i)[1] if kind == "split" else plain(i)[1]
    return {k: v.shape for k, v in tensors.items()}


def push(c: Client, name: str, worker: int, step: int) -> int:
    g = gradient(name, worker, step, shapes_of(name))
    if name == "emb":
        return c.push_rows(name, g).update_count
    return int(c.push(name, *g))


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


def check_against_replay(
    cluster: EtcdCluster,
    names: list[str],
    workers: Workers,
    handle: Any,
    shape: tuple[Any, ...],
    shards: int = 2,
) -> None:
    """Every acknowledged push applied exactly once: T is the pushes each group
    acknowledged, on every part, and X, V, H equal those of the same pushes
    replayed serially on one fresh server (``handle``); the groups
    ``create_groups(*shape)`` made; a split group's parts on distinct shards
    below ``shards``."""
    with cluster.connect() as c, Client(f"127.0.0.1:{handle.port}") as ref:
        create_groups(ref, *shape)
        for w in range(WORKERS):
            mine = names[w::WORKERS]
            for step in range(workers.steps[w]):
                push(ref, mine[step % len(mine)], w, step)
        for name in names:
            info = c.describe_group(name)
            assert info.update_count == workers.acked[name], name
            if info.parts:
                assert {p.update_count for p in info.parts} == {workers.acked[name]}, (
                    name
                )
                assert len({p.shard for p in info.parts}) == len(info.parts)
                assert {p.shard for p in info.parts} <= set(range(shards))
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
