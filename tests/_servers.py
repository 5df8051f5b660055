"""Helpers that several test modules share around a real server: a local reference of
an optimizer (``LocalGroup``, ``assert_bit_identical``), a server process killed and
restarted (``Server``), an in-process crash (``_crash``), a proxy that drops replies
(``ReplyDropProxy``), an error's rich details (``details``), a small tmpfs (``_tmpfs``,
``_fill``) and an ``AsyncClient`` seen as a ``Client`` (``_Awaiting``). Moved here from
the test modules that defined them, so that no test module imports another."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from onnxps.client import (
    Adagrad,
    Adam,
    Client,
    Momentum,
    Nesterov,
    OptimizerSpec,
    PushResult,
)
from onnxps.server.app import ServerHandle
from onnxps.server.kernels import apply_onnx

# Non-default attributes for every operator (and both Momentum modes).
OPTIMIZERS: dict[str, tuple[str, OptimizerSpec]] = {
    "adagrad": (
        "Adagrad",
        Adagrad(epsilon=1e-4, decay_factor=0.05, norm_coefficient=0.01),
    ),
    "momentum": ("Momentum", Momentum(0.85, 0.3, "standard", 0.02)),
    "nesterov": ("Momentum", Nesterov(0.8, 0.6, 0.015)),
    "adam": (
        "Adam",
        Adam(
            alpha=0.8,
            beta=0.95,
            epsilon=1e-5,
            norm_coefficient=0.01,
            norm_coefficient_post=0.002,
        ),
    ),
}


class LocalGroup:
    """The same group kept locally: one ``apply_onnx`` per push, outputs fed back."""

    def __init__(
        self, op: str, spec: OptimizerSpec, lr: float, tensors: list[Array]
    ) -> None:
        self.op, self.attrs, self.lr, self.t = op, onnx_attrs(spec), lr, 0
        self.xs = [t.copy() for t in tensors]
        n = len(tensors)  # state in ONNX order: V_1..V_n, then H_1..H_n
        self.states = [np.zeros_like(tensors[i % n]) for i in range(n * STATES[op])]

    def push(self, grads: list[Array], lr: float | None = None) -> None:
        r = np.float64(self.lr if lr is None else lr)  # R travels as a double
        outs = apply_onnx(
            self.op, self.attrs, [r, np.int64(self.t), *self.xs, *grads, *self.states]
        )
        n = len(self.xs)
        self.xs, self.states = outs[:n], outs[n:]
        self.t += 1

    def state(self) -> list[Array]:
        return self.xs + self.states


def assert_bit_identical(got: list[Array], expected: list[Array]) -> None:
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.dtype == e.dtype, (i, g.dtype, e.dtype)
        assert g.shape == e.shape, (i, g.shape, e.shape)
        assert g.tobytes() == e.tobytes(), (i, g, e)


class _Awaiting:
    """A Client awaited like an AsyncClient: one sequence runs on both clients."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        fn = getattr(self._client, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        return call


def _flat(value: Any) -> Any:
    """Results as comparable values: arrays by dtype, shape and bytes."""
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (list, tuple)):
        return [_flat(v) for v in value]
    if isinstance(value, PushResult):
        return [value.update_count, value.applied, value.duplicate, _flat(value.values)]
    return value


def _crash(handle: ServerHandle) -> None:
    """Stop serving without the shutdown snapshot; the log keeps what was fsynced."""
    handle.server.stop(0).wait()
    d = handle.durability
    assert d is not None
    if d.journal is not None:
        d.journal.close()
    handle.store.close()
    os.close(d._lock_fd)
    d._lock_fd = -1
    handle._stopped.set()


class ReplyDropProxy:
    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.armed = threading.Event()
        self.dropped = 0
        self.connections = 0
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                down, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            up = socket.create_connection(self._target)
            pair = (down, up)
            with self._lock:
                self.connections += 1
                self._sockets += pair
                pumps = [
                    threading.Thread(target=self._forward, args=pair, daemon=True),
                    threading.Thread(target=self._replies, args=pair, daemon=True),
                ]
                self._threads += pumps
            for t in pumps:
                t.start()

    def _forward(self, down: socket.socket, up: socket.socket) -> None:
        try:
            while data := down.recv(65536):
                up.sendall(data)
        except OSError:
            pass
        self._cut(down, up)

    def _replies(self, down: socket.socket, up: socket.socket) -> None:
        """Forward the server's frames whole, so a reply can be cut at its start."""
        buf = b""
        try:
            while data := up.recv(65536):
                buf += data
                while len(buf) >= 9:
                    size = 9 + int.from_bytes(buf[:3], "big")
                    if len(buf) < size:
                        break
                    if buf[3] == _HEADERS and self.armed.is_set():
                        self.armed.clear()
                        with self._lock:
                            self.dropped += 1
                        self._cut(down, up)
                        return
                    down.sendall(buf[:size])
                    buf = buf[size:]
        except OSError:
            pass
        self._cut(down, up)

    @staticmethod
    def _cut(*socks: socket.socket) -> None:
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._closing.set()
        self._listener.close()
        with self._lock:
            socks, threads = list(self._sockets), list(self._threads)
        self._cut(*socks)
        for t in threads:
            t.join(timeout=5)
        for s in socks:
            s.close()


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


@contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root needed): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(path: Path) -> int:
    """Fill the filesystem of ``path`` with a file; the bytes written."""
    written = 0
    with open(path, "wb", buffering=0) as f:
        for _ in range(1 << 20):  # bounded: a 4 GiB disk at most
            try:
                written += f.write(b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                return written
    raise AssertionError("the disk never filled")


class Server:
    def __init__(self, data_dir: Path, mode: str, interval: float = 0, fsize: int = 0):
        self.stderr = open(data_dir.parent / f"{data_dir.name}.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SERVER,
                mode,
                str(data_dir),
                str(interval),
                str(fsize),
            ],
            stdout=subprocess.PIPE,
            stderr=self.stderr,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"server did not start: see {self.stderr.name}"
        self.address = f"127.0.0.1:{int(line)}"

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.close()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
        self.close()

    def close(self) -> None:
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self.stderr.close()


Array = np.ndarray[Any, Any]


STATES = {"Adagrad": 1, "Momentum": 1, "Adam": 2}


def onnx_attrs(spec: OptimizerSpec) -> dict[str, Any]:
    return {k: v for k, v in asdict(spec).items() if v is not None}


_HEADERS = 0x1


SERVER = r"""
import logging, resource, signal, sys, threading
from onnxps.server.app import ServerConfig, create_server

mode, data_dir, interval, fsize = sys.argv[1:]
interval, fsize = float(interval), int(fsize)
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
if fsize:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, hard))
    # SIGUSR1: the operator made room (the soft limit goes back up)
    signal.signal(signal.SIGUSR1, lambda *a: resource.setrlimit(
        resource.RLIMIT_FSIZE, (hard, hard)))
config = ServerConfig(
    address="127.0.0.1:0", durability=mode, data_dir=data_dir,
    snapshot_interval=interval, threads=16,
)
handle = create_server(config).start()
print(handle.port, flush=True)
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: done.set())
done.wait()
handle.stop(grace=1)
"""
