"""A/B: encoded calls on the data channel, encoded block by block as they are sent
(the default) against encoded whole before sending (the baseline, as before).

    python benchmarks/encode_overlap_ab.py [--rounds 9] [--mib 64]

- push: the client encodes G. Two clients of one server (``--data-port 0``); the
  baseline client encodes each gradient whole first.
- pull: the server encodes X, the client widens it. Two server processes, each
  with a data port; the baseline one encodes X whole first (its
  ``_deferred_values`` wrapped to encode every tensor before the frame is sent, as
  before the change), and its client widens the frame once it has all landed.
  "overlapped": the new server, the client widening each block as it lands (into a
  new array; with ``out=``: into ``out``).

Each round makes every call through both variants, alternating which goes first,
and a native call on the data channel for scale. Prints the median and spread
(min-max), the ratio, and in how many rounds the overlapped call was the faster. The
machine may be shared: read the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from onnxps.cli.process import start_server_process, stop_processes, wait_for_listening
from onnxps.client import Adam, Client

MIB = 1 << 20
_WHOLE_FIRST_SERVER = (
    "import sys; import onnxps.server.service as s; "
    "lazy = s._deferred_values; "
    "s._deferred_values = lambda *a: [x.encoded() if isinstance(x, s.DeferredEncoding)"
    " else x for x in lazy(*a)]; "
    "from onnxps.cli import main; sys.exit(main(sys.argv[1:]))"
)


class WholeFirst(Client):
    """The baseline client: every encoded gradient is encoded whole before
    sending, and a pulled X widened once its whole frame has landed."""

    _WIDENS_AS_IT_LANDS = False

    def _defers_encoding(self) -> bool:
        return False


def _rounds(
    calls: dict[str, Callable[[], Any]], scale: Callable[[], Any], rounds: int
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in calls}
    times["native (scale)"] = []
    for r in range(rounds + 1):  # round 0 warms up
        order = list(calls.items())
        if r % 2:
            order.reverse()
        for name, fn in [*order, ("native (scale)", scale)]:
            t0 = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - t0)
    return times


def _report(title: str, times: dict[str, list[float]]) -> None:
    print(f"\n{title} (ms, median (min-max))")
    for name, t in times.items():
        ms = [v * 1e3 for v in t]
        print(
            f"  {name:22s} {statistics.median(ms):7.1f} ({min(ms):.1f}-{max(ms):.1f})"
        )
    a, b = times["overlapped"], times["encoded whole first"]
    wins = sum(x < y for x, y in zip(a, b, strict=True))
    ratio = statistics.median(a) / statistics.median(b)
    print(f"  overlapped / whole first: {ratio:.2f}x, faster in {wins} of {len(a)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--mib", type=int, default=64)
    args = p.parse_args()
    n = args.mib * MIB // 4
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal(n, dtype=np.float32)
    grad = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
    into = np.empty_like(x0)
    opts: dict[str, Any] = {"data_channel": "on", "shared_memory": "off"}
    opts["timeout"] = 600
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc, address = start_server_process(
                "--data-port", "0", log=Path(tmp) / "server.log"
            )
            procs.append(proc)
            log = Path(tmp) / "whole-first.log"
            cmd = [sys.executable, "-c", _WHOLE_FIRST_SERVER, "serve", "--data-port"]
            cmd += ["0", "--address", "127.0.0.1:0", "--durability", "none"]
            with open(log, "wb") as out:
                base = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
            procs.append(base)
            base_address = wait_for_listening(base, log)
            with (
                Client(address, **opts) as over,
                WholeFirst(address, **opts) as whole,
                WholeFirst(base_address, **opts) as whole_server,
            ):
                for name, c in (("over", over), ("whole", whole), ("w", whole_server)):
                    c.create_group(name, Adam(), learning_rate=1e-3, tensors={"w": x0})
                for enc in ("bfloat16", "float16"):
                    pushes = {
                        "overlapped": lambda e=enc: over.push("over", grad, encoding=e),
                        "encoded whole first": lambda e=enc: whole.push(
                            "whole", grad, encoding=e
                        ),
                    }
                    native = lambda: over.push("over", grad)  # noqa: E731
                    times = _rounds(pushes, native, args.rounds)
                    _report(f"{args.mib} MiB float32, {enc} push", times)
                    pulls = {
                        "overlapped": lambda e=enc: over.pull("over", encoding=e),
                        "overlapped, out=": lambda e=enc: over.pull(
                            "over", encoding=e, out=[into]
                        ),
                        "encoded whole first": lambda e=enc: whole_server.pull(
                            "w", encoding=e
                        ),
                    }
                    native = lambda: over.pull("over", out=[into])  # noqa: E731
                    times = _rounds(pulls, native, args.rounds)
                    _report(f"{args.mib} MiB float32, {enc} pull", times)
        finally:
            stop_processes(procs, timeout=15)


if __name__ == "__main__":
    main()
