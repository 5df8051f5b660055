"""What a small push would cost off gRPC: a measurement for a design decision.

    python benchmarks/socket_path.py [--rounds 5] [--seconds 3] [--workers 4]

The measurement that led to frame calls (``Client(frames="on")``,
``benchmarks/frames.py`` measures those). A server process runs a real onnxps
server and, beside it, a plain TCP listener with one thread per connection that reads a
length-prefixed ``PushRequest``, runs it through the server's own Push handler (the
interceptor chain and the servicer, as ``call_anatomy.py --sections inprocess``
calls it, with a stand-in for grpc's per-call context: it reads grpc's private
server state to find the handler) and writes the length-prefixed reply. So each push
runs all of onnxps's Python and none of grpc's hand-offs between threads.

- ``cpu``: ``--workers`` client processes push a 1,000-element float32 Adam
  gradient (a new seq each) as fast as they can over that socket, over gRPC to
  ``onnxps serve``, and to the raw grpcio floor (``small_calls.py``), rounds
  alternating: the server process's CPU per call and calls per second.
- ``latency``: one client, one push at a time: the p50 of each.

What the figures say is how much of the gap to the floor a frame protocol beside
gRPC (on the data channel's socket, say) would remove; it would still need
everything a transport needs (TLS, tokens, deadlines, statuses, resends).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from call_anatomy import _Context
from onnxps.cli.process import start_server_process, stop_processes
from onnxps.client import Adam, Client
from small_calls import (
    SMALL,
    _load_calls,
    _onnxps_worker,
    _raw_worker,
    _start_raw,
)

_LEN = struct.Struct("<I")
_METHOD = "/onnxps.v1.ParameterServerService/Push"


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            return None
        got += k
    return bytes(buf)


def socket_server(port_file: str) -> None:
    """A real onnxps server, and its Push handler served per frame on a socket."""
    import grpc
    from onnxps.server.app import ServerConfig, create_server

    handle = create_server(ServerConfig(address="127.0.0.1:0", durability="none"))
    handle.server.start()
    with Client(handle.address) as c:
        x0 = np.linspace(-1, 1, SMALL, dtype=np.float32)
        c.create_group("small", Adam(), learning_rate=1e-3, tensors={"w": x0})
    state: Any = handle.server._state  # type: ignore[attr-defined]
    base = state.registered_method_handlers[_METHOD]
    chain = state.interceptor_pipeline.interceptors[0]
    details = grpc._server._HandlerCallDetails(_METHOD, ())  # type: ignore[attr-defined]

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while (head := _recv_exact(conn, 4)) is not None:
                raw = _recv_exact(conn, _LEN.unpack(head)[0])
                if raw is None:
                    return
                handler = chain.intercept_service(lambda d: base, details)
                reply = handler.unary_unary(
                    handler.request_deserializer(raw), _Context(())
                )
                out = handler.response_serializer(reply)
                conn.sendall(_LEN.pack(len(out)) + out)

    listener = socket.create_server(("127.0.0.1", 0))
    Path(port_file).write_text(str(listener.getsockname()[1]))
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _socket_pusher(port: int) -> Any:
    """A push function over the socket (its own client id, seqs from 1)."""
    from onnxps.v1 import parameter_server_pb2 as pb
    from onnxps.wire.codec import EncodedMessage

    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    g = np.full(SMALL, 1e-3, np.float32)
    client_id = f"socket-{time.monotonic_ns()}"
    seq = iter(range(1, 1 << 62))

    def push() -> bytes:
        req = pb.PushRequest(group="small", client_id=client_id, seq=next(seq))
        raw = EncodedMessage(req, "gradients", [g]).SerializeToString()
        sock.sendall(_LEN.pack(len(raw)) + raw)
        head = _recv_exact(sock, 4)
        assert head is not None, "the server closed the socket"
        reply = _recv_exact(sock, _LEN.unpack(head)[0])
        assert reply is not None
        return reply

    return push


def _socket_worker(port: int, seconds: float, out: Any) -> None:
    push = _socket_pusher(port)
    push()
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        push()
        n += 1
    out.put(n)


def _start_socket(tmp: Path) -> tuple[Any, int]:
    ctx = mp.get_context("spawn")
    port_file = tmp / "socket.port"
    proc = ctx.Process(target=socket_server, args=(str(port_file),), daemon=True)
    proc.start()
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline or not proc.is_alive():
            raise RuntimeError("the socket server did not start")
        time.sleep(0.05)
    return proc, int(port_file.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--pushes", type=int, default=2000, help="per latency round")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        sock_proc, sock_port = _start_socket(tmp)
        raw, raw_port = _start_raw(tmp, "socket-path")
        proc, address = start_server_process(log=tmp / "onnxps.log")
        try:
            with Client(address) as c:
                x0 = np.linspace(-1, 1, SMALL, dtype=np.float32)
                c.create_group("small", Adam(), learning_rate=1e-3, tensors={"w": x0})
            ways = [
                (
                    "onnxps Push, frames on a socket",
                    _socket_worker,
                    sock_port,
                    sock_proc,
                ),
                ("onnxps over gRPC", _onnxps_worker, address, proc),
                ("raw gRPC floor", _raw_worker, raw_port, raw),
            ]
            _cpu(args, ways)
            _latency(args, sock_port, address, raw_port)
        finally:
            stop_processes([proc])
            raw.kill()
            sock_proc.kill()


def _cpu(args: argparse.Namespace, ways: list[tuple[str, Any, Any, Any]]) -> None:
    figs: dict[str, list[tuple[float, float]]] = {name: [] for name, *_ in ways}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, worker, target, proc in ways[:: 1 if r % 2 else -1]:
            us, rate, _ = _load_calls(
                worker, target, proc.pid, args.workers, args.seconds
            )
            if r:
                figs[name].append((us, rate))
    floor = [us for us, _ in figs["raw gRPC floor"]]
    print(f"\nserver CPU per {SMALL:,}-element Adam push, {args.workers} clients")
    for name, rows in figs.items():
        us = [u for u, _ in rows]
        rate = statistics.median(q for _, q in rows)
        ratio = [u / f for u, f in zip(us, floor, strict=True)]
        print(
            f"  {name:34s} {statistics.median(us):5.0f} us "
            f"({min(us):.0f}-{max(us):.0f})  {rate:6.0f} calls/s  "
            f"floor x {statistics.median(ratio):.2f} "
            f"({min(ratio):.2f}-{max(ratio):.2f})"
        )


def _latency(
    args: argparse.Namespace, sock_port: int, address: str, raw_port: int
) -> None:
    import grpc
    from small_calls import _RAW_OPTIONS

    g = np.full(SMALL, 1e-3, np.float32)
    socket_push = _socket_pusher(sock_port)
    channel = grpc.insecure_channel(f"127.0.0.1:{raw_port}", _RAW_OPTIONS)
    raw_push, g_bytes = channel.unary_unary("/raw.Raw/Push"), g.tobytes()
    p50s: dict[str, list[float]] = {}
    with Client(address, shared_memory="off", data_channel="off") as c:
        ways = [
            ("onnxps Push, frames on a socket", socket_push),
            ("onnxps over gRPC", lambda: c.push("small", g)),
            ("raw gRPC floor", lambda: raw_push(g_bytes, timeout=60)),
        ]
        for r in range(args.rounds + 1):
            for name, push in ways[:: 1 if r % 2 else -1]:
                times = []
                for _ in range(args.pushes):
                    t0 = time.perf_counter()
                    push()
                    times.append(time.perf_counter() - t0)
                if r:
                    p50s.setdefault(name, []).append(statistics.median(times) * 1e6)
    channel.close()
    print(f"\none client, one {SMALL:,}-element push at a time: p50 us")
    for name, values in p50s.items():
        print(
            f"  {name:34s} {statistics.median(values):5.0f} "
            f"({min(values):.0f}-{max(values):.0f})"
        )


if __name__ == "__main__":
    main()
