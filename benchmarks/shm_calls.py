"""A/B of the same-host path's large calls: push, pull and push returning X.

    python benchmarks/shm_calls.py [--mib 64] [--rounds 5] [--reps 6]
                                   [--baseline REV]

One client process per tree (``Client(address)``, no flags: shared memory on one
host) and one ``onnxps serve`` with no flags per tree (``start_default_server``:
snapshot durability in a folder of its own); a ``--mib`` MiB float32
Adam group of one tensor. Each round runs ``--reps`` calls of each kind on each
tree, the trees' order alternating by round; the figures are the medians over
rounds (min-max) of the wall time, the server's CPU (user + system, /proc) and the
client's CPU per call, and the server's RSS after the round (and its shared
memory, RssShmem). Calls follow each other as in a training loop, so this is
the cost of a server that keeps a client's segment mapped between calls
(it drops a segment's pages after a second without calls). The machine may be
shared: read ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _proc import cpu_seconds, status_mib

MIB = 1 << 20
KINDS = ("push", "pull", "push returning X")


def worker(address: str, mib: int, server_pid: int) -> None:
    """The client side (``--worker``): answers ``("run", kind, reps)`` with
    [median wall s, client CPU s per call, server CPU s per call]."""
    from _baseline import serve_requests
    from onnxps.client import Adam, Client

    n = mib * MIB // 4
    with Client(address, timeout=600) as c:
        c.create_group(
            "g", Adam(), learning_rate=1e-3, tensors={"w": np.zeros(n, np.float32)}
        )
        g = np.full(n, 1e-3, np.float32)
        calls = {
            "push": lambda: c.push("g", g),
            "pull": lambda: c.pull("g"),
            "push returning X": lambda: c.push("g", g, return_values=True),
        }
        for f in calls.values():  # warm: the hello, segments, kernels
            f()

        def run(kind: str, reps: int) -> list[float]:
            f = calls[kind]
            times = []
            cpu0, srv0 = time.process_time(), cpu_seconds(server_pid)
            for _ in range(reps):
                t0 = time.perf_counter()
                f()
                times.append(time.perf_counter() - t0)
            srv = (cpu_seconds(server_pid) - srv0) / reps
            return [statistics.median(times), (time.process_time() - cpu0) / reps, srv]

        serve_requests(lambda _what, *a: run(*a), "ready")


def _cell(values: list[float], scale: float = 1e3) -> str:
    v = [x * scale for x in values]
    digits = 1 if scale > 1 else 2
    return (
        f"{statistics.median(v):7.{digits}f} ({min(v):.{digits}f}-{max(v):.{digits}f})"
    )


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--baseline", help="also measure this commit's client and server")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _baseline import Worker, checkout, tree_env
    from onnxps.cli.process import start_default_server, stop_processes

    revs: list[str | None] = [None] + ([args.baseline] if args.baseline else [])
    sides: list[tuple[str, Any, Any]] = []
    stack = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        try:
            for k, rev in enumerate(revs):
                found = checkout(rev)
                tree = found.__enter__()
                stack.append(found)
                proc, address = start_default_server(
                    tmp / f"work-{k}",
                    log=tmp / f"server-{k}.log",
                    env=tree_env(tree.tree),
                )
                argv = [__file__, "--worker", address, str(args.mib), str(proc.pid)]
                w = Worker(tree, argv, tmp / f"client-{k}.log")
                name = "this tree" if rev is None else f"baseline {tree.label}"
                sides.append((name, proc, w))
            got: dict[tuple[str, str], list[list[float]]] = {}
            rss: dict[str, list[tuple[float, float]]] = {}
            for r in range(args.rounds):
                order = sides if r % 2 == 0 else sides[::-1]
                for name, proc, w in order:
                    for kind in KINDS:
                        got.setdefault((name, kind), []).append(
                            w.call("run", kind, args.reps)
                        )
                    rss.setdefault(name, []).append(
                        (
                            status_mib(proc.pid, "VmRSS"),
                            status_mib(proc.pid, "RssShmem"),
                        )
                    )
            print(
                f"{args.mib} MiB float32 Adam group, Client(address) on one host, "
                f"{args.rounds} rounds x {args.reps} calls; ms per call, median of "
                "rounds (min-max)"
            )
            print(f"  {'':28s} {'wall':>20s} {'server CPU':>20s} {'client CPU':>20s}")
            for kind in KINDS:
                for name, _, _ in sides:
                    runs = got[(name, kind)]
                    cols = [_cell([x[i] for x in runs]) for i in (0, 2, 1)]
                    print(
                        f"  {kind + ', ' + name:28s} "
                        + " ".join(f"{c:>20s}" for c in cols)
                    )
                if len(sides) == 2:
                    a, b = got[(sides[0][0], kind)], got[(sides[1][0], kind)]
                    cols = [
                        _cell([x[i] / y[i] for x, y in zip(a, b, strict=True)], 1.0)
                        for i in (0, 2, 1)
                    ]
                    label = "  this / baseline (same round)"
                    print(f"  {label:28s} " + " ".join(f"{c:>20s}" for c in cols))
            for name, _, _ in sides:
                last = rss[name][-1]
                print(
                    f"  server RSS after the calls, {name}: {last[0]:.0f} MiB "
                    f"(shared memory {last[1]:.0f} MiB)"
                )
        finally:
            for _, proc, w in sides:
                w.close()
                stop_processes([proc])
            for found in stack:
                found.__exit__(None, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
