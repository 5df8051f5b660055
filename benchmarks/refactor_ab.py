"""A/B: this working tree against an older commit, client and server of the same
version, on every transport, in one run: did a refactor lose speed?

    python benchmarks/refactor_ab.py [--rounds 5] [--baseline REV] [--mib 64]
                                     [--reps 5] [--small 1000] [--calls 300]
                                     [--new REV] [--only TEXT]
                                     [--new-server-env NAME=VALUE]

The baseline (default c55d2bd) is the tree before the wire layer (``onnxps.wire``),
the client's tensor transports (client/_transport.py), the servicer's split into
families with server-side transports, the cluster route object and the hardening
(shared-memory keys, stall limits, WAL checks). Each side is its own checkout
(benchmarks/_baseline.py: ``git archive`` of the commit, its package-dir mapping as
a symlink tree on PYTHONPATH) with its own ``onnxps serve --data-port 0``
(``--durability none``) and a worker process for its client, driven over a pipe;
the worker times each call. Float32 Adam groups throughout:

- small: a ``--small``-element group, ``--calls`` pushes returning X and as many
  plain pushes a round, over gRPC (unary) and as frame calls (``frames="on"``, a
  call channel; a baseline whose client has none calls over gRPC there); p50
  and p90 in µs;
- ``--mib`` MiB: push, pull (a new array) and push returning X, over gRPC streams
  (``shared_memory="off", data_channel="off", transport="stream"``), over the data
  channel (``data_channel="on", shared_memory="off"``) and through shared memory
  (``shared_memory="on", data_channel="off"``, same host); a bfloat16-encoded push
  on the data channel. ``--reps`` calls a round; the round's figure is their median.

Every measurement is made on both sides back to back, the side that goes first
alternating each round; round 0 warms up and is not counted. Prints, per
measurement, the median over rounds and the spread (min-max) of each side, the
ratio new/old (below 1: this tree is faster) and in how many rounds this tree was
the faster: wall time, then CPU time a call of the server process (all its
threads: ``clock_getcpuclockid``) and of the worker (its client), which another
process's load disturbs less than wall time. The machine may be shared: read the
ratios, and the spreads.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from _baseline import Worker, checkout, describe, serve_requests, tree_env

MIB = 1 << 20
BASELINE = "c55d2bd"
BIG = "big"
SMALL = "small"
FRAMED = "small as frames"
# transport name -> the client's options (the same spelling in both versions)
PATHS: dict[str, dict[str, Any]] = {
    "grpc stream": {
        "shared_memory": "off",
        "data_channel": "off",
        "transport": "stream",
    },
    "data channel": {"shared_memory": "off", "data_channel": "on"},
    "shared memory": {"shared_memory": "on", "data_channel": "off"},
}


def _worker(address: str, mib: int, small: int) -> None:
    """The worker: clients of ``address`` (one per transport, and a plain one for
    the small group); answers ``["small", kind, calls]`` with each call's seconds
    and ``[path, kind, reps, encoding]`` with the median seconds of ``reps``
    calls ("wall"), and either with this process's CPU seconds a call ("cpu")."""
    import numpy as np
    from onnxps.client import Adam, Client

    n = mib * MIB // 4
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal(n, dtype=np.float32)
    grad = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
    small_x = rng.standard_normal(small, dtype=np.float32)
    small_g = rng.standard_normal(small, dtype=np.float32) * np.float32(1e-3)
    unary = Client(address, timeout=600, shared_memory="off", data_channel="off")
    clients = {name: Client(address, timeout=600, **o) for name, o in PATHS.items()}
    try:
        framed: Any = Client(address, timeout=600, shared_memory="off", frames="on")
    except TypeError:  # a client from before frame calls
        framed = unary
    try:
        unary.create_group(SMALL, Adam(), learning_rate=1e-3, tensors={"s": small_x})
        unary.create_group(BIG, Adam(), learning_rate=1e-3, tensors={"w": x0})
        del x0

        def small_calls(client: Any, kind: str, calls: int) -> list[float]:
            ret = kind == "push returning X"
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                client.push(SMALL, small_g, return_values=ret)
                times.append(time.perf_counter() - t0)
            return times

        def big_call(client: Any, kind: str, encoding: str) -> float:
            t0 = time.perf_counter()
            if kind == "pull":
                client.pull(BIG)
            elif kind == "push":
                client.push(BIG, grad, encoding=encoding)
            else:
                client.push(BIG, grad, return_values=True)
            return time.perf_counter() - t0

        def call(path: str, kind: str, reps: int, encoding: str = "native") -> Any:
            cpu = time.process_time()  # this process, all its threads
            if path in (SMALL, FRAMED):
                wall: Any = small_calls(framed if path == FRAMED else unary, kind, reps)
            else:
                got = [big_call(clients[path], kind, encoding) for _ in range(reps)]
                wall = statistics.median(got)
            return {"wall": wall, "cpu": (time.process_time() - cpu) / reps}

        serve_requests(call, "ready")
    finally:
        for c in [unary, *clients.values(), *([framed] if framed is not unary else [])]:
            c.close()


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _cpu_clock(pid: int) -> int:
    """The CPU-time clock of process ``pid`` (all its threads, exited ones too, in
    ns: ``clock_getcpuclockid``), for ``time.clock_gettime``."""
    clock = ctypes.c_int()
    err = ctypes.CDLL(None, use_errno=True).clock_getcpuclockid(
        pid, ctypes.byref(clock)
    )
    if err:
        raise OSError(err, f"clock_getcpuclockid({pid}): {os.strerror(err)}")
    return clock.value


