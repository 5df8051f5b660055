"""A/B: this working tree against an older commit, client and server of the same
version, on every transport, in one run: did a refactor lose speed?

    python benchmarks/refactor_ab.py [--rounds 5] [--baseline REV] [--mib 64]
                                     [--reps 3] [--small 1000] [--calls 200]

The baseline (default c55d2bd) is the tree before the wire layer (``onnxps.wire``),
the client's tensor transports (client/_transport.py), the servicer's split into
families with server-side transports, the cluster route object and the hardening
(shared-memory keys, stall limits, WAL checks). Each side is its own checkout
(benchmarks/_baseline.py: ``git archive`` of the commit, its package-dir mapping as
a symlink tree on PYTHONPATH) with its own ``onnxps serve --data-port 0``
(``--durability none``) and a worker process for its client, driven over a pipe;
the worker times each call. Float32 Adam groups throughout:

- small: a ``--small``-element group, ``--calls`` pushes returning X and as many
  plain pushes a round (gRPC, unary); p50 and p90 in µs;
- ``--mib`` MiB: push, pull (a new array) and push returning X, over gRPC streams
  (``shared_memory="off", data_channel="off", transport="stream"``), over the data
  channel (``data_channel="on", shared_memory="off"``) and through shared memory
  (``shared_memory="on", data_channel="off"``, same host); a bfloat16-encoded push
  on the data channel. ``--reps`` calls a round; the round's figure is their median.

Every measurement is made on both sides back to back, the side that goes first
alternating each round; round 0 warms up and is not counted. Prints, per
measurement, the median over rounds and the spread (min-max) of each side, the
ratio new/old (below 1: this tree is faster) and in how many rounds this tree was
the faster. The machine may be shared: read the ratios, and the spreads.
"""

from __future__ import annotations

import argparse
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
    calls."""
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
        unary.create_group(SMALL, Adam(), learning_rate=1e-3, tensors={"s": small_x})
        unary.create_group(BIG, Adam(), learning_rate=1e-3, tensors={"w": x0})
        del x0

        def small_calls(kind: str, calls: int) -> list[float]:
            ret = kind == "push returning X"
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                unary.push(SMALL, small_g, return_values=ret)
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
            if path == SMALL:
                return small_calls(kind, reps)
            got = [big_call(clients[path], kind, encoding) for _ in range(reps)]
            return statistics.median(got)

        serve_requests(call, "ready")
    finally:
        for c in [unary, *clients.values()]:
            c.close()


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


# A round's figures from one answer: (row name, value)
Rows = list[tuple[str, float]]


def _measurements(args: argparse.Namespace) -> list[tuple[str, list[Any]]]:
    out: list[tuple[str, list[Any]]] = []
    for kind in ("push returning X", "push"):
        out.append((f"{args.small} float32 {kind}, gRPC", [SMALL, kind, args.calls]))
    for path in PATHS:
        for kind in ("push", "pull", "push returning X"):
            out.append((f"{args.mib} MiB {kind}, {path}", [path, kind, args.reps]))
    bf16 = ["data channel", "push", args.reps, "bfloat16"]
    out.append((f"{args.mib} MiB bfloat16 push, data channel", bf16))
    return out


def _figures(name: str, answer: Any) -> Rows:
    if isinstance(answer, list):  # the small calls' seconds: p50 and p90 in µs
        us = [v * 1e6 for v in answer]
        return [
            (f"{name} p50 µs", statistics.median(us)),
            (f"{name} p90 µs", _percentile(us, 0.9)),
        ]
    return [(f"{name} ms", answer * 1e3)]


def _run(
    workers: list[Worker], measurements: list[tuple[str, list[Any]]], rounds: int
) -> dict[str, list[list[float]]]:
    """figure name -> [this tree's per-round values, the baseline's]"""
    table: dict[str, list[list[float]]] = {}
    for r in range(rounds + 1):  # round 0 warms up
        order = (0, 1) if r % 2 else (1, 0)
        t0 = time.monotonic()
        for name, request in measurements:
            for side in order:
                answer = workers[side].call(*request)
                if not r:
                    continue
                for fig, value in _figures(name, answer):
                    table.setdefault(fig, [[], []])[side].append(value)
        first = "new" if order[0] == 0 else "old"
        label = "warm-up" if not r else f"round {r}"
        print(f"{label}: {first} first, {time.monotonic() - t0:.0f} s", flush=True)
    return table


def _cell(values: list[float]) -> str:
    med = statistics.median(values)
    digits = 0 if med >= 100 else 1
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def _report(table: dict[str, list[list[float]]], labels: tuple[str, str]) -> None:
    width = max(len(k) for k in table)
    head = f"{'':{width}s}  {'new ' + labels[0]:>24s}  {'old ' + labels[1]:>24s}"
    print(f"\nmedian (min-max) over rounds\n{head}  new/old  new faster")
    for fig, (new, old) in table.items():
        ratio = statistics.median(new) / statistics.median(old)
        wins = sum(a < b for a, b in zip(new, old, strict=True))
        print(
            f"{fig:{width}s}  {_cell(new):>24s}  {_cell(old):>24s}  {ratio:7.2f}"
            f"  {wins} of {len(new)}"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="counted rounds (5)")
    p.add_argument("--mib", type=int, default=64, help="the big group's MiB (64)")
    p.add_argument("--reps", type=int, default=3, help="big calls a round (3)")
    p.add_argument("--small", type=int, default=1000, help="small elements (1000)")
    p.add_argument("--calls", type=int, default=200, help="small calls a round")
    p.add_argument(
        "--baseline",
        default=BASELINE,
        metavar="REV",
        help=f"the commit to compare against (default {BASELINE})",
    )
    p.add_argument("--worker", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.mib, args.small)
        return
    if args.rounds < 1 or args.reps < 1 or args.calls < 1:
        p.error("--rounds, --reps and --calls must be >= 1")
    print(f"new: {describe(None)}\nold: {describe(args.baseline)}", flush=True)
    from onnxps.cli.process import start_server_process, stop_processes

    started = time.monotonic()
    procs: list[subprocess.Popen[bytes]] = []
    workers: list[Worker] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        checkout(None) as current,
        checkout(args.baseline) as baseline,
    ):
        try:
            for side, found in enumerate((current, baseline)):
                log = Path(tmp) / f"server-{side}.log"
                proc, address = start_server_process(
                    "--data-port", "0", log=log, env=tree_env(found.tree)
                )
                procs.append(proc)
                script = [__file__, "--worker", address, "--mib", str(args.mib)]
                script += ["--small", str(args.small)]
                workers.append(Worker(found, script, Path(tmp) / f"worker-{side}.log"))
            table = _run(workers, _measurements(args), args.rounds)
            _report(table, (current.label, baseline.label))
        finally:
            for w in workers:
                w.close()
            stop_processes(procs, timeout=15)
    print(f"\n{time.monotonic() - started:.0f} s in all")


if __name__ == "__main__":
    main()
