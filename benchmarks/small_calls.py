"""Small calls, many tensors and memory: what issue 24 measures, in one run.

    python benchmarks/small_calls.py [--rounds 5] [--seconds 3] [--workers 4]
                                     [--sections cpu,tensors,memory] [--mib 256]
                                     [--baseline REV]

- ``cpu``: ``--workers`` client processes push a 1,000-element float32 Adam gradient
  as fast as they can for ``--seconds``, first to ``onnxps serve --durability none``
  (no auth), then to the floor: a raw grpcio unary server (bytes in, 8 bytes out, no
  protobuf) taking the same NumPy Adam step under a lock. The figure is the server
  process's CPU time (user + system, from /proc) per call, and calls per second.
  Rounds alternate which server goes first. ``--baseline REV`` adds the server of
  an older commit (``benchmarks/_baseline.py``: its own checkout and process),
  measured in the same rounds: an A/B of a change.
- ``tensors``: one client pushes and pulls a group of 200 tensors of 1,000 elements
  and a group of one 200,000-element tensor (float32 Adam), alternating; the figure
  is the median push+pull time of each and their ratio.
- ``memory``: a ``--mib`` MiB float32 Adam group (X, V and H: 3x that much state) is
  created, pushed, pulled and pushed returning X; the server's RSS after each step
  and its peak (VmHWM), as multiples of the state.

Prints medians and min-max spreads; the machine may be shared: read the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
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

SMALL = 1000
MIB = 1 << 20
_RAW_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def _memory(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MiB."""
    got = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            got[key] = int(value.split()[0]) / 1024
    return got["VmRSS"], got["VmHWM"]


