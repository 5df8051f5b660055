"""``Replicas``: a ``ReplicaSet`` whose members differ (their own flags, env, etcd
address) and clients with TLS settings; its fixture ``replica_sets`` is in
tests/conftest.py. Moved here from test_replication_safety.py (with ``G``, ``_create``
and ``_raw_push``) so that no test module imports another."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from _etcd import EtcdProcess
from _procs import clean_env
from _replicas import SIZE, TTL, ReplicaSet
from onnxps.cli.process import wait_for_listening
from onnxps.client import Adagrad, Client

G = np.full(SIZE, 0.5, np.float32)


class Replicas(ReplicaSet):
    """A ``ReplicaSet`` whose members may differ: their own flags, the group their
    process runs with, the etcd address they use; clients with TLS settings."""

    def __init__(
        self,
        tmp: Path,
        etcd: EtcdProcess,
        n: int,
        *,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        ttl: int = TTL,
        client: dict[str, Any] | None = None,
    ) -> None:
        self.ttl = ttl
        self.member_extra: dict[int, tuple[str, ...]] = {}
        self.gids: dict[int, int] = {}
        self.coordinators: dict[int, str] = {}
        self.client = client or {}
        super().__init__(tmp, etcd, n, "ps", extra, env)

    def start(self, i: int) -> None:
        self.starts[i] = self.starts.get(i, 0) + 1
        log = self.tmp / f"server{i}-{self.starts[i]}.log"
        cmd = [
            sys.executable, "-m", "onnxps.cli", "serve",
            "--address", "127.0.0.1:0",
            "--durability", "wal",
            "--data-dir", str(self.tmp / f"data{i}"),
            "--coordinator", self.coordinators.get(i, self.url),
            "--shard", "0/1",
            "--member-id", f"m{i}",
            "--lease-ttl", str(self.ttl),
            "--snapshot-interval", "0",
            *self.extra,
            *self.member_extra.get(i, ()),
        ]  # fmt: skip
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=clean_env(**self.env),
                group=self.gids.get(i),
            )
        self.procs[i] = proc
        self.addresses[i] = wait_for_listening(proc, log)

    def connect(self, i: int | None = None, **kw: Any) -> Client:
        target = self.url if i is None else self.addresses[i]
        return Client(target, **{"timeout": 30, **self.client, **kw})

    def state(self, i: int, group: str) -> tuple[int, np.ndarray]:
        with self.connect(i) as c:
            return c.describe_group(group).update_count, c.pull(group)[0]

    def create_group(self) -> None:
        _create(self)

    def log(self, i: int) -> str:
        return (self.tmp / f"server{i}-{self.starts[i]}.log").read_text()

    def wait_log(self, i: int, text: str, timeout: float = 60.0) -> str:
        """The first line of member ``i``'s log holding ``text`` (waits for it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log(i).splitlines():
                if text in line:
                    return line
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} in server {i}'s log:\n{self.log(i)[-3000:]}")


def _raw_push(
    address: str, seq: int, timeout: float, g: np.ndarray = G
) -> tuple[grpc.StatusCode, str, Any]:
    """One Push call, no client retries: (status, details, reply)."""
    from onnxps.v1 import parameter_server_pb2 as pb
    from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

    tensor = pb.Tensor(
        name="x", dtype=pb.DATA_TYPE_FLOAT, dims=[g.size], raw_data=g.tobytes()
    )
    request = pb.PushRequest(group="g", gradients=[tensor], client_id="raw", seq=seq)
    with grpc.insecure_channel(address) as ch:
        try:
            reply = pb_grpc.ParameterServerServiceStub(ch).Push(
                request, timeout=timeout
            )
        except grpc.RpcError as exc:
            return exc.code(), str(exc.details()), None
    return grpc.StatusCode.OK, "", reply


def _create(rs: Replicas) -> None:
    with rs.connect(timeout=60) as c:
        c.create_group(
            "g", Adagrad(), learning_rate=0.1, tensors={"x": np.zeros(SIZE, np.float32)}
        )
