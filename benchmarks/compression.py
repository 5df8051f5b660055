"""Compressed gradients on the wire: native vs bfloat16 vs float16, push and pull.

    python benchmarks/compression.py [--rounds N] [--mib 64]

The server runs as a separate process (``onnxps serve`` on a free loopback port) and
holds one float32 Adam group of ``--mib`` MiB (64 by default). Each round pushes one
gradient and pulls X in every encoding, alternating, so that all of them see the same
machine load; the table gives the median over the rounds and the spread (min-max).

- bytes: the tensor bytes the call carries (its messages add a few hundred bytes).
- ms: the whole call, client-side encoding (push) or widening (pull) included.
- GB/s: logical data (the float32 tensor, 4 bytes per element) per second.

Then the codec alone, in this process: encode (float32 -> 2 bytes, round to nearest
even, overflow check) and widen (2 bytes -> float32) in ns per element, on both codec
paths alternating (``numpy``: block passes; ``numba``: the compiled loops, when numba
is installed), the NumPy path being the baseline.

The wire table's first rows (``no flags``) are ``Client(address)`` against ``onnxps
serve`` with no flags (its defaults: on one host, shared memory for calls of 64 KiB
or more): what a user gets. The rows after them set what they name.

``--paths numpy,numba`` runs the wire table once per codec path, alternating within
each round: two servers (``ONNXPS_KERNELS=numpy`` and the default), the client
switching its own path with them. ``--transports stream,data`` (the default) runs it
over gRPC streams and over the data channel (``--data-port``), alternating too.

The machine may be shared: read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from onnxps.cli.process import (
    start_default_server,
    start_server_process,
    stop_processes,
)
from onnxps.client import Adam, Client
from onnxps.wire.codec import decode, encode
from onnxps.wire.encoding import compiled_codec

MIB = 1 << 20
ENCODINGS = ("native", "bfloat16", "float16")


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _spread(values: list[float], scale: float, fmt: str) -> str:
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{mid * scale:{fmt}} ({lo * scale:{fmt}}-{hi * scale:{fmt}})"


def _use_path(path: str) -> None:
    os.environ["ONNXPS_KERNELS"] = path


def wire(
    addresses: dict[str, str],
    elements: int,
    rounds: int,
    transports: list[str],
    default_address: str,
) -> list[list[str]]:
    """Push and pull in every encoding: first ``Client(address)`` against a server
    with no flags (``default_address``), then through each codec path's server, on
    each transport (gRPC streams; the data channel)."""
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal(elements, dtype=np.float32)
    grad = rng.standard_normal(elements, dtype=np.float32) * np.float32(1e-3)
    times: dict[tuple[str, str, str], list[float]] = {}
    clients = {"no flags": Client(default_address, timeout=600)}
    for path, address in addresses.items():
        for transport in transports:
            opts: dict[str, Any] = {
                "data_channel": "on" if transport == "data" else "off",
                "shared_memory": "off",
            }
            clients[f"{path}/{transport}"] = Client(address, timeout=600, **opts)
    try:
        for name, c in clients.items():
            c.create_group(name, Adam(), learning_rate=1e-3, tensors={"w": x0})
        for r in range(rounds + 1):  # the first round warms up
            for path, c in clients.items():
                _use_path("auto" if path == "no flags" else path.split("/")[0])
                for enc in ENCODINGS:
                    push = _timed(
                        lambda e=enc, c=c, n=path: c.push(n, grad, encoding=e)
                    )
                    pull = _timed(lambda e=enc, c=c, n=path: c.pull(n, encoding=e))
                    if r:
                        times.setdefault(("push", enc, path), []).append(push)
                        times.setdefault(("pull", enc, path), []).append(pull)
    finally:
        for c in clients.values():
            c.close()
    logical = elements * 4
    rows = []
    for what in ("push", "pull"):
        for path in clients:
            base = statistics.median(times[(what, "native", path)])
            for enc in ENCODINGS:
                t = times[(what, enc, path)]
                nbytes = logical if enc == "native" else elements * 2
                rows.append(
                    [
                        what,
                        enc,
                        path,
                        f"{nbytes:,}",
                        _spread(t, 1e3, ".1f"),
                        f"{logical / statistics.median(t) / 1e9:.2f}",
                        f"{statistics.median(t) / base:.2f}x",
                    ]
                )
    return rows


def codec(elements: int, rounds: int, paths: list[str]) -> list[list[str]]:
    g = np.random.default_rng(1).standard_normal(elements, dtype=np.float32)
    times: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(rounds + 1):  # the first round warms up (and compiles)
        for path in paths:
            _use_path(path)
            for enc in ("bfloat16", "float16"):
                encoded = encode(g, enc)
                e_t = _timed(lambda e=enc: encode(g, e))
                d_t = _timed(lambda e=encoded: decode(e))
                times.setdefault(("encode", enc, path), []).append(e_t)
                times.setdefault(("widen", enc, path), []).append(d_t)
    rows = []
    for (what, enc, path), t in times.items():
        t = t[1:]
        base = statistics.median(times[(what, enc, "numpy")][1:])
        rows.append(
            [
                what,
                enc,
                path,
                _spread(t, 1e9 / elements, ".2f"),
                f"{statistics.median(t) / base:.2f}x",
            ]
        )
    copy_t = [_timed(g.copy) for _ in range(rounds)]
    rows.append(
        ["copy (for scale)", "float32", "-", _spread(copy_t, 1e9 / elements, ".2f"), ""]
    )
    return rows


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--mib", type=int, default=64, help="size of X (float32)")
    p.add_argument(
        "--paths",
        default="auto",
        help="codec paths of the wire table, comma-separated: auto (the default: "
        "numba when installed), numpy, numba",
    )
    p.add_argument(
        "--transports",
        default="stream,data",
        help="comma-separated: stream (gRPC streams), data (the data channel)",
    )
    args = p.parse_args()
    transports = [s.strip() for s in args.transports.split(",") if s.strip()]
    elements = args.mib * MIB // 4
    wire_paths = [s.strip() for s in args.paths.split(",") if s.strip()]
    codec_paths = ["numpy"] + (["numba"] if compiled_codec() is not None else [])
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc, default_address = start_default_server(
                Path(tmp) / "default", log=Path(tmp) / "default.log"
            )
            procs.append(proc)
            addresses = {}
            for path in wire_paths:
                proc, addresses[path] = start_server_process(
                    "--data-port",
                    "0",
                    log=Path(tmp) / f"{path}.log",
                    env={**os.environ, "ONNXPS_KERNELS": path},
                )
                procs.append(proc)
            rows = wire(addresses, elements, args.rounds, transports, default_address)
        finally:
            stop_processes(procs, timeout=60)  # the default one writes a snapshot
    print(
        f"{args.mib} MiB float32 Adam group, server in its own process, loopback, "
        f"{args.rounds} alternating rounds: median (min-max)\n"
    )
    header = [
        "call", "encoding", "codec path/transport", "tensor bytes", "ms",
        "GB/s logical",
        "vs native",
    ]  # fmt: skip
    print(_table(header, rows))
    print(
        f"\ncodec in this process, {elements:,} float32 elements, {args.rounds} "
        "alternating rounds: ns/element, median (min-max); vs the NumPy path\n"
    )
    rows = codec(elements, args.rounds, codec_paths)
    print(_table(["", "encoding", "path", "ns/element", "vs numpy"], rows))


if __name__ == "__main__":
    main()
