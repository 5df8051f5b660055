"""The transport floor under a small push's replication (issue 23), in one run.

    python benchmarks/stream_floor.py [--rounds 5] [--count 2000]

A serial ping-pong between two processes on this host, as the log shipping stream
does it for a 1,000-element push: 8 bytes one way (the standby's ack), then 4,100
bytes the other (the next record's message). Over a bidirectional gRPC stream with
grpcio's synchronous API, as ``Replicate`` uses it (the sender's messages go through
a request iterator read by gRPC's own thread, the receiver's through ``next()``),
and over a raw TCP socket (TCP_NODELAY, one thread each side). Rounds alternate
which goes first; printed: the median round trip per round, its median and min-max
over rounds. Both processes are otherwise idle: what a round trip costs in the
servers (more threads, the GIL, the fsyncs, the client) is above this floor.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

ACK = b"a" * 8
RECORD = b"x" * 4100
METHOD = "/floor.Stream/Ping"


def _grpc_server(ports: Any) -> None:
    def ping(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        for _ in requests:
            yield RECORD

    server = grpc.server(futures.ThreadPoolExecutor(4))
    handler = grpc.method_handlers_generic_handler(
        "floor.Stream", {"Ping": grpc.stream_stream_rpc_method_handler(ping)}
    )
    server.add_generic_rpc_handlers((handler,))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def _grpc_client(port: int, count: int) -> list[float]:
    out: queue.Queue[bytes | None] = queue.Queue()

    def requests() -> Iterator[bytes]:
        while (item := out.get()) is not None:
            yield item

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(METHOD)(requests())
        took = []
        for _ in range(count):
            t0 = time.perf_counter()
            out.put(ACK)
            next(call)
            took.append(time.perf_counter() - t0)
        out.put(None)
        call.cancel()
    return took


def _tcp_server(ports: Any) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    ports.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while conn.recv(len(ACK)):
        conn.sendall(RECORD)


def _tcp_client(port: int, count: int) -> list[float]:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        took = []
        for _ in range(count):
            t0 = time.perf_counter()
            s.sendall(ACK)
            got = 0
            while got < len(RECORD):
                got += len(s.recv(1 << 16))
            took.append(time.perf_counter() - t0)
    return took


Case = tuple[Callable[[Any], None], Callable[[int, int], list[float]]]
CASES: dict[str, Case] = {
    "gRPC stream (sync API)": (_grpc_server, _grpc_client),
    "raw TCP socket": (_tcp_server, _tcp_client),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--count", type=int, default=2000)
    args = ap.parse_args()
    got: dict[str, list[float]] = {name: [] for name in CASES}
    for r in range(args.rounds):
        names = list(CASES)[:: 1 if r % 2 == 0 else -1]
        for name in names:
            serve, ping = CASES[name]
            ports: Any = mp.Queue()
            server = mp.Process(target=serve, args=(ports,), daemon=True)
            server.start()
            try:
                took = ping(ports.get(timeout=60), args.count)
            finally:
                server.terminate()
                server.join()
            got[name].append(statistics.median(took[100:]))  # after a warm-up
    print(f"round trip, 8 bytes then 4,100 bytes back ({args.rounds} rounds):")
    for name, medians in got.items():
        print(
            f"  {name}: median {statistics.median(medians) * 1e6:,.0f} us (per round "
            f"{min(medians) * 1e6:,.0f}-{max(medians) * 1e6:,.0f})"
        )


if __name__ == "__main__":
    main()
