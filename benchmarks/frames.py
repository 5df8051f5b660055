"""Small calls as frames (``Client(frames="on")``) against gRPC and the raw floor.

    python benchmarks/frames.py [--rounds 5] [--seconds 3] [--workers 4] [--pushes 1500]

One ``onnxps serve --data-port 0`` serves both ways, so only the client's choice
differs. The first row (``no flags``) is ``Client(address)`` against ``onnxps
serve`` with no flags (its defaults, a server of its own): what a user gets. Rounds
alternate.

- ``cpu``: ``--workers`` client processes push a 1,000-element float32 Adam gradient
  as fast as they can, with ``frames="on"`` and with every call over gRPC, and to
  the raw grpcio floor (``small_calls.py``: the same step, bytes in and out): the
  server's CPU per call, calls per second, and each against the floor.
- ``latency``: one client, one push returning X at a time: the p50 of each way.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from onnxps.cli.process import (
    start_default_server,
    start_server_process,
    stop_processes,
)
from onnxps.client import Adam, Client
from small_calls import (
    GRPC_ONLY,
    SMALL,
    _load_calls,
    _onnxps_worker,
    _raw_worker,
    _start_raw,
)


def _frames_worker(address: str, seconds: float, out: Any) -> None:
    g = np.full(SMALL, 1e-3, np.float32)
    with Client(address, shared_memory="off", data_channel="off", frames="on") as c:
        c.push("small", g)
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            c.push("small", g)
            n += 1
    out.put(n)


def _cpu(args: argparse.Namespace, ways: list[tuple[str, Any, Any, int]]) -> None:
    figs: dict[str, list[tuple[float, float]]] = {name: [] for name, *_ in ways}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, worker, target, pid in ways[:: 1 if r % 2 else -1]:
            us, rate, _ = _load_calls(worker, target, pid, args.workers, args.seconds)
            if r:
                figs[name].append((us, rate))
    floor = [us for us, _ in figs["raw gRPC floor"]]
    print(f"\nserver CPU per {SMALL:,}-element Adam push, {args.workers} clients")
    for name, rows in figs.items():
        us = [u for u, _ in rows]
        rate = statistics.median(q for _, q in rows)
        ratio = [u / f for u, f in zip(us, floor, strict=True)]
        print(
            f"  {name:22s} {statistics.median(us):5.0f} us "
            f"({min(us):.0f}-{max(us):.0f})  {rate:6.0f} calls/s  floor x "
            f"{statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f})"
        )


def _latency(args: argparse.Namespace, address: str, default: str) -> None:
    g = np.full(SMALL, 1e-3, np.float32)
    kw: dict[str, Any] = {"shared_memory": "off", "data_channel": "off"}
    p50s: dict[str, list[float]] = {}
    with (
        Client(default) as default_client,
        Client(address, **kw) as grpc_client,
        Client(address, frames="on", **kw) as frames_client,
    ):
        ways = [
            ("no flags", default_client),
            ("frames", frames_client),
            ("gRPC", grpc_client),
        ]
        for r in range(args.rounds + 1):
            for name, c in ways[:: 1 if r % 2 else -1]:
                times = []
                for _ in range(args.pushes):
                    t0 = time.perf_counter()
                    c.push("small", g, return_values=True)
                    times.append(time.perf_counter() - t0)
                if r:
                    p50s.setdefault(name, []).append(statistics.median(times) * 1e6)
    print(f"\none client, one {SMALL:,}-element push returning X at a time: p50 us")
    for name, values in p50s.items():
        print(
            f"  {name:22s} {statistics.median(values):5.0f} "
            f"({min(values):.0f}-{max(values):.0f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--pushes", type=int, default=1500, help="per latency round")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        default_proc, default = start_default_server(
            tmp / "default", log=tmp / "default.log"
        )
        proc, address = start_server_process("--data-port", "0", log=tmp / "s.log")
        raw, port = _start_raw(tmp, "frames")
        try:
            for server in (default, address):
                with Client(server) as c:
                    x0 = np.linspace(-1, 1, SMALL, dtype=np.float32)
                    c.create_group(
                        "small", Adam(), learning_rate=1e-3, tensors={"w": x0}
                    )
            ways = [
                ("no flags", _onnxps_worker, (default, {}), default_proc.pid),
                ("frames", _frames_worker, address, proc.pid),
                ("gRPC", _onnxps_worker, (address, GRPC_ONLY), proc.pid),
                ("raw gRPC floor", _raw_worker, port, raw.pid or 0),
            ]
            _cpu(args, ways)
            _latency(args, address, default)
        finally:
            stop_processes([default_proc, proc], timeout=60)
            raw.kill()


if __name__ == "__main__":
    main()
