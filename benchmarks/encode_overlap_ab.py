"""A/B: an encoded push on the data channel, encoded block by block as it is sent
(the default) against encoded whole before sending (the baseline, as before).

    python benchmarks/encode_overlap_ab.py [--rounds 9] [--mib 64]

One server process (``onnxps serve --data-port 0``), one float32 Adam group of
``--mib`` MiB per client; each round pushes the same gradient through both clients,
alternating which goes first. Prints the median and spread (min-max) of each, their
ratio, and in how many rounds the overlapped push was the faster. A native push on
the data channel is timed in the same rounds for scale. The machine may be shared:
read the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from onnxps.cli.process import start_server_process, stop_processes
from onnxps.client import Adam, Client

MIB = 1 << 20


class WholeFirst(Client):
    """The baseline: every encoded gradient is encoded whole before sending."""

    def _defers_encoding(self) -> bool:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--mib", type=int, default=64)
    args = p.parse_args()
    n = args.mib * MIB // 4
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal(n, dtype=np.float32)
    grad = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
    opts = {"data_channel": "on", "shared_memory": "off", "timeout": 600}
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_server_process(
            "--data-port", "0", log=Path(tmp) / "server.log"
        )
        try:
            with Client(address, **opts) as over, WholeFirst(address, **opts) as whole:
                variants = {"overlapped": over, "encoded whole first": whole}
                for name, c in variants.items():
                    c.create_group(name, Adam(), learning_rate=1e-3, tensors={"w": x0})
                for enc in ("bfloat16", "float16"):
                    times: dict[str, list[float]] = {k: [] for k in variants}
                    times["native (scale)"] = []
                    for r in range(args.rounds + 1):  # round 0 warms up
                        order = list(variants.items())
                        if r % 2:
                            order.reverse()
                        for name, c in order:
                            t0 = time.perf_counter()
                            c.push(name, grad, encoding=enc)
                            if r:
                                times[name].append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        over.push("overlapped", grad, encoding="native")
                        if r:
                            times["native (scale)"].append(time.perf_counter() - t0)
                    print(
                        f"\n{args.mib} MiB float32, {enc} push on the data channel, "
                        f"{args.rounds} alternating rounds (ms, median (min-max))"
                    )
                    for name, t in times.items():
                        ms = [v * 1e3 for v in t]
                        print(
                            f"  {name:22s} {statistics.median(ms):7.1f} "
                            f"({min(ms):.1f}-{max(ms):.1f})"
                        )
                    a, b = times["overlapped"], times["encoded whole first"]
                    wins = sum(x < y for x, y in zip(a, b, strict=True))
                    print(
                        f"  overlapped / whole first: "
                        f"{statistics.median(a) / statistics.median(b):.2f}x, "
                        f"faster in {wins} of {len(a)} rounds"
                    )
        finally:
            stop_processes([proc], timeout=15)


if __name__ == "__main__":
    main()
