"""A/B: encoded calls on the data channel, encoded block by block as they are sent
(this working tree) against an older commit that encodes whole before sending.

    python benchmarks/encode_overlap_ab.py [--rounds 9] [--mib 64] [--baseline REV]

The baseline is a commit (default 6a7a5fc: encoded pushes and pulls on the data
channel, each tensor encoded whole before its frame is sent, and a pulled X widened
once the whole frame has landed; 81e8874 and 19b1f62 overlapped them). Each side is
its own checkout (benchmarks/_baseline.py: ``git archive`` of the commit, its
package-dir mapping as a symlink tree on PYTHONPATH) with its own server
(``--data-port 0``) and a worker process for its client, driven over a pipe; the
worker times each call.

- push: the client encodes G, the server widens it.
- pull: the server encodes X, the client widens it (into a new array; with
  ``out=``: into ``out``).

Each round makes every call on both sides, alternating which side goes first, and
a native call on the data channel (this tree) for scale. Prints the median and
spread (min-max), the ratio, and in how many rounds the overlapped call was the
faster. The machine may be shared: read the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from _baseline import Worker, checkout, describe, serve_requests, tree_env

MIB = 1 << 20
BASELINE = "6a7a5fc"
NATIVE = "native (scale)"


def _worker(address: str, mib: int) -> None:
    """The worker: one client of ``address`` whose group "w" holds ``mib`` MiB of
    float32; answers ``[call, encoding, out]`` with the call's seconds."""
    import time

    import numpy as np
    from onnxps.client import Adam, Client

    n = mib * MIB // 4
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal(n, dtype=np.float32)
    grad = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
    into = np.empty_like(x0)
    opts: dict[str, Any] = {"data_channel": "on", "shared_memory": "off"}
    with Client(address, timeout=600, **opts) as client:
        client.create_group("w", Adam(), learning_rate=1e-3, tensors={"w": x0})

        def call(kind: str, encoding: str, out: bool) -> float:
            t0 = time.perf_counter()
            if kind == "push":
                client.push("w", grad, encoding=encoding)
            else:
                client.pull("w", encoding=encoding, out=[into] if out else None)
            return time.perf_counter() - t0

        serve_requests(call, "ready")


# (row, side, call): side 0 is this tree, 1 the baseline
Row = tuple[str, int, list[Any]]


def _rounds(
    rows: list[Row], scale: Row, workers: list[Worker], rounds: int
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name, _, _ in [*rows, scale]}
    for r in range(rounds + 1):  # round 0 warms up
        order = sorted(rows, key=lambda row: row[1], reverse=bool(r % 2))
        for name, side, request in [*order, scale]:
            seconds = workers[side].call(*request)
            if r:
                times[name].append(seconds)
    return times


def _report(
    title: str, times: dict[str, list[float]], pairs: list[tuple[str, str]]
) -> None:
    print(f"\n{title} (ms, median (min-max))")
    for name, t in times.items():
        ms = [v * 1e3 for v in t]
        print(
            f"  {name:24s} {statistics.median(ms):7.1f} ({min(ms):.1f}-{max(ms):.1f})"
        )
    for new, old in pairs:
        a, b = times[new], times[old]
        wins = sum(x < y for x, y in zip(a, b, strict=True))
        ratio = statistics.median(a) / statistics.median(b)
        print(f"  {new} / {old}: {ratio:.2f}x, faster in {wins} of {len(a)}")


def _tables(workers: list[Worker], mib: int, rounds: int) -> None:
    whole = "encoded whole first"
    for enc in ("bfloat16", "float16"):
        pushes: list[Row] = [
            ("overlapped", 0, ["push", enc, False]),
            (whole, 1, ["push", enc, False]),
        ]
        native: Row = (NATIVE, 0, ["push", "native", False])
        times = _rounds(pushes, native, workers, rounds)
        _report(f"{mib} MiB float32, {enc} push", times, [("overlapped", whole)])
        pulls: list[Row] = [
            ("overlapped", 0, ["pull", enc, False]),
            ("overlapped, out=", 0, ["pull", enc, True]),
            (whole, 1, ["pull", enc, False]),
            ("whole first, out=", 1, ["pull", enc, True]),
        ]
        native = (NATIVE, 0, ["pull", "native", True])
        times = _rounds(pulls, native, workers, rounds)
        pairs = [("overlapped", whole), ("overlapped, out=", "whole first, out=")]
        _report(f"{mib} MiB float32, {enc} pull", times, pairs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument(
        "--baseline",
        default=BASELINE,
        metavar="REV",
        help=f"the commit to compare against (default {BASELINE})",
    )
    p.add_argument("--worker", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.mib)
        return
    print(f"this tree: {describe(None)}\nbaseline:  {describe(args.baseline)}")
    from onnxps.cli.process import start_server_process, stop_processes

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
                workers.append(Worker(found, script, Path(tmp) / f"worker-{side}.log"))
            _tables(workers, args.mib, args.rounds)
        finally:
            for w in workers:
                w.close()
            stop_processes(procs, timeout=15)


if __name__ == "__main__":
    main()
