"""Where a small push's server CPU goes (issue 24), against the raw gRPC floor.

    python benchmarks/call_anatomy.py [--rounds 5] [--seconds 3] [--workers 4]

- ``threads``: ``--workers`` client processes push a 1,000-element float32 Adam
  gradient as fast as they can (``small_calls.py``'s ``cpu`` load) to ``onnxps
  serve --durability none`` and to the raw grpcio floor (the same NumPy step under
  a lock, bytes in and out), rounds alternating. Per call: the server's CPU split
  into grpc core's own threads (``event_engine``) and the Python threads (grpc's
  polling thread and the RPC workers), their context switches, and how many Python
  threads ran. From /proc/PID/task.
- ``inprocess``: the Python one Push runs in the onnxps server (the interceptor
  chain, parsing, the servicer, the step) against the floor's handler (frombuffer
  and the same ``Stepper`` step), in this process with no network: a real server
  whose Push handler is called directly, with a stand-in for grpc's per-call
  context (it reads grpc's private server state to find the handler). Hot: calls
  back to back. Cold: 16 MiB written between calls, as the other threads' work
  leaves a loaded server's caches. Each call is a new push (its own seq).
- ``wakeup``: what one thread waking another costs on this machine, in CPU and
  wall time (two threads handing a lock back and forth).

A loaded server's CPU per call follows its context switches (``wakeup`` prices
one) and how much code and data a call touches (``inprocess`` cold against hot).
Prints medians and min-max spreads; the machine may be shared: read the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from onnxps.cli.process import start_server_process, stop_processes
from onnxps.client import Adam, Client
from small_calls import SMALL, _load_calls, _onnxps_worker, _raw_worker, _start_raw


def _tasks(pid: int) -> dict[str, tuple[str, int, int]]:
    """Per thread of ``pid``: (name, CPU ticks, context switches)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except FileNotFoundError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        switches = sum(
            int(line.split()[1])
            for line in status.splitlines()
            if "ctxt_switches" in line
        )
        out[tid] = (name, int(fields[11]) + int(fields[12]), switches)
    return out


def _split(
    before: dict[str, tuple[str, int, int]],
    after: dict[str, tuple[str, int, int]],
    calls: int,
) -> dict[str, float]:
    """Per call: CPU us and switches of grpc core's threads and of Python's."""
    tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
    fig = {"core_us": 0.0, "core_cs": 0.0, "py_us": 0.0, "py_cs": 0.0, "py_ran": 0.0}
    for tid, (name, ticks, switches) in after.items():
        _, t0, s0 = before.get(tid, (name, 0, 0))
        kind = "core" if name.startswith("event_engine") else "py"
        fig[f"{kind}_us"] += (ticks - t0) * tick_us / calls
        fig[f"{kind}_cs"] += (switches - s0) / calls
        if kind == "py" and switches - s0 > calls / 100:
            fig["py_ran"] += 1
    return fig


def threads_section(args: argparse.Namespace, tmp: Path) -> None:
    raw, port = _start_raw(tmp, "anatomy")
    proc, address = start_server_process(log=tmp / "anatomy.log")
    with Client(address) as c:
        x0 = np.linspace(-1, 1, SMALL, dtype=np.float32)
        c.create_group("small", Adam(), learning_rate=1e-3, tensors={"w": x0})
    servers: list[tuple[str, Callable[..., None], Any, int]] = [
        ("onnxps", _onnxps_worker, address, proc.pid),
        ("raw gRPC", _raw_worker, port, raw.pid or 0),
    ]
    figs: dict[str, list[dict[str, float]]] = {name: [] for name, *_ in servers}
    try:
        for r in range(args.rounds + 1):  # round 0 warms up
            for name, worker, target, pid in servers[:: 1 if r % 2 else -1]:
                before = _tasks(pid)
                _, _, calls = _load_calls(
                    worker, target, pid, args.workers, args.seconds
                )
                if r:
                    figs[name].append(_split(before, _tasks(pid), max(calls, 1)))
    finally:
        stop_processes([proc])
        raw.kill()
    print(f"\nserver threads per {SMALL:,}-element push, {args.workers} clients")
    print(
        f"  {'server':10s} {'core us':>8s} {'core cs':>8s} {'Python us':>10s} "
        f"{'Python cs':>10s} {'threads':>8s} {'total us':>9s}"
    )
    for name, rows in figs.items():
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        total = [row["core_us"] + row["py_us"] for row in rows]
        print(
            f"  {name:10s} {med['core_us']:8.0f} {med['core_cs']:8.1f} "
            f"{med['py_us']:10.0f} {med['py_cs']:10.1f} {med['py_ran']:8.0f} "
            f"{statistics.median(total):5.0f} ({min(total):.0f}-{max(total):.0f})"
        )


class _Context:
    """What the servicer and the interceptors ask of grpc's per-call context."""

    def __init__(self, metadata: tuple[Any, ...]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[Any, ...]:
        return self.metadata

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailing = metadata

    def code(self) -> None:
        return None

    def is_active(self) -> bool:
        return True

    def time_remaining(self) -> None:
        return None

    def add_callback(self, callback: Any) -> bool:
        return True

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def abort_with_status(self, status: Any) -> None:
        raise RuntimeError(f"the push failed: {status}")

    def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"the push failed: {code} {details}")


