"""What the security, limits and observability interceptors cost per call.

    python benchmarks/interceptors.py [--calls N] [--rounds R]

Three in-process servers on loopback, same servicer and store code:

- bare (the named baseline): the servicer with no interceptors at all;
- default: request ids, logs, limits (what every server now runs);
- full: default plus token auth and Prometheus metrics.

Each row times N small unary pushes (Adagrad, 1,000 float32) and N pulls from one
client, interleaving the servers round by round so that load from other processes on a
shared machine falls on all of them alike. Read the ratios to bare, not the absolute
figures.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from onnxps.client import Adagrad, Client
from onnxps.server.app import ServerConfig, create_server
from onnxps.server.rpc.service import ParameterServerServicer
from onnxps.server.store import ParameterStore
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

TOKEN = "bench-token-0123456789"


class Bare:
    def __init__(self) -> None:
        self.store = ParameterStore()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_ParameterServerServiceServicer_to_server(
            ParameterServerServicer(self.store), self.server
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.store.start()
        self.address = f"127.0.0.1:{self.port}"

    def stop(self, grace: float = 0) -> None:
        self.server.stop(grace).wait()
        self.store.close()


def _time(client: Client, calls: int, grad: np.ndarray) -> tuple[float, float]:
    start = time.perf_counter()
    for _ in range(calls):
        client.push("g", grad)
    push = (time.perf_counter() - start) / calls
    start = time.perf_counter()
    for _ in range(calls):
        client.pull("g")
    pull = (time.perf_counter() - start) / calls
    return push, pull


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    tokens = Path(tmp.name) / "tokens.txt"
    tokens.write_text(f"{TOKEN} admin *\n")
    servers: dict[str, Any] = {
        "bare": Bare(),
        "default": create_server(
            ServerConfig(address="127.0.0.1:0", durability="none")
        ).start(),
        "full": create_server(
            ServerConfig(
                address="127.0.0.1:0",
                durability="none",
                tokens_file=str(tokens),
                metrics_port=0,
            )
        ).start(),
    }
    clients = {
        name: Client(s.address, token=TOKEN if name == "full" else None, timeout=30)
        for name, s in servers.items()
    }
    grad = np.full(1000, 1e-3, np.float32)
    results: dict[str, list[tuple[float, float]]] = {n: [] for n in servers}
    try:
        for c in clients.values():
            c.create_group(
                "g", Adagrad(), learning_rate=0.1, tensors={"w": np.zeros(1000)}
            )
            c.push("g", grad.astype(np.float64))  # warm up
        grad = grad.astype(np.float64)
        for _ in range(args.rounds):
            for name, c in clients.items():
                results[name].append(_time(c, args.calls, grad))
    finally:
        for c in clients.values():
            c.close()
        for s in servers.values():
            s.stop(0)
        tmp.cleanup()
    base_push = statistics.median(r[0] for r in results["bare"])
    base_pull = statistics.median(r[1] for r in results["bare"])
    print(
        f"{args.rounds} rounds x {args.calls} calls each, median per call "
        "(1,000-element float64 Adagrad group, unary)"
    )
    print(f"{'server':<10}{'push us':>10}{'vs bare':>9}{'pull us':>10}{'vs bare':>9}")
    for name, rows in results.items():
        push = statistics.median(r[0] for r in rows)
        pull = statistics.median(r[1] for r in rows)
        print(
            f"{name:<10}{push * 1e6:>10.0f}{push / base_push:>9.2f}"
            f"{pull * 1e6:>10.0f}{pull / base_pull:>9.2f}"
        )


if __name__ == "__main__":
    main()
