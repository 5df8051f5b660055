"""A/B of two onnxps source trees on the stream paths, alternating rounds.

    python benchmarks/stream_ab.py --a /tmp/base_pkg --b "" [--rounds 5] [--steps 3]

Each variant is a source tree put first on ``PYTHONPATH`` (a directory holding an
``onnxps/`` whose ``client``, ``server``, ``cli`` and ``v1`` are the tree's folders;
``""`` is the installed onnxps). One long-lived worker process per variant starts its
own ``onnxps serve`` (same tree) and a 64 MiB float32 Adam group, then on each round
times ``--steps`` pushes, pulls and pushes returning X (median per round). Rounds
alternate which variant goes first, so both see the same machine load. Printed: each
round, then per figure the medians, the min-max spread and the ratio b/a.

The machine may be shared: compare the ratio with the spread, not absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 1 << 20
FIGURES = ("push", "pull", "push+pull", "push_values")


def worker(mib: int) -> None:
    import numpy as np
    from onnxps.cli.process import start_server_process, stop_processes
    from onnxps.client import Adam, Client

    n = mib * MIB // 4
    log = Path(tempfile.mkstemp(suffix=".log")[1])
    proc, address = start_server_process(log=log)
    try:
        x0 = np.linspace(-1, 1, n, dtype=np.float32)
        g = np.full(n, 1e-3, np.float32)
        with Client(address, timeout=300, transport="stream") as c:
            c.create_group("ab", Adam(), learning_rate=1e-3, tensors={"x": x0})
            c.push("ab", g)
            c.pull("ab")
            c.push("ab", g, return_values=True)
            print("ready", flush=True)
            for line in sys.stdin:
                steps = int(line)
                out: dict[str, list[float]] = {f: [] for f in FIGURES}
                for _ in range(steps):
                    t0 = time.perf_counter()
                    c.push("ab", g)
                    t1 = time.perf_counter()
                    c.pull("ab")
                    t2 = time.perf_counter()
                    c.push("ab", g, return_values=True)
                    t3 = time.perf_counter()
                    out["push"].append(t1 - t0)
                    out["pull"].append(t2 - t1)
                    out["push+pull"].append(t2 - t0)
                    out["push_values"].append(t3 - t2)
                med = {k: 1e3 * statistics.median(v) for k, v in out.items()}
                print(json.dumps(med), flush=True)
    finally:
        stop_processes([proc], timeout=15)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--a", default="", help="PYTHONPATH root of variant a")
    p.add_argument("--b", default="", help="PYTHONPATH root of variant b")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.mib)
        return 0
    procs: dict[str, subprocess.Popen[str]] = {}
    for name, root in (("a", args.a), ("b", args.b)):
        env = dict(os.environ)
        if root:
            env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        procs[name] = subprocess.Popen(
            [sys.executable, __file__, "--worker", "--mib", str(args.mib)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
    try:
        for proc in procs.values():
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a worker did not start")
        results: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
        for r in range(args.rounds):
            order = ("a", "b") if r % 2 == 0 else ("b", "a")
            for name in order:
                proc = procs[name]
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(f"{args.steps}\n")
                proc.stdin.flush()
                res: dict[str, float] = json.loads(proc.stdout.readline())
                results[name].append(res)
                figs = "  ".join(f"{k} {v:7.1f}" for k, v in res.items())
                print(f"round {r + 1} {name}: {figs}", flush=True)
        print()
        print(f"{'figure':12s} {'a median':>9s} {'a spread':>17s} {'b median':>9s} "
              f"{'b spread':>17s} {'b/a':>6s}")  # fmt: skip
        for f in FIGURES:
            a = [x[f] for x in results["a"]]
            b = [x[f] for x in results["b"]]
            ma, mb = statistics.median(a), statistics.median(b)
            print(
                f"{f:12s} {ma:9.1f} {f'{min(a):.1f}-{max(a):.1f}':>17s} {mb:9.1f} "
                f"{f'{min(b):.1f}-{max(b):.1f}':>17s} {mb / ma:6.2f}"
            )
    finally:
        for proc in procs.values():
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