def _measurements(args: argparse.Namespace) -> list[tuple[str, list[Any]]]:
    out: list[tuple[str, list[Any]]] = []
    for kind in ("push returning X", "push"):
        out.append((f"{args.small} float32 {kind}, gRPC", [SMALL, kind, args.calls]))
    for kind in ("push returning X", "push"):
        framed = [FRAMED, kind, args.calls]
        out.append((f"{args.small} float32 {kind}, frame call", framed))
    for path in PATHS:
        for kind in ("push", "pull", "push returning X"):
            out.append((f"{args.mib} MiB {kind}, {path}", [path, kind, args.reps]))
    bf16 = ["data channel", "push", args.reps, "bfloat16"]
    out.append((f"{args.mib} MiB bfloat16 push, data channel", bf16))
    return [m for m in out if any(w in m[0] for w in args.only or [""])]


# section -> figure -> [this tree's per-round values, the baseline's]
Table = dict[str, dict[str, list[list[float]]]]
WALL = "wall time"
CPU = "CPU time a call (server; client)"


def _add(table: Table, section: str, fig: str, side: int, value: float) -> None:
    table.setdefault(section, {}).setdefault(fig, [[], []])[side].append(value)


def _record(table: Table, side: int, name: str, answer: Any, server_cpu: float) -> None:
    """One answer's figures: wall (the small calls' p50 and p90 in µs, a big
    call's median in ms) and the server's and client's CPU a call."""
    small = isinstance(answer["wall"], list)
    scale, unit = (1e6, "µs") if small else (1e3, "ms")
    if small:
        us = [v * 1e6 for v in answer["wall"]]
        _add(table, WALL, f"{name} p50 µs", side, statistics.median(us))
        _add(table, WALL, f"{name} p90 µs", side, _percentile(us, 0.9))
    else:
        _add(table, WALL, f"{name} ms", side, answer["wall"] * 1e3)
    _add(table, CPU, f"{name}, server {unit}", side, server_cpu * scale)
    _add(table, CPU, f"{name}, client {unit}", side, answer["cpu"] * scale)


def _run(
    workers: list[Worker],
    servers: list[int],
    measurements: list[tuple[str, list[Any]]],
    rounds: int,
) -> Table:
    table: Table = {}
    for r in range(rounds + 1):  # round 0 warms up
        order = (0, 1) if r % 2 else (1, 0)
        t0 = time.monotonic()
        for name, request in measurements:
            for side in order:
                cpu = time.clock_gettime(servers[side])
                answer = workers[side].call(*request)
                server_cpu = (time.clock_gettime(servers[side]) - cpu) / request[2]
                if r:
                    _record(table, side, name, answer, server_cpu)
        first = "new" if order[0] == 0 else "old"
        label = "warm-up" if not r else f"round {r}"
        print(f"{label}: {first} first, {time.monotonic() - t0:.0f} s", flush=True)
    return table


