"""Transport benchmark: small round trips and large streamed vs unary steps.

    python benchmarks/transport.py [--quick]

The server runs as a separate process (``onnxps serve --durability none`` on a free
loopback port). Each table's first row is what a user gets: ``Client(address)`` against
``onnxps serve`` with no flags (a server of its own, its defaults). Figures, each beside
a baseline measured in the same run:

- push + pull round trip on a 1,000-element float32 group, 1 and 8 concurrent
  clients (threads in this process, and separate processes): p50/p99 latency and
  pushes/s; baseline: an empty gRPC call (health Check) on the same server.
- one push + pull step of a 64 MiB float32 group through the chunked streams
  (transport="stream") beside the same step as single unary messages
  (transport="unary"); GB/s counts the bytes moved (64 MiB each way); baselines:
  the server's optimizer step on that group in this process (no transport), and the
  same bytes as plain gRPC messages without protobuf (the transport's floor).

The machine may be shared: read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnxps.cli.process import (
    start_default_server,
    start_server_process,
    stop_processes,
)
from onnxps.client import Adagrad, Adam, Client
from onnxps.server.kernels import Stepper, make_attrs
from onnxps.wire.codec import CHUNK_BYTES

MIB = 1 << 20
SMALL = 1000
LARGE = 16 * MIB  # float32 elements: 64 MiB


class ServerProcess:
    """``onnxps serve`` on a free loopback port, in a child process: with no other
    flag (``defaults``: what a user gets), or ``--durability none``."""

    def __init__(self, defaults: bool = False) -> None:
        self._dir = tempfile.TemporaryDirectory()  # noqa: SIM115
        here = Path(self._dir.name)
        if defaults:
            self.proc, self.address = start_default_server(here, log=here / "s.log")
        else:
            self.proc, self.address = start_server_process(log=here / "s.log")

    def peak_rss(self) -> int:
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        found = re.search(r"^VmHWM:\s+(\d+) kB$", text, re.MULTILINE)
        return int(found.group(1)) * 1024 if found else 0

    def stop(self) -> None:
        stop_processes([self.proc], timeout=60)  # with defaults: a snapshot
        self._dir.cleanup()


# -- small round trips -----------------------------------------------------------------


def _round_trips(
    address: str,
    group: str,
    n: int,
    warmup: int,
    one_call: bool = False,
    defaults: bool = False,
) -> list[float]:
    grad = np.full(SMALL, 1e-3, np.float32)
    out = []
    options: dict[str, Any] = {} if defaults else {"transport": "unary"}
    with Client(address, timeout=30, **options) as c:
        c.describe_group(group)  # opens the channel, learns the size
        for i in range(warmup + n):
            t0 = time.perf_counter()
            if one_call:
                c.push(group, grad, return_values=True)
            else:
                c.push(group, grad)
                c.pull(group)
            if i >= warmup:
                out.append(time.perf_counter() - t0)
    return out


def _empty_calls(address: str, n: int, warmup: int) -> list[float]:
    out = []
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        req = health_pb2.HealthCheckRequest()
        for i in range(warmup + n):
            t0 = time.perf_counter()
            stub.Check(req, timeout=30)
            if i >= warmup:
                out.append(time.perf_counter() - t0)
    return out


def _process_worker(address: str, group: str, n: int, warmup: int, q: Any) -> None:
    q.put(_round_trips(address, group, n, warmup))


def _concurrent(
    clients: int, mode: str, fn: Callable[[], list[float]], args: tuple[Any, ...]
) -> tuple[list[float], float]:
    """Latencies of every client, and the wall time of the whole run."""
    if mode == "threads":
        results: list[list[float]] = [[] for _ in range(clients)]

        def run(i: int) -> None:
            results[i] = fn()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [x for r in results for x in r], time.perf_counter() - t0
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_process_worker, args=(*args, q)) for _ in range(clients)
    ]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    lat = [x for _ in procs for x in q.get(timeout=300)]
    for p in procs:
        p.join()
    # the wall time includes process start-up: report throughput from latencies too
    return lat, time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def small_section(address: str, quick: bool, default: str) -> list[list[str]]:
    n, warmup = (300, 30) if quick else (1500, 100)
    rows = []
    with Client(default, timeout=30) as c:
        c.create_group(
            "small", Adam(), learning_rate=1e-3, tensors={"w": np.zeros(SMALL, "f4")}
        )
    lat = _round_trips(default, "small", n, warmup, defaults=True)
    rows.append(
        [
            "no flags: push + pull, 1,000 float32",
            "1 thread",
            f"{_pct(lat, 50) * 1e3:.3f}",
            f"{_pct(lat, 99) * 1e3:.3f}",
            f"{1 / statistics.mean(lat):,.0f} pushes/s",
        ]
    )
    base = _empty_calls(address, n, warmup)
    rows.append(
        [
            "baseline: empty gRPC call",
            "1 thread",
            f"{_pct(base, 50) * 1e3:.3f}",
            f"{_pct(base, 99) * 1e3:.3f}",
            f"{1 / statistics.mean(base):,.0f} calls/s",
        ]
    )
    with Client(address, timeout=30) as c:
        c.create_group(
            "small",
            Adam(),
            learning_rate=1e-3,
            tensors={"w": np.zeros(SMALL, np.float32)},
        )
    for clients, mode in ((1, "threads"), (8, "threads"), (8, "processes")):
        per = n if clients == 1 else max(50, n // 4)
        args = (address, "small", per, warmup)
        lat, wall = _concurrent(clients, mode, lambda a=args: _round_trips(*a), args)
        # pushes/s: every client keeps one round trip in flight
        rate = clients / statistics.mean(lat)
        rows.append(
            [
                "push + pull, 1,000 float32",
                f"{clients} {mode if clients > 1 else 'thread'}",
                f"{_pct(lat, 50) * 1e3:.3f}",
                f"{_pct(lat, 99) * 1e3:.3f}",
                f"{rate:,.0f} pushes/s",
            ]
        )
    lat = _round_trips(address, "small", n, warmup, one_call=True)
    rows.append(
        [
            "push returning X (one call)",
            "1 thread",
            f"{_pct(lat, 50) * 1e3:.3f}",
            f"{_pct(lat, 99) * 1e3:.3f}",
            f"{1 / statistics.mean(lat):,.0f} pushes/s",
        ]
    )
    return rows


# -- large steps -----------------------------------------------------------------------


def _raw_server(chunk: int, q: Any) -> None:
    """A gRPC server that moves plain bytes (no protobuf): the transport's floor."""
    from concurrent import futures

    def up(it: Any, ctx: Any) -> bytes:
        return sum(len(b) for b in it).to_bytes(8, "little")

    def down(req: bytes, ctx: Any) -> Any:
        n = int.from_bytes(req, "little")
        x = np.ones(n // 4, np.float32)
        view = memoryview(x).cast("B")
        for start in range(0, n, chunk):
            yield bytes(view[start : start + chunk])

    handler = grpc.method_handlers_generic_handler(
        "raw.Raw",
        {
            "Up": grpc.stream_unary_rpc_method_handler(up),
            "Down": grpc.unary_stream_rpc_method_handler(down),
            "UpOne": grpc.unary_unary_rpc_method_handler(
                lambda b, ctx: len(b).to_bytes(8, "little")
            ),
            "DownOne": grpc.unary_unary_rpc_method_handler(
                lambda b, ctx: bytes(int.from_bytes(b, "little"))
            ),
        },
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(8), handlers=[handler], options=_UNLIMITED
    )
    q.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


_UNLIMITED = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
]


