"""A/B of a streamed push's server side, in one process, alternating rounds.

    python benchmarks/receive_ab.py [--rounds 9] [--pushes 5] [--mib 64]

The gRPC transport is left out (on a shared 2-core VM its wall time swings by 2x
between rounds and hides a few milliseconds): each variant gets the same 1 MiB
chunks gRPC would hand the servicer (views of ``bytes``), receives them into the
gradient and pushes it to a ``ParameterStore`` (64 MiB float32 Adam group):

- ``pooled``: chunks copied into a gradient buffer reused per group
  (``GradientPool``), each checked for NaN and inf as it lands (``receive``), then
  ``store.push(known_finite=True)``, which steps (what the server does);
- ``unpooled``: the same with a pool that keeps nothing
  (``--gradient-pool-bytes 0``, a public setting): a freshly allocated gradient.

(The check before chunks landed, as it was, is the commit before the check as
they land: its figures are in docs/benchmarks.md.)

Per push: ``receive ms`` (all chunks in: on a real stream this overlaps waiting for
the network), ``tail ms`` (from the last chunk to the push's return: what the
client waits for after sending its last byte) and ``total ms``. Medians over rounds
of each round's median, and the min-max of the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from onnxps.server.kernels import make_attrs
from onnxps.server.store import ParameterStore
from onnxps.server.transports._receive import GradientPool, receive
from onnxps.wire.codec import RawChunk, TensorAssembler, header_tensor

MIB = 1 << 20
FIGURES = ("receive ms", "tail ms", "total ms")


class _Chunk:
    def __init__(self, raw: RawChunk) -> None:
        self.chunk = raw

    def WhichOneof(self, name: str) -> str:  # noqa: N802 - the protobuf spelling
        return "chunk"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--pushes", type=int, default=5)
    p.add_argument("--mib", type=int, default=64)
    args = p.parse_args()
    n = args.mib * MIB // 4
    store = ParameterStore()
    attrs = make_attrs("Adam", {})
    store.create_group(
        "g", attrs, 1e-3, [("x", np.linspace(-1, 1, n, dtype=np.float32))]
    )
    g = np.full(n, 1e-3, np.float32)
    raw = memoryview(g).cast("B")
    chunks = [
        RawChunk(0, s, memoryview(bytes(raw[s : s + MIB])))
        for s in range(0, len(raw), MIB)
    ]
    headers = [header_tensor(g, "x")]
    spec = [(np.dtype(np.float32), (n,))]

    def pushed(pool: GradientPool) -> Callable[[], tuple[float, float]]:
        def push() -> tuple[float, float]:
            t0 = time.perf_counter()
            with pool.lease("g", spec) as lease:
                asm = TensorAssembler(headers, ["x"], encoded=True, out=lease.arrays)
                got = receive(iter(_Chunk(c) for c in chunks), asm)
                t1 = time.perf_counter()
                ticket = store.validate_push("g", iter(spec))
                store.push(ticket, got.arrays, known_finite=got.finite)
                return t1 - t0, time.perf_counter() - t1

        return push

    variants = {
        "pooled": pushed(GradientPool()),
        "unpooled": pushed(GradientPool(max_bytes=0)),
    }
    for fn in variants.values():  # warm: kernels compiled, the pool filled
        fn()
    results: dict[str, list[dict[str, float]]] = {k: [] for k in variants}
    for r in range(args.rounds):
        names = list(variants)
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            times = [variants[name]() for _ in range(args.pushes)]
            res = {
                "receive ms": 1e3 * statistics.median(t[0] for t in times),
                "tail ms": 1e3 * statistics.median(t[1] for t in times),
                "total ms": 1e3 * statistics.median(t[0] + t[1] for t in times),
            }
            results[name].append(res)
            figs = "  ".join(f"{k} {v:6.1f}" for k, v in res.items())
            print(f"round {r + 1} {name:6s}: {figs}", flush=True)
    print(
        f"\n{args.mib} MiB float32 Adam push, server side; median (min-max of rounds)"
    )
    print(f"{'figure':11s}" + "".join(f"{k:>20s}" for k in variants) + "  ratio")
    for f in FIGURES:
        cells, med = [], {}
        for k in variants:
            vals = [x[f] for x in results[k]]
            med[k] = statistics.median(vals)
            cells.append(f"{med[k]:.1f} ({min(vals):.1f}-{max(vals):.1f})")
        ratio = med["pooled"] / med["unpooled"]
        print(f"{f:11s}" + "".join(f"{c:>20s}" for c in cells) + f"  {ratio:12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