def _cell(values: list[float]) -> str:
    med = statistics.median(values)
    digits = 0 if med >= 100 else 1
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def _report(table: Table, labels: tuple[str, str]) -> None:
    width = max(len(k) for rows in table.values() for k in rows)
    head = f"{'':{width}s}  {'new ' + labels[0]:>24s}  {'old ' + labels[1]:>24s}"
    for section, rows in table.items():
        print(f"\n{section}: median (min-max) over rounds")
        print(f"{head}  new/old  new faster")
        for fig, (new, old) in rows.items():
            below = statistics.median(old)
            ratio = statistics.median(new) / below if below else float("nan")
            wins = sum(a < b for a, b in zip(new, old, strict=True))
            print(
                f"{fig:{width}s}  {_cell(new):>24s}  {_cell(old):>24s}  "
                f"{ratio:7.2f}  {wins} of {len(new)}"
            )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="counted rounds (5)")
    p.add_argument("--mib", type=int, default=64, help="the big group's MiB (64)")
    p.add_argument("--reps", type=int, default=5, help="big calls a round (5)")
    p.add_argument("--small", type=int, default=1000, help="small elements (1000)")
    p.add_argument("--calls", type=int, default=300, help="small calls a round")
    p.add_argument(
        "--baseline",
        default=BASELINE,
        metavar="REV",
        help=f"the commit to compare against (default {BASELINE})",
    )
    p.add_argument(
        "--new",
        metavar="REV",
        help="a commit to measure instead of this working tree (to bisect)",
    )
    p.add_argument(
        "--only",
        action="append",
        metavar="TEXT",
        help="only the measurements whose name holds TEXT (e.g. 'grpc stream'); "
        "repeatable",
    )
    p.add_argument(
        "--new-server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set NAME in the environment of this tree's server only (to try a "
        "cause: e.g. MALLOC_MMAP_THRESHOLD_); repeatable",
    )
    p.add_argument("--worker", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.mib, args.small)
        return
    if args.rounds < 1 or args.reps < 1 or args.calls < 1:
        p.error("--rounds, --reps and --calls must be >= 1")
    extra = dict(kv.partition("=")[::2] for kv in args.new_server_env)
    if any(not name for name in extra):
        p.error("--new-server-env takes NAME=VALUE")
    print(f"new: {describe(args.new)}\nold: {describe(args.baseline)}", flush=True)
    if not _measurements(args):
        p.error(f"--only {args.only}: no measurement's name holds that")
    if extra:
        print(f"new server's environment adds {extra}", flush=True)
    from onnxps.cli.process import start_server_process, stop_processes

    started = time.monotonic()
    procs: list[subprocess.Popen[bytes]] = []
    workers: list[Worker] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        checkout(args.new) as current,
        checkout(args.baseline) as baseline,
    ):
        try:
            for side, found in enumerate((current, baseline)):
                log = Path(tmp) / f"server-{side}.log"
                env = tree_env(found.tree) | (extra if side == 0 else {})
                proc, address = start_server_process(
                    "--data-port", "0", log=log, env=env
                )
                procs.append(proc)
                script = [__file__, "--worker", address, "--mib", str(args.mib)]
                script += ["--small", str(args.small)]
                workers.append(Worker(found, script, Path(tmp) / f"worker-{side}.log"))
            clocks = [_cpu_clock(proc.pid) for proc in procs]
            table = _run(workers, clocks, _measurements(args), args.rounds)
            _report(table, (current.label, baseline.label))
        finally:
            for w in workers:
                w.close()
            stop_processes(procs, timeout=15)
    print(f"\n{time.monotonic() - started:.0f} s in all")


if __name__ == "__main__":
    main()