def _timed(call: Callable[[], Any], n: int, cold: np.ndarray | None) -> float:
    """Median-free mean us per call over ``n`` calls (``cold``: written between)."""
    total = 0.0
    for _ in range(n):
        if cold is not None:
            np.add(cold, 1.0, out=cold)
        t0 = time.perf_counter()
        call()
        total += time.perf_counter() - t0
    return total / n * 1e6


def inprocess_section(args: argparse.Namespace, tmp: Path) -> None:
    import grpc
    from onnxps.server.app import ServerConfig, create_server
    from onnxps.server.kernels import Stepper, make_attrs
    from onnxps.v1 import parameter_server_pb2 as pb
    from onnxps.wire.codec import EncodedMessage

    handle = create_server(ServerConfig(address="127.0.0.1:0", durability="none"))
    handle.server.start()
    try:
        with Client(handle.address) as c:
            x0 = np.linspace(-1, 1, SMALL, dtype=np.float32)
            c.create_group("small", Adam(), learning_rate=1e-3, tensors={"w": x0})
        state: Any = handle.server._state  # type: ignore[attr-defined]
        method = "/onnxps.v1.ParameterServerService/Push"
        base = state.registered_method_handlers[method]
        chain = state.interceptor_pipeline.interceptors[0]
        details = grpc._server._HandlerCallDetails(method, ())  # type: ignore[attr-defined]
        g = np.full(SMALL, 1e-3, np.float32)
        seq = iter(range(1, 1 << 40))

        def request() -> bytes:
            req = pb.PushRequest(group="small", client_id="anatomy", seq=next(seq))
            return EncodedMessage(req, "gradients", [g]).SerializeToString()

        def full() -> Any:
            raw = pending.pop()
            handler = chain.intercept_service(lambda d: base, details)
            return handler.unary_unary(handler.request_deserializer(raw), _Context(()))

        def servicer() -> Any:
            raw = pending.pop()
            return base.unary_unary(base.request_deserializer(raw), _Context(()))

        x = x0.copy()
        v, h = np.zeros(SMALL, np.float32), np.zeros(SMALL, np.float32)
        stepper = Stepper(make_attrs("Adam", {}), np.float32, [SMALL])
        gb, t = g.tobytes(), [0]

        def floor() -> None:
            grad = np.frombuffer(gb, np.float32)
            stepper.step(1e-3, t[0], [x], [grad], [v], [h])
            t[0] += 1

        cold = np.ones(4 << 20, np.float32)
        n = 400
        ways = [("onnxps: chain + servicer", full), ("onnxps: servicer", servicer)]
        ways.append(("raw floor's handler", floor))
        figs: dict[tuple[str, bool], list[float]] = {}
        for r in range(args.rounds + 1):
            for name, call in ways:
                for is_cold in (False, True):
                    pending = [request() for _ in range(n)]
                    us = _timed(call, n, cold if is_cold else None)
                    if r:
                        figs.setdefault((name, is_cold), []).append(us)
    finally:
        handle.server.stop(0)
    print(f"\nin process: one {SMALL:,}-element Adam push's Python, us per call")
    print(f"  {'path':28s} {'hot':>16s} {'cold':>18s}")
    for name, _ in ways:
        hot, cold_us = figs[(name, False)], figs[(name, True)]
        print(f"  {name:28s} {_spread(hot, 16)}  {_spread(cold_us, 18)}")
    full_cold = statistics.median(figs[(ways[0][0], True)])
    floor_cold = statistics.median(figs[(ways[2][0], True)])
    print(f"  cold, onnxps over the floor's handler: +{full_cold - floor_cold:.0f} us")


def _spread(values: list[float], width: int) -> str:
    text = f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"
    return f"{text:>{width}s}"


def _ping_pong(n: int) -> tuple[float, float]:
    """(wall, CPU) us per wakeup: two threads handing two locks back and forth."""
    ping, pong = threading.Lock(), threading.Lock()
    ping.acquire()
    pong.acquire()

    def other() -> None:
        for _ in range(n):
            ping.acquire()
            pong.release()

    thread = threading.Thread(target=other)
    thread.start()
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        ping.release()
        pong.acquire()
    thread.join()
    return (time.perf_counter() - w0) / (2 * n) * 1e6, (time.process_time() - c0) / (
        2 * n
    ) * 1e6


def wakeup_section(args: argparse.Namespace, tmp: Path) -> None:
    n = 20000
    walls, cpus = [], []
    for _ in range(args.rounds):
        wall, cpu = _ping_pong(n)
        walls.append(wall)
        cpus.append(cpu)
    print("\none thread waking another (lock hand-off), per wakeup")
    print(
        f"  CPU {statistics.median(cpus):.1f} us ({min(cpus):.1f}-{max(cpus):.1f}), "
        f"wall {statistics.median(walls):.1f} us ({min(walls):.1f}-{max(walls):.1f})"
    )


SECTIONS = {
    "threads": threads_section,
    "inprocess": inprocess_section,
    "wakeup": wakeup_section,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for name in args.sections.split(","):
            if name not in SECTIONS:
                raise SystemExit(
                    f"unknown section {name!r}: one of {', '.join(SECTIONS)}"
                )
            SECTIONS[name](args, Path(d))


if __name__ == "__main__":
    main()