def raw_grpc_step(nbytes: int, chunk: int, repeats: int) -> tuple[float, float]:
    """Median times to move ``nbytes`` up and back down as plain bytes: in chunks
    through streams, and as one unary message each way."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_raw_server, args=(chunk, q), daemon=True)
    proc.start()
    try:
        port = q.get(timeout=60)
        x = np.ones(nbytes // 4, np.float32)
        view = memoryview(x).cast("B")
        size = nbytes.to_bytes(8, "little")
        with grpc.insecure_channel(f"127.0.0.1:{port}", _UNLIMITED) as channel:
            up = channel.stream_unary("/raw.Raw/Up")
            down = channel.unary_stream("/raw.Raw/Down")
            up_one = channel.unary_unary("/raw.Raw/UpOne")
            down_one = channel.unary_unary("/raw.Raw/DownOne")
            streamed, unary = [], []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                up(bytes(view[s : s + chunk]) for s in range(0, nbytes, chunk))
                for _ in down(size):
                    pass
                t1 = time.perf_counter()
                up_one(x.tobytes())
                down_one(size)
                t2 = time.perf_counter()
                streamed.append(t1 - t0)
                unary.append(t2 - t1)
        return statistics.median(streamed[1:]), statistics.median(unary[1:])
    finally:
        proc.terminate()
        proc.join()


def _steps(
    address: str, name: str, x0: Any, grad: Any, repeats: int, **options: Any
) -> float:
    """The median push + pull of a new Adagrad group (the first left out: it opens
    the channel)."""
    with Client(address, timeout=300, **options) as c:
        c.create_group(name, Adagrad(), learning_rate=0.01, tensors={"x": x0})
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            c.push(name, grad)
            (pulled,) = c.pull(name)
            times.append(time.perf_counter() - t0)
        assert pulled.shape == x0.shape
        c.delete_group(name)
    return statistics.median(times[1:])


def large_section(address: str, quick: bool, default: str) -> list[list[str]]:
    repeats = 3 if quick else 6
    x0 = np.linspace(-1, 1, LARGE, dtype=np.float32)
    grad = np.full(LARGE, 1e-3, np.float32)
    moved = 2 * x0.nbytes
    step = _steps(default, "big-default", x0, grad, repeats)
    rows = [
        [
            "no flags: push + pull 64 MiB",
            "no flags",
            f"{step * 1e3:.1f}",
            f"{moved / step / 1e9:.2f}",
        ]
    ]
    stepper = Stepper(make_attrs("Adagrad", {}), np.float32, [LARGE])
    x, h = x0.copy(), np.zeros_like(x0)
    local = []
    for t in range(repeats):
        t0 = time.perf_counter()
        stepper.step(0.01, t, [x], [grad], None, [h])
        local.append(time.perf_counter() - t0)
    best_local = statistics.median(local)
    rows.append(
        [
            "baseline: optimizer step in-process",
            "-",
            f"{best_local * 1e3:.1f}",
            "-",
        ]
    )
    floors = raw_grpc_step(moved // 2, CHUNK_BYTES, repeats)
    for kind, floor in zip(("stream", "unary"), floors, strict=True):
        rows.append(
            [
                f"baseline: raw gRPC bytes, {kind}",
                f"{kind}, no protobuf",
                f"{floor * 1e3:.1f}",
                f"{moved / floor / 1e9:.2f}",
            ]
        )
    for transport in ("stream", "unary"):
        step = _steps(
            address, f"big-{transport}", x0, grad, repeats, transport=transport
        )
        rows.append(
            [
                f"push + pull 64 MiB, {transport}",
                f"{transport}",
                f"{step * 1e3:.1f}",
                f"{moved / step / 1e9:.2f}",
            ]
        )
    return rows


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)), line]
    for r in rows:
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    default = ServerProcess(defaults=True)
    server = ServerProcess()
    try:
        small = small_section(server.address, args.quick, default.address)
        large = large_section(server.address, args.quick, default.address)
        peak = server.peak_rss()
    finally:
        server.stop()
        default.stop()
    print(
        _table(["small round trip", "clients", "p50 ms", "p99 ms", "throughput"], small)
    )
    print()
    print(_table(["large step", "transport", "median ms", "GB/s"], large))
    s = {r[1]: float(r[2]) for r in large[2:]}
    print()
    print(
        f"streamed step: {s['unary'] / s['stream']:.2f}x the speed of unary, "
        f"{s['stream, no protobuf'] / s['stream']:.2f}x the raw gRPC stream; unary "
        f"step: {s['unary, no protobuf'] / s['unary']:.2f}x raw gRPC unary; "
        f"round trip p50 is {float(small[2][2]) / float(small[1][2]):.1f}x an empty "
        f"call; server peak RSS {peak / MIB:.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
