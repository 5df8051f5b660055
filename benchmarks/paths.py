"""What each path costs for each shape of call: the table a client's choice of path
is made from (issue 38), measured, not guessed.

    python benchmarks/paths.py [--rounds 3] [--quick] [--shapes 1x256,200x1000,...]

For every shape (``N x E``: a float32 Adam group of N tensors of E elements), one
client process pushes and pulls the group (a push, then a pull into a new array)
over each path, rounds alternating the order of the paths:

- ``no flags``: ``Client(address)`` against ``onnxps serve`` with no flags (its
  snapshot durability in a data directory of its own): what a user gets;
- ``gRPC``: ``shared_memory="off", data_channel="off"`` (unary below the stream
  threshold, streams above it);
- ``shm``: ``shared_memory="on", data_channel="off"`` (segments in /dev/shm);
- ``data channel``: ``shared_memory="off", data_channel="on"`` against a server
  with ``--data-port 0``;
- ``frames``: ``shared_memory="off", frames="on"`` against the same server, for
  calls of at most 1 MiB (larger ones go as the client would send them anyway).

The tuned paths' server runs with ``--durability none``, as the default one does
not; the ``no flags`` row is what a user gets, the others say what they set. Per
path and shape: the median wall time of a push + pull, the server's CPU and the
client's CPU per push + pull (from /proc), and the server's peak RSS growth over
the shape's calls (VmHWM, reset before each shape). The best path per shape (by
wall time, then CPU) is marked. The machine may be shared: read ratios.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from onnxps.cli.process import start_server_process, stop_processes

MIB = 1 << 20
SHAPES = "1x256,1x16384,1x262144,1x2097152,10x1000,200x1000,200x10000,1x16777216"
QUICK = "1x256,1x262144,200x1000"
FRAME_MAX = 1 << 20

PATHS: dict[str, tuple[str, dict[str, str]]] = {
    # name: (server, client flags)
    "no flags": ("default", {}),
    "gRPC": ("tuned", {"shared_memory": "off", "data_channel": "off"}),
    "shm": ("tuned", {"shared_memory": "on", "data_channel": "off"}),
    "data channel": ("tuned", {"shared_memory": "off", "data_channel": "on"}),
    "frames": ("tuned", {"shared_memory": "off", "frames": "on"}),
}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status_mib(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _worker(conn: Any, address: str, flags: dict[str, str]) -> None:
    """Serve ``("create"|"run", ...)`` requests over ``conn`` with one client."""
    from onnxps.client import Adam, Client

    with Client(address, timeout=300, **flags) as c:  # type: ignore[arg-type]
        groups: dict[str, list[np.ndarray[Any, Any]]] = {}
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                return
            _, group, n, e, reps = msg
            if group not in groups:
                tensors = {f"t{i}": np.zeros(e, np.float32) for i in range(n)}
                c.create_group(group, Adam(), learning_rate=1e-3, tensors=tensors)
                groups[group] = [np.full(e, 1e-3, np.float32) for _ in range(n)]
                c.push(group, *groups[group])  # warm: links, segments, channels
                c.pull(group)
            grads = groups[group]
            times = []
            cpu0 = time.process_time()
            for _ in range(reps):
                t0 = time.perf_counter()
                c.push(group, *grads)
                c.pull(group)
                times.append(time.perf_counter() - t0)
            conn.send((statistics.median(times), (time.process_time() - cpu0) / reps))


def _reps(nbytes: int, quick: bool) -> int:
    budget = (16 if quick else 64) * MIB
    return max(3, min(200, budget // max(nbytes, 1)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help=f"shapes {QUICK}, fewer reps")
    p.add_argument("--shapes", help=f"N x E list (default {SHAPES})")
    p.add_argument("--paths", default=",".join(PATHS), help="which paths, in order")
    args = p.parse_args()
    shapes = [
        tuple(int(v) for v in s.split("x"))
        for s in (args.shapes or (QUICK if args.quick else SHAPES)).split(",")
    ]
    paths = [name for name in args.paths.split(",") if name]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        servers = {
            "default": start_server_process(
                "--durability",
                "snapshot",
                "--data-dir",
                f"{tmp}/data",
                log=Path(tmp) / "default.log",
            ),  # fmt: skip
            "tuned": start_server_process(
                "--data-port", "0", log=Path(tmp) / "tuned.log"
            ),
        }
        workers: dict[str, tuple[Any, Any]] = {}
        try:
            for name in paths:
                server, flags = PATHS[name]
                here, there = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker, args=(there, servers[server][1], flags)
                )
                proc.start()
                workers[name] = (proc, here)
            _run(args, shapes, paths, servers, workers)
        finally:
            for proc, conn in workers.values():
                conn.send(("stop",))
                proc.join(30)
            stop_processes([proc for proc, _ in servers.values()])
    return 0


def _run(
    args: argparse.Namespace,
    shapes: list[tuple[int, ...]],
    paths: list[str],
    servers: dict[str, tuple[Any, str]],
    workers: dict[str, tuple[Any, Any]],
) -> None:
    print(
        "push + pull of a float32 Adam group per path: median wall ms, server and "
        f"client CPU ms per push + pull, {args.rounds} rounds (median, min-max)"
    )
    for n, e in shapes:
        nbytes = n * e * 4
        reps = _reps(nbytes, args.quick)
        group = f"g{n}x{e}"
        figures: dict[str, list[tuple[float, float, float]]] = {k: [] for k in paths}
        peaks: dict[str, float] = {}
        for r in range(args.rounds + 1):  # round 0 creates and warms
            for name in paths if r % 2 == 0 else paths[::-1]:
                if name == "frames" and nbytes > FRAME_MAX:
                    continue
                proc, conn = workers[name]
                spid = servers[PATHS[name][0]][0].pid
                base = _status_mib(spid, "VmRSS")
                Path(f"/proc/{spid}/clear_refs").write_text("5")
                cpu0 = _cpu_seconds(spid)
                conn.send(("run", f"{group}-{paths.index(name)}", n, e, reps))
                wall, client_cpu = conn.recv()
                server_cpu = (_cpu_seconds(spid) - cpu0) / reps
                if r:
                    figures[name].append(
                        (wall * 1e3, server_cpu * 1e3, client_cpu * 1e3)
                    )
                    peak = _status_mib(spid, "VmHWM") - base
                    peaks[name] = max(peaks.get(name, 0.0), peak)
        print(f"\n{n} x {e:,} float32 ({nbytes / MIB:.3f} MiB), {reps} reps a round")
        best = min(
            (k for k in paths if figures[k]),
            key=lambda k: statistics.median(f[0] for f in figures[k]),
        )
        print(
            f"  {'path':14s} {'wall ms':>22s} {'server CPU ms':>22s} "
            f"{'client CPU ms':>22s} {'peak MiB':>9s} {'/ best':>7s}"
        )
        best_wall = statistics.median(f[0] for f in figures[best])
        for name in paths:
            runs = figures[name]
            if not runs:
                print(f"  {name:14s} (not for calls over 1 MiB)")
                continue
            cols = [_cell([f[k] for f in runs]) for k in range(3)]
            wall = statistics.median(f[0] for f in runs)
            mark = " <- best" if name == best else ""
            print(
                f"  {name:14s} {cols[0]:>22s} {cols[1]:>22s} {cols[2]:>22s} "
                f"{peaks.get(name, 0.0):9.0f} {wall / best_wall:7.2f}{mark}"
            )


def _cell(values: list[float]) -> str:
    med = statistics.median(values)
    digits = 3 if med < 1 else 2
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


if __name__ == "__main__":
    raise SystemExit(main())
