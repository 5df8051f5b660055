"""What each path costs for each shape of call: the table a client's choice of path
is made from (issue 38), measured, not guessed.

    python benchmarks/paths.py [--rounds 3] [--quick] [--shapes 1x256,200x1000,...]
                               [--paths "no flags,gRPC,shm,..."] [--baseline REV]

For every shape (``N x E``: a float32 Adam group of N tensors of E elements), one
client process pushes and pulls the group (a push, then a pull into a new array)
over each path, each round measuring every shape and every path, their order
alternating from round to round (so shapes are compared within a round):

- ``no flags``: ``Client(address)`` against ``onnxps serve`` with no flags (its
  snapshot durability in a data directory of its own): what a user gets;
- ``no flags over TCP``: the same, the server in a mount namespace of its own with an
  empty /dev/shm of its own (``unshare``; needs root): the client's shared-memory
  hello finds no shared /dev/shm, as between two hosts, and its calls go over TCP
  (frames, the data channel or gRPC, as the client's plan picks) on loopback;
- ``gRPC``: ``shared_memory="off", data_channel="off", frames="off"`` (unary
  below the stream threshold, streams above it);
- ``shm``: ``shared_memory="on", data_channel="off", frames="off"`` (segments in
  /dev/shm);
- ``data channel``: ``shared_memory="off", data_channel="on", frames="off"``
  against a server with ``--data-port 0``;
- ``frames``: ``shared_memory="off", frames="on"`` against the same server, for
  calls of at most 1 MiB (larger ones go as the client would send them anyway).

The tuned paths' server runs with ``--durability none``, as the default one does
not; the ``no flags`` row is what a user gets, the others say what they set. Per
path and shape: the median wall time of a push + pull, the server's CPU and the
client's CPU per push + pull (from /proc), and the server's peak RSS growth over
the shape's calls (VmHWM, reset before each shape). The best path per shape (by
wall time) is marked. ``--baseline REV`` runs every path a second time with the
client and servers of an older commit (``benchmarks/_baseline.py``: its own
checkout and processes), in the same alternating rounds: the A/B of a change.
``--client-env KEY=VALUE`` sets a variable in the client processes only: with
``MALLOC_MMAP_THRESHOLD_=131072`` glibc maps every block over 128 KiB anew (and
faults its pages in), as a process whose malloc has not adapted does, so a path
that takes a fresh buffer per call shows what that costs.
``--ratio 200x1000/1x200000`` (the default) prints, per path, the first shape's wall
time over the second's, paired round by round. The machine may be shared: read ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _proc import cpu_seconds, status_mib

MIB = 1 << 20
SHAPES = "1x256,1x16384,1x262144,1x2097152,10x1000,200x1000,200x10000,1x16777216"
QUICK = "1x256,1x262144,200x1000"
FRAME_MAX = 1 << 20

PATHS: dict[str, tuple[str, dict[str, str]]] = {
    # name: (server, client flags)
    "no flags": ("default", {}),
    "no flags over TCP": ("apart", {}),
    "gRPC": (
        "tuned",
        {"shared_memory": "off", "data_channel": "off", "frames": "off"},
    ),
    "shm": ("tuned", {"shared_memory": "on", "data_channel": "off", "frames": "off"}),
    "data channel": (
        "tuned",
        {"shared_memory": "off", "data_channel": "on", "frames": "off"},
    ),
    "frames": ("tuned", {"shared_memory": "off", "frames": "on"}),
}


def _start_apart(
    *args: str, log: Path, env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], str]:
    """``onnxps serve ARGS`` with a /dev/shm of its own (see ``APART``)."""
    from onnxps.cli.process import wait_for_listening

    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
    cmd += ['mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh"]
    cmd += [sys.executable, "-m", "onnxps.cli", "serve", *args]
    cmd += ["--address", "127.0.0.1:0"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, wait_for_listening(proc, log)


def worker(address: str, flags: dict[str, str]) -> None:
    """The client side, in its own process (``--worker``): answers ``("run",
    group, n, e, reps)`` with [median wall seconds, CPU seconds per push + pull]."""
    from _baseline import serve_requests
    from onnxps.client import Adam, Client

    with Client(address, timeout=300, **flags) as c:  # type: ignore[arg-type]
        groups: dict[str, list[np.ndarray[Any, Any]]] = {}

        def run(group: str, n: int, e: int, reps: int) -> list[float]:
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
            return [statistics.median(times), (time.process_time() - cpu0) / reps]

        serve_requests(lambda _what, *a: run(*a), "ready")


def _reps(nbytes: int, quick: bool) -> int:
    budget = (16 if quick else 64) * MIB
    return max(3, min(200, budget // max(nbytes, 1)))


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], json.loads(sys.argv[3]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help=f"shapes {QUICK}, fewer reps")
    p.add_argument("--shapes", help=f"N x E list (default {SHAPES})")
    p.add_argument("--paths", default=",".join(PATHS), help="which paths, in order")
    p.add_argument("--baseline", help="also measure this commit's client and servers")
    p.add_argument(
        "--client-env",
        action="append",
        default=[],
        type=lambda kv: tuple(kv.split("=", 1)),
        metavar="KEY=VALUE",
        help="set in the clients' environment only (repeatable), e.g. "
        "MALLOC_MMAP_THRESHOLD_=131072: glibc maps every block over 128 KiB anew",
    )
    p.add_argument(
        "--ratio",
        default="200x1000/1x200000",
        help="shape A over shape B, wall time paired per round (comma list)",
    )
    args = p.parse_args()
    shapes = [
        (int(n), int(e))
        for n, e in (
            s.split("x")
            for s in (args.shapes or (QUICK if args.quick else SHAPES)).split(",")
        )
    ]
    from _baseline import Worker, checkout, tree_env
    from onnxps.cli.process import start_server_process, stop_processes

    names = [name for name in args.paths.split(",") if name]
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        sides = [stack.enter_context(checkout(None))]
        if args.baseline:
            sides.append(stack.enter_context(checkout(args.baseline)))
        rows: list[tuple[str, str, Any, Worker]] = []  # (row, path, server, worker)
        servers: list[Any] = []
        stack.callback(lambda: stop_processes(servers))
        for k, side in enumerate(sides):
            env = tree_env(side.tree)
            wanted = {PATHS[name][0] for name in names}
            started = {
                "default": start_server_process(
                    "--durability",
                    "snapshot",
                    "--data-dir",
                    str(tmp / f"data{k}"),
                    log=tmp / f"default{k}.log",
                    env=env,
                ),  # fmt: skip
                "tuned": start_server_process(
                    "--data-port", "0", log=tmp / f"tuned{k}.log", env=env
                ),
            }
            if "apart" in wanted:
                started["apart"] = _start_apart(
                    "--durability",
                    "snapshot",
                    "--data-dir",
                    str(tmp / f"apart{k}"),
                    log=tmp / f"apart{k}.log",
                    env=dict(env),
                )  # fmt: skip
            servers += [proc for proc, _ in started.values()]
            for name in names:
                server, flags = PATHS[name]
                proc, address = started[server]
                argv = [__file__, "--worker", address, json.dumps(flags)]
                log = tmp / f"worker-{k}-{name}.log"
                w = Worker(side, argv, log, dict(args.client_env))
                stack.callback(w.close)
                row = name if k == 0 else f"{name} @ {side.label}"
                rows.append((row, name, proc, w))
        _run(args, shapes, rows)
    return 0


def _run(
    args: argparse.Namespace,
    shapes: list[tuple[int, int]],
    rows: list[tuple[str, str, Any, Any]],
) -> None:
    print(
        "push + pull of a float32 Adam group per path: median wall ms, server and "
        f"client CPU ms per push + pull, {args.rounds} rounds (median, min-max); "
        "each round measures every shape and path, their order alternating"
    )
    figures: dict[tuple[int, int], dict[str, list[tuple[float, float, float]]]] = {
        shape: {r[0]: [] for r in rows} for shape in shapes
    }
    peaks: dict[tuple[int, int], dict[str, float]] = {shape: {} for shape in shapes}
    for r in range(args.rounds + 1):  # round 0 creates and warms
        for n, e in shapes if r % 2 == 0 else shapes[::-1]:
            nbytes = n * e * 4
            reps = _reps(nbytes, args.quick)
            for row, name, proc, w in rows if r % 2 == 0 else rows[::-1]:
                if name == "frames" and nbytes > FRAME_MAX:
                    continue
                spid = proc.pid
                base = status_mib(spid, "VmRSS")
                Path(f"/proc/{spid}/clear_refs").write_text("5")
                cpu0 = cpu_seconds(spid)
                wall, client_cpu = w.call("run", f"g{n}x{e}-{row}", n, e, reps)
                server_cpu = (cpu_seconds(spid) - cpu0) / reps
                if r:
                    figures[(n, e)][row].append(
                        (wall * 1e3, server_cpu * 1e3, client_cpu * 1e3)
                    )
                    peak = status_mib(spid, "VmHWM") - base
                    peaks[(n, e)][row] = max(peaks[(n, e)].get(row, 0.0), peak)
        if r:
            print(f"  round {r} of {args.rounds} measured", file=sys.stderr, flush=True)
    for n, e in shapes:
        nbytes = n * e * 4
        _print_shape(
            n, e, nbytes, _reps(nbytes, args.quick), figures[(n, e)], peaks[(n, e)]
        )
    for ratio in (args.ratio or "").split(","):
        if ratio:
            _print_ratio(ratio, figures)


def _print_ratio(
    ratio: str,
    figures: dict[tuple[int, int], dict[str, list[tuple[float, float, float]]]],
) -> None:
    """Per path, shape A's wall time over shape B's, paired round by round (both
    measured in the same round), for ``--ratio AxE/BxE``."""
    a, b = (tuple(int(x) for x in side.split("x")) for side in ratio.split("/"))
    if a not in figures or b not in figures:
        print(f"\n(ratio {ratio}: both shapes must be among --shapes)")
        return
    print(f"\n{ratio} wall time, paired per round: median (min-max)")
    for row, runs in figures[a].items():
        other = figures[b][row]
        if runs and other:
            pairs = zip(runs, other, strict=True)  # a row's rounds: both shapes
            print(f"  {row:24s} {_cell([x[0] / y[0] for x, y in pairs])}")


def _print_shape(
    n: int,
    e: int,
    nbytes: int,
    reps: int,
    figures: dict[str, list[tuple[float, float, float]]],
    peaks: dict[str, float],
) -> None:
    print(f"\n{n} x {e:,} float32 ({nbytes / MIB:.3f} MiB), {reps} reps a round")
    measured = [row for row, runs in figures.items() if runs]
    best = min(measured, key=lambda row: statistics.median(f[0] for f in figures[row]))
    best_wall = statistics.median(f[0] for f in figures[best])
    print(
        f"  {'path':24s} {'wall ms':>22s} {'server CPU ms':>22s} "
        f"{'client CPU ms':>22s} {'peak MiB':>9s} {'/ best':>7s}"
    )
    for row, runs in figures.items():
        if not runs:
            print(f"  {row:24s} (not for calls over 1 MiB)")
            continue
        cols = [_cell([f[k] for f in runs]) for k in range(3)]
        wall = statistics.median(f[0] for f in runs)
        mark = " <- best" if row == best else ""
        print(
            f"  {row:24s} {cols[0]:>22s} {cols[1]:>22s} {cols[2]:>22s} "
            f"{peaks.get(row, 0.0):9.0f} {wall / best_wall:7.2f}{mark}"
        )


def _cell(values: list[float]) -> str:
    med = statistics.median(values)
    digits = 3 if med < 1 else 2
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


if __name__ == "__main__":
    raise SystemExit(main())
