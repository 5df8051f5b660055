"""Overlap benchmark: a worker that computes while its pushes travel.

    python benchmarks/overlap.py [--rounds 5] [--steps 20] [--compute sleep|numpy]

The server runs as a separate process (``onnxps serve`` with no flag but a free loopback
port: its defaults) and the clients take no transport option, so every figure is what a
user gets with no flags. It holds one 16 MiB float32 group (Adam, async, max_staleness
1). Figures, in alternating rounds so that a busy machine slows every variant alike
(median and min..max of the rounds):

- steps/s of the blocking loop (compute, then push and take the new parameters in one
  call) vs the overlapped loop of examples/overlap_worker.py (push step k in the
  background, compute step k+1, then take push k's result), with a compute per step
  calibrated to the measured push+pull time. ``--compute sleep`` stands for an
  accelerator (the host waits); ``--compute numpy`` keeps a core busy instead.
- pushes/s of 1 and 8 concurrent pushes from one AsyncClient (tasks of one event
  loop) vs one Client (1 thread, 8 threads).

The machine may be shared: read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from onnxps.cli.process import start_default_server, stop_processes
from onnxps.client import Adam, Async, AsyncClient, Client

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from overlap_worker import train_blocking, train_overlapped  # noqa: E402

Array = np.ndarray[Any, Any]
MIB = 1 << 20
ELEMENTS = 16 * MIB // 4  # float32: 16 MiB
GROUP = "overlap"


def _busy(seconds: float) -> None:
    """Keep one core busy for about ``seconds`` with NumPy work (a stand-in model)."""
    a = np.ones((256, 256), np.float32)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = np.tanh(a @ a * 1e-3)


def make_compute(seconds: float, kind: str, grads: list[Array]) -> Callable[..., Any]:
    wait = time.sleep if kind == "sleep" else _busy

    def compute(params: Sequence[Array]) -> list[Array]:
        wait(seconds)
        return grads  # never written: a streamed push may still be reading them

    return compute


def round_trip(ps: Client, grads: list[Array], n: int) -> float:
    """Median seconds of one push that returns the new parameters (push + pull)."""
    times = []
    for _ in range(n):
        started = time.perf_counter()
        ps.push_detailed(GROUP, *grads, return_values=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def loop_rate(ps: Client, loop: Callable[..., int], compute: Any, steps: int) -> float:
    started = time.perf_counter()
    loop(ps, GROUP, compute, steps)
    return steps / (time.perf_counter() - started)


def threads_rate(ps: Client, grads: list[Array], width: int, pushes: int) -> float:
    def work() -> None:
        for _ in range(pushes // width):
            ps.push(GROUP, *grads)

    threads = [threading.Thread(target=work) for _ in range(width)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return pushes / (time.perf_counter() - started)


async def tasks_rate(
    ps: AsyncClient, grads: list[Array], width: int, pushes: int
) -> float:
    async def work() -> None:
        for _ in range(pushes // width):
            await ps.push(GROUP, *grads)

    started = time.perf_counter()
    await asyncio.gather(*(work() for _ in range(width)))
    return pushes / (time.perf_counter() - started)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f}   {min(values):.2f}..{max(values):.2f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pushes", type=int, default=16)
    ap.add_argument("--compute", choices=("sleep", "numpy"), default="sleep")
    args = ap.parse_args()

    workdir = tempfile.TemporaryDirectory()  # noqa: SIM115
    here = Path(workdir.name)
    proc, address = start_default_server(here, log=here / "server.log")
    rates: dict[str, list[float]] = {}
    try:
        x = np.zeros(ELEMENTS, np.float32)
        grads = [np.full(ELEMENTS, 1e-3, np.float32)]
        with Client(address, timeout=120) as ps:
            ps.create_group(
                GROUP,
                Adam(),
                learning_rate=1e-3,
                tensors={"x": x},
                consistency=Async(max_staleness=1),
            )
            rt = round_trip(ps, grads, 5)
            compute = make_compute(rt, args.compute, grads)
            print(
                f"16 MiB group: push+pull {rt * 1e3:.0f} ms; compute per step "
                f"{rt * 1e3:.0f} ms ({args.compute})"
            )

            async def async_rates(width: int) -> float:
                async with AsyncClient(address, timeout=120) as aps:
                    await aps.push(GROUP, *grads)  # opens the channel
                    return await tasks_rate(aps, grads, width, args.pushes)

            variants: dict[str, Callable[[], float]] = {
                "blocking loop (steps/s)": lambda: loop_rate(
                    ps, train_blocking, compute, args.steps
                ),
                "overlapped loop (steps/s)": lambda: loop_rate(
                    ps, train_overlapped, compute, args.steps
                ),
                "Client, 1 thread (pushes/s)": lambda: threads_rate(
                    ps, grads, 1, args.pushes
                ),
                "Client, 8 threads (pushes/s)": lambda: threads_rate(
                    ps, grads, 8, args.pushes
                ),
                "AsyncClient, 1 task (pushes/s)": lambda: asyncio.run(async_rates(1)),
                "AsyncClient, 8 tasks (pushes/s)": lambda: asyncio.run(async_rates(8)),
            }
            for _ in range(args.rounds):
                for name, measure in variants.items():
                    rates.setdefault(name, []).append(measure())
    finally:
        stop_processes([proc], timeout=60)  # it writes its snapshot on the way out
        workdir.cleanup()
    print(f"{'':34} {'median':>7}   min..max over {args.rounds} rounds")
    for name, values in rates.items():
        print(f"{name:34} {_spread(values)}")
    ratio = [
        o / b
        for o, b in zip(
            rates["overlapped loop (steps/s)"],
            rates["blocking loop (steps/s)"],
            strict=True,
        )
    ]
    print(f"{'overlapped / blocking':34} {_spread(ratio)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