# -- the raw gRPC floor ------------------------------------------------------------
def raw_server(port_file: str) -> None:
    from concurrent import futures

    import grpc
    from onnxps.server.kernels import Stepper, make_attrs

    x = np.linspace(-1, 1, SMALL, dtype=np.float32)
    v, h = np.zeros(SMALL, np.float32), np.zeros(SMALL, np.float32)
    stepper = Stepper(make_attrs("Adam", {}), np.float32, [SMALL])
    lock = threading.Lock()
    t = [0]

    def push(req: bytes, ctx: Any) -> bytes:
        g = np.frombuffer(req, np.float32)
        with lock:
            stepper.step(1e-3, t[0], [x], [g], [v], [h])
            t[0] += 1
            return t[0].to_bytes(8, "little")

    handler = grpc.method_handlers_generic_handler(
        "raw.Raw", {"Push": grpc.unary_unary_rpc_method_handler(push)}
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(16), handlers=[handler], options=_RAW_OPTIONS
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(port_file).write_text(str(port))
    server.wait_for_termination()


def _raw_worker(port: int, seconds: float, out: Any) -> None:
    import grpc

    g = np.full(SMALL, 1e-3, np.float32).tobytes()
    with grpc.insecure_channel(f"127.0.0.1:{port}", _RAW_OPTIONS) as channel:
        push = channel.unary_unary("/raw.Raw/Push")
        push(g)  # connected
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            push(g)
            n += 1
    out.put(n)


def _onnxps_worker(address: str, seconds: float, out: Any) -> None:
    g = np.full(SMALL, 1e-3, np.float32)
    with Client(address, shared_memory="off", data_channel="off") as c:
        c.push("small", g)
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            c.push("small", g)
            n += 1
    out.put(n)


def _load(
    worker: Callable[..., None], target: Any, pid: int, workers: int, seconds: float
) -> tuple[float, float]:
    """(server CPU microseconds per call, calls per second) under ``workers``."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(target, seconds, q)) for _ in range(workers)
    ]
    cpu0 = _cpu_seconds(pid)
    t0 = time.monotonic()
    for p in procs:
        p.start()
    calls = sum(q.get(timeout=seconds + 120) for _ in procs)
    for p in procs:
        p.join()
    wall = time.monotonic() - t0
    cpu = _cpu_seconds(pid) - cpu0
    return cpu / max(calls, 1) * 1e6, calls / wall


def cpu_section(args: argparse.Namespace, tmp: Path) -> None:
    ctx = mp.get_context("spawn")
    port_file = tmp / "raw.port"
    raw = ctx.Process(target=raw_server, args=(str(port_file),), daemon=True)
    raw.start()
    while not port_file.exists() or not port_file.read_text():
        time.sleep(0.05)
    port = int(port_file.read_text())
    servers = [("onnxps", *start_server_process(log=tmp / "cpu.log"))]
    with contextlib.ExitStack() as stack:
        try:
            if args.baseline:
                from _baseline import checkout, tree_env

                old = stack.enter_context(checkout(args.baseline))
                env = tree_env(old.tree)
                started = start_server_process(log=tmp / "old.log", env=env)
                servers.append((f"onnxps {old.label}", *started))
            _cpu_rounds(args, servers, raw.pid or 0, port)
        finally:
            stop_processes([p for _, p, _ in servers])
            raw.kill()


def _cpu_rounds(
    args: argparse.Namespace,
    servers: list[tuple[str, Any, str]],
    raw_pid: int,
    port: int,
) -> None:
    for _, _, address in servers:
        with Client(address) as c:
            x0 = np.linspace(-1, 1, SMALL, dtype=np.float32)
            c.create_group("small", Adam(), learning_rate=1e-3, tensors={"w": x0})
    figures: dict[str, list[tuple[float, float]]] = {n: [] for n, _, _ in servers}
    figures["raw gRPC"] = []
    for r in range(args.rounds + 1):  # round 0 warms up
        order: list[tuple[str, Callable[..., None], Any, int]] = [
            (name, _onnxps_worker, address, proc.pid) for name, proc, address in servers
        ]
        order.append(("raw gRPC", _raw_worker, port, raw_pid))
        if r % 2:
            order.reverse()
        for name, worker, target, pid in order:
            got = _load(worker, target, pid, args.workers, args.seconds)
            if r:
                figures[name].append(got)
    print(f"\nserver CPU per 1,000-element Adam push, {args.workers} clients")
    print(f"  {'server':18s} {'us CPU/call':>20s} {'calls/s':>20s}")
    for name, runs in figures.items():
        us = [u for u, _ in runs]
        rate = [c for _, c in runs]
        print(f"  {name:18s} {_cell(us, 0):>20s} {_cell(rate, 0):>20s}")
    for name, _, _ in servers:
        ratios = _ratios(figures[name], figures["raw gRPC"])
        print(f"  {name} / floor (CPU per call): {_cell(ratios, 2)}")
    if len(servers) == 2:
        new, old = figures[servers[0][0]], figures[servers[1][0]]
        wins = sum(a[0] < b[0] for a, b in zip(new, old, strict=True))
        print(
            f"  this tree / {servers[1][0]} (CPU per call): "
            f"{_cell(_ratios(new, old), 2)}, less CPU in {wins} of {len(new)} rounds"
        )


def _ratios(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[float]:
    return [x[0] / y[0] for x, y in zip(a, b, strict=True)]


def tensors_section(args: argparse.Namespace, tmp: Path) -> None:
    proc, address = start_server_process(log=tmp / "tensors.log")
    rng = np.random.default_rng(0)
    try:
        with Client(address, shared_memory="off", data_channel="off") as c:
            many = {f"t{i}": rng.standard_normal(1000, np.float32) for i in range(200)}
            one = {"t": rng.standard_normal(200_000, np.float32)}
            c.create_group("many", Adam(), learning_rate=1e-3, tensors=many)
            c.create_group("one", Adam(), learning_rate=1e-3, tensors=one)
            g_many = [np.full(1000, 1e-3, np.float32)] * 200
            g_one = [np.full(200_000, 1e-3, np.float32)]
            times: dict[str, list[float]] = {"200 x 1,000": [], "1 x 200,000": []}
            calls = [("200 x 1,000", "many", g_many), ("1 x 200,000", "one", g_one)]
            for r in range(args.rounds + 1):
                for name, group, grads in calls if r % 2 == 0 else calls[::-1]:
                    runs = []
                    for _ in range(20):
                        t0 = time.perf_counter()
                        c.push(group, *grads)
                        c.pull(group)
                        runs.append(time.perf_counter() - t0)
                    if r:
                        times[name].append(statistics.median(runs) * 1e3)
        print("\npush + pull of 200,000 float32 Adam elements (ms, median of 20)")
        for name, t in times.items():
            print(f"  {name:14s} {_cell(t, 2)}")
        ratios = [a / b for a, b in zip(*times.values(), strict=True)]
        print(f"  200 tensors / one tensor: {_cell(ratios, 2)}")
    finally:
        stop_processes([proc])


def memory_section(args: argparse.Namespace, tmp: Path) -> None:
    proc, address = start_server_process(log=tmp / "memory.log")
    n = args.mib * MIB // 4
    state = 3 * args.mib
    try:
        with Client(address, shared_memory="off", timeout=600) as c:
            base = _memory(proc.pid)[0]
            print(f"\nserver memory, {args.mib} MiB float32 Adam group ({state} MiB)")
            print(f"  idle RSS {base:.0f} MiB; figures below are RSS - idle")

            def show(step: str) -> None:
                rss, peak = _memory(proc.pid)
                print(
                    f"  {step:28s} RSS {rss - base:7.0f} MiB "
                    f"({(rss - base) / state:.2f}x)  peak {peak - base:7.0f} MiB "
                    f"({(peak - base) / state:.2f}x)"
                )

            x0 = np.zeros(n, np.float32)
            c.create_group("big", Adam(), learning_rate=1e-3, tensors={"w": x0})
            del x0
            show("after create")
            g = np.full(n, 1e-3, np.float32)
            c.push("big", g)
            show("after push")
            c.pull("big")
            show("after pull")
            c.push("big", g, return_values=True)
            show("after push returning X")
            for _ in range(3):
                c.push("big", g)
                c.pull("big")
            show("after 3 more pushes + pulls")
    finally:
        stop_processes([proc])


def _cell(values: list[float], digits: int) -> str:
    med = statistics.median(values)
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--sections", default="cpu,tensors,memory")
    p.add_argument("--baseline", help="also measure this commit's server (cpu)")
    args = p.parse_args()
    sections = {
        "cpu": cpu_section,
        "tensors": tensors_section,
        "memory": memory_section,
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sections.split(","):
            sections[name](args, Path(tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
